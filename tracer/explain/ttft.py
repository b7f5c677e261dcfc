"""A request's time to first token in parts that add up to it, and whom it queued behind.

Parts (seconds, every key always present, 0.0 where the layout has no such stage):

- `frontend`: the request span's start (the router's arrival) to the first stage span's start (queue, else
  prefill): routing, tokenisation, the hop to the worker.
- `queue`: the `splitscope.queue` span (waiting on the worker for a step to take the prompt).
- `prefill`: the `splitscope.prefill` span (all its chunks, and the steps between them).
- `kv_transfer`: the `splitscope.kv_transfer` stage span, the exposed transfer (disaggregated only).
- `decode_wait`: from the KV being ready to the decode worker's `splitscope.decode` span starting, on the
  sender's clock (the decode span minus `splitscope.clock.offset_ns`): the decode worker finishing the
  step in flight (and any wait for blocks) before it takes the request. For a vLLM P/D pair (one
  engine request span per instance), to the decode instance's first token, its first step included:
  there the client's first token comes from the decode instance (the prefill instance answers the proxy),
  and `kv_transfer` is the decode instance's wait for the KV (vLLM's queue there, sidecar-mapped).
- `unexplained`: TTFT minus all of the above: the first token's trip back to the client, gaps between
  stages no span covers. It is its own part so the parts always add up to the TTFT exactly; it can be
  slightly negative when spans from two clocks (CUDA placement, another host) overlap the boundary.

Stages are never double counted: architecture.md section 4 guarantees a request's stage spans do not
overlap. Without stage spans (a request that failed early) everything is `unexplained`.
"""

from __future__ import annotations

import math
from typing import Any

from tracer import spans as s
from tracer.explain.read import ExplainData, Trace

PARTS = ("frontend", s.Stage.QUEUE, s.Stage.PREFILL, s.Stage.KV_TRANSFER, "decode_wait", "unexplained")


def ttft_parts_s(trace: Trace) -> dict[str, float]:
    """The parts above for `trace` (which has a request span); all NaN when its TTFT is unknown."""
    ttft_s = trace.ttft_s
    if math.isnan(ttft_s) or trace.root is None:
        return {part: math.nan for part in PARTS}
    parts = dict.fromkeys(PARTS, 0.0)
    queue, prefill = trace.first(s.SPAN_QUEUE), trace.first(s.SPAN_PREFILL)
    transfer, decode = trace.first(s.SPAN_KV_TRANSFER), trace.first(s.SPAN_DECODE)
    first_stage = queue or prefill
    if first_stage is not None:
        parts["frontend"] = max(0.0, (first_stage.start_ns - trace.root.start_ns) / 1e9)
    if queue is not None:
        parts["queue"] = queue.duration_s
    if prefill is not None:
        parts[s.Stage.PREFILL] = prefill.duration_s
    if transfer is not None:
        parts["kv_transfer"] = transfer.duration_s
        if decode is not None:
            offset_ns = transfer.attributes.get(s.ATTR_CLOCK_OFFSET_NS)
            offset_ns = offset_ns if isinstance(offset_ns, int) and not isinstance(offset_ns, bool) else 0
            parts["decode_wait"] = max(0.0, (decode.start_ns - offset_ns - transfer.end_ns) / 1e9)
            first_ns = trace.decode_side_first_token_ns
            if first_ns is not None:  # a vLLM P/D pair: the sidecars place both halves on one timeline
                parts["decode_wait"] = max(0.0, (first_ns - transfer.end_ns) / 1e9)
    parts["unexplained"] = ttft_s - sum(parts[part] for part in PARTS[:-1])
    return parts


def queued_behind(data: ExplainData, trace: Trace) -> list[dict[str, Any]]:
    """The requests ahead of `trace` on its worker when it arrived there (its queue span's start): those
    still queued (`state` "queued") and those in prefill (`state` "prefill"), by their start; each with
    its trace id and uncached prompt tokens (what the worker had to prefill before this one)."""
    queue = trace.first(s.SPAN_QUEUE)
    if queue is None:
        return []
    worker = queue.attributes.get(s.ATTR_WORKER)
    if not isinstance(worker, str):
        return []
    arrival_ns = queue.start_ns
    prefill_tokens = {p.trace_id: p.tokens for p in data.on_worker(worker, s.SPAN_PREFILL)}
    ahead: list[tuple[int, dict[str, Any]]] = []
    for name, state in ((s.SPAN_QUEUE, "queued"), (s.SPAN_PREFILL, s.Stage.PREFILL)):
        for other in data.on_worker(worker, name):
            if other.trace_id != trace.trace_id and other.start_ns <= arrival_ns < other.end_ns:
                entry = {
                    "trace_id": other.trace_id,
                    "state": state,
                    "prefill_tokens": prefill_tokens.get(other.trace_id, 0),
                }
                ahead.append((other.start_ns, entry))
    ahead.sort(key=lambda item: item[0])
    return [entry for _, entry in ahead]
