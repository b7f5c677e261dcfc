"""What an oracle run looks like to `splitscope report`: OTLP/JSON lines in two shapes.

- `write_full`: our full shape (architecture.md §4): a root `text_completion {model}` span per request with
  queue / prefill / kv_transfer(.send) / decode children, and a `splitscope.step` span per iteration;
  optionally the decode span's stall events and its links to the prefills that ran in its stalled
  steps, from the oracle's own knowledge of which prompts each iteration ran (`Iteration.prefills`).
- `stage_span_lines`: what SGLang's request tracing or vLLM's proposed lifecycle spans emit (a span per
  stage, with times only), for a colocated node.
- `vllm_request_lines`: what stock vLLM emits, one `llm_request` SERVER span per request with its
  latency attributes and token counts and nothing else (no steps, no inter-token figures); the tests
  send these through a real sidecar per engine, which adds our stage spans; `vllm_pd_lines`: the same
  for a split deployment, a pair of `llm_request` spans per request (one per instance, one trace).

Written here from the spec, not with the report's or the tracer's writers. Blocking file I/O.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from tests.oracle.engine import Iteration, Request, Run
from tracer import vocabulary as v
from tracer.engines import vllm

EPOCH_NS = 1_780_000_000_000_000_000
MODEL = "oracle-8b"
_SPANS_PER_LINE = 256


def _ns(seconds: float) -> int:
    return EPOCH_NS + int(round(seconds * 1e9))


def _value(value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, (int, np.integer)):
        return {"intValue": str(int(value))}
    if isinstance(value, (float, np.floating)):
        return {"doubleValue": float(value)}
    return {"stringValue": str(value)}


class _Ids:
    def __init__(self, seed: int) -> None:
        self._rng = np.random.default_rng(seed)

    def trace(self) -> str:
        return "".join(f"{x:016x}" for x in self._rng.integers(1, 2**63, 2))

    def span(self) -> str:
        return f"{int(self._rng.integers(1, 2**63)):016x}"


# The tracer's contract (architecture.md §4): a stall event for every gap over 3x the request's median
# gap; at most 32 stall links per decode span, the largest stall time first.
_STALL_FACTOR = 3.0
_MAX_STALL_LINKS = 32


def _span(
    trace_id: str,
    span_id: str,
    parent: str,
    name: str,
    kind: int,
    start_s: float,
    end_s: float,
    attributes: dict[str, Any],
) -> dict[str, Any]:
    return {
        "traceId": trace_id,
        "spanId": span_id,
        "parentSpanId": parent,
        "name": name,
        "kind": kind,
        "startTimeUnixNano": str(_ns(start_s)),
        "endTimeUnixNano": str(_ns(max(end_s, start_s))),
        "attributes": [{"key": k, "value": _value(x)} for k, x in attributes.items()],
        "status": {},
    }


def _line(service: str, spans: list[dict[str, Any]]) -> str:
    resource = {"attributes": [{"key": v.RESOURCE_SERVICE_NAME, "value": {"stringValue": service}}]}
    return json.dumps(
        {"resourceSpans": [{"resource": resource, "scopeSpans": [{"scope": {"name": "oracle"}, "spans": spans}]}]}
    )


def _batched(service: str, spans: Iterable[dict[str, Any]]) -> Iterable[str]:
    batch: list[dict[str, Any]] = []
    for span in spans:
        batch.append(span)
        if len(batch) >= _SPANS_PER_LINE:
            yield _line(service, batch)
            batch = []
    if batch:
        yield _line(service, batch)


def _mode(run: Run) -> str:
    return {"colocated": v.Mode.COLOCATED, "chunked": v.Mode.CHUNKED, "split": v.Mode.DISAGGREGATED}[
        run.deployment.kind
    ]


def _pools(run: Run) -> tuple[str, str]:
    if run.deployment.kind == "split":
        return v.Pool.PREFILL, v.Pool.DECODE
    return v.Pool.COLOCATED, v.Pool.COLOCATED


def _stalls(
    r: Request, iterations: dict[tuple[str, int, float], Iteration], pool: str
) -> list[tuple[float, float, Iteration]]:
    """(token time s, gap s, the iteration that ended the gap) of each gap of `r` over the stall rule."""
    gaps = r.gaps_s
    if not len(gaps):
        return []
    median_s = float(np.median(gaps))
    return [
        (t, float(gap), iterations[(pool, r.decode_worker, t)])
        for t, gap in zip(r.token_s, gaps)
        if median_s > 0 and gap > _STALL_FACTOR * median_s
    ]


def _stall_links(
    stalls: list[tuple[float, float, Iteration]], trace_ids: dict[int, str], prefill_ids: dict[int, str]
) -> tuple[list[dict[str, Any]], int, int]:
    """The decode span's links to the prefills that ran in its stalled iterations (each prefill's share of
    a gap by its tokens in that iteration), the largest first; (links, links left out, stalled ns)."""
    stalled_ns: dict[int, float] = {}
    tokens: dict[int, int] = {}
    total_ns = 0
    for _, gap_s, it in stalls:
        total_ns += int(round(gap_s * 1e9))
        for index, n in it.prefills:
            stalled_ns[index] = stalled_ns.get(index, 0.0) + gap_s * 1e9 * n / it.prefill_tokens
            tokens[index] = tokens.get(index, 0) + n
    ranked = sorted(stalled_ns, key=lambda i: -stalled_ns[i])
    links = [
        {
            "traceId": trace_ids[i],
            "spanId": prefill_ids[i],
            "attributes": [
                {"key": k, "value": _value(x)}
                for k, x in (
                    (v.ATTR_LINK_STALLED_NS, int(round(stalled_ns[i]))),
                    (v.ATTR_LINK_PREFILL_TOKENS, tokens[i]),
                )
            ],
        }
        for i in ranked[:_MAX_STALL_LINKS]
    ]
    return links, max(0, len(ranked) - _MAX_STALL_LINKS), total_ns


def write_full(
    path: Path, run: Run, seed: int = 0, *, stall_events: bool = False, stall_links: bool = False
) -> dict[int, str]:
    """Our full trace shape for `run` (which must have been served with `record=True`). With
    `stall_events`, decode spans carry the tracer's `splitscope.decode.stall` events; with `stall_links`,
    also its links to the prefills of the stalled iterations (colocated and chunked runs). Off by default,
    so the report's tests see the traces they were written against. Returns request index -> trace id."""
    assert run.iterations is not None
    ids = _Ids(seed)
    by_end = {(str(it.pool), it.worker, it.end_s): it for it in run.iterations}
    trace_ids: dict[int, str] = {}
    prefill_ids: dict[int, str] = {}
    pending_links: list[tuple[dict[str, Any], list[tuple[float, float, Iteration]]]] = []
    prefill_pool, decode_pool = _pools(run)
    mode = _mode(run)
    spans: list[dict[str, Any]] = []
    for r in run.requests:
        trace, root = ids.trace(), ids.span()
        trace_ids[r.index] = trace
        gaps = r.gaps_s
        root_attrs: dict[str, Any] = {
            v.ATTR_OPERATION: v.ROOT_SPAN_PREFIX,
            v.ATTR_MODEL: MODEL,
            v.ATTR_INPUT_TOKENS: r.prompt_tokens,
            v.ATTR_OUTPUT_TOKENS: r.output_tokens,
            v.ATTR_MODE: mode,
            v.ATTR_TTFT_S: r.ttft_s,
        }
        if len(gaps):
            root_attrs.update(
                {
                    v.ATTR_ITL_P99_S: r.itl_s("p99"),
                    v.ATTR_ITL_MAX_S: r.itl_s("max"),
                    v.ATTR_ITL_MEAN_S: r.itl_s("mean"),
                    v.ATTR_ITL_JOINED_TOKENS: r.joined_tokens,
                }
            )
        spans.append(
            _span(trace, root, "", f"{v.ROOT_SPAN_PREFIX} {MODEL}", v.KIND_SERVER, r.arrival_s, r.end_s, root_attrs)
        )
        where = {
            v.ATTR_POOL: prefill_pool,
            v.ATTR_WORKER: f"{prefill_pool}-{r.prefill_worker}",
            v.ATTR_TIMING_SOURCE: run.timing_source,
        }
        spans.append(
            _span(trace, ids.span(), root, v.SPAN_QUEUE, v.KIND_INTERNAL, r.arrival_s, r.prefill_start_s, where)
        )
        prefill_ids[r.index] = ids.span()
        spans.append(
            _span(
                trace,
                prefill_ids[r.index],
                root,
                v.SPAN_PREFILL,
                v.KIND_INTERNAL,
                r.prefill_start_s,
                r.prefill_end_s,
                {**where, v.ATTR_PREFILL_TOKENS: r.prompt_tokens, v.ATTR_PREFILL_CHUNKS: r.chunks},
            )
        )
        if run.deployment.kind == "split":
            transfer = ids.span()
            kv_bytes = int(r.prompt_tokens * run.kv_bytes_per_token)
            spans.append(
                _span(
                    trace,
                    transfer,
                    root,
                    v.SPAN_KV_TRANSFER,
                    v.KIND_INTERNAL,
                    r.prefill_end_s,
                    r.transfer_end_s,
                    {**where, v.ATTR_KV_BYTES: kv_bytes},
                )
            )
            spans.append(
                _span(
                    trace,
                    ids.span(),
                    transfer,
                    v.SPAN_KV_SEND,
                    v.KIND_INTERNAL,
                    r.transfer_start_s,
                    r.transfer_end_s,
                    {**where, v.ATTR_KV_BYTES: kv_bytes},
                )
            )
        if len(gaps):
            decode_where = {
                v.ATTR_POOL: decode_pool,
                v.ATTR_WORKER: f"{decode_pool}-{r.decode_worker}",
                v.ATTR_TIMING_SOURCE: run.timing_source,
            }
            decode = _span(
                trace,
                ids.span(),
                root,
                v.SPAN_DECODE,
                v.KIND_INTERNAL,
                r.decode_start_s,
                r.end_s,
                {
                    **decode_where,
                    v.ATTR_OUTPUT_TOKENS: r.output_tokens,
                    v.ATTR_DECODE_ITL_P50_S: r.itl_s("p50", client=False),
                    v.ATTR_DECODE_ITL_P99_S: r.itl_s("p99", client=False),
                    v.ATTR_DECODE_ITL_MAX_S: r.itl_s("max", client=False),
                },
            )
            spans.append(decode)
            if stall_events or stall_links:
                stalls = _stalls(r, by_end, str(decode_pool))
                decode["events"] = [
                    {
                        "timeUnixNano": str(_ns(t)),
                        "name": v.EVENT_DECODE_STALL,
                        "attributes": [
                            {"key": "gap_s", "value": _value(gap)},
                            {"key": "prefill_tokens", "value": _value(it.prefill_tokens)},
                        ],
                    }
                    for t, gap, it in stalls
                ]
                decode["attributes"].append({"key": v.ATTR_DECODE_STALLS, "value": _value(len(stalls))})
                if stall_links:
                    pending_links.append((decode, stalls))
    for decode, stalls in pending_links:  # every prefill span id is known now
        links, dropped, stalled_ns = _stall_links(stalls, trace_ids, prefill_ids)
        decode["links"] = links
        decode["attributes"] += [
            {"key": v.ATTR_DECODE_STALLED_NS, "value": _value(stalled_ns)},
            {"key": v.ATTR_DECODE_STALL_LINKS_DROPPED, "value": _value(dropped)},
        ]
    step_trace = {}
    for it in run.iterations:
        key = (it.pool, it.worker)
        step_trace.setdefault(key, ids.trace())
        spans.append(
            _span(
                step_trace[key],
                ids.span(),
                "",
                v.SPAN_STEP,
                v.KIND_INTERNAL,
                it.start_s,
                it.end_s,
                {
                    v.ATTR_POOL: it.pool,
                    v.ATTR_WORKER: f"{it.pool}-{it.worker}",
                    v.ATTR_TIMING_SOURCE: run.timing_source,
                    v.ATTR_STEP_DECODE_REQUESTS: it.running,
                    v.ATTR_STEP_PREFILL_TOKENS: it.prefill_tokens,
                    v.ATTR_STEP_CONTEXT_TOKENS: it.context_tokens,
                    v.ATTR_STEP_PREFILL_ATTENTION_TOKENS2: it.attention_tokens2,
                },
            )
        )
    with open(path, "w") as f:
        for line in _batched("oracle", spans):
            f.write(line + "\n")
    return trace_ids


def _llm_request(
    ids: _Ids,
    trace_id: str,
    index: int,
    start_s: float,
    end_s: float,
    prompt_tokens: int,
    completion_tokens: int,
    queue_s: float,
    prefill_s: float,
    ttft_s: float,
    decode_s: float,
) -> dict[str, Any]:
    """One stock vLLM `llm_request` span (vllm/tracing.py attributes; times from the instance's arrival)."""
    return _span(
        trace_id,
        ids.span(),
        "",
        vllm.SPAN_NAME,
        v.KIND_SERVER,
        start_s,
        end_s,
        {
            vllm.ATTR_RESPONSE_MODEL: MODEL,
            vllm.ATTR_REQUEST_ID: f"req-{index}",
            vllm.ATTR_PROMPT_TOKENS: prompt_tokens,
            vllm.ATTR_COMPLETION_TOKENS: completion_tokens,
            vllm.ATTR_TIME_IN_QUEUE: queue_s,
            vllm.ATTR_PREFILL: prefill_s,
            vllm.ATTR_TTFT: ttft_s,
            vllm.ATTR_DECODE: decode_s,
            vllm.ATTR_E2E: end_s - start_s,
        },
    )


def vllm_request_lines(run: Run, worker: int, seed: int = 0) -> list[str]:
    """Worker `worker`'s requests as stock vLLM's `llm_request` spans (vllm/tracing.py attributes)."""
    ids = _Ids(seed * 1000 + worker)
    spans = []
    for r in run.requests:
        if r.prefill_worker != worker:
            continue
        queue_s = r.prefill_start_s - r.arrival_s
        prefill_s = r.prefill_end_s - r.prefill_start_s
        decode_s = r.end_s - r.first_token_s
        spans.append(
            _llm_request(
                ids,
                ids.trace(),
                r.index,
                r.arrival_s,
                r.end_s,
                r.prompt_tokens,
                r.output_tokens,
                queue_s,
                prefill_s,
                r.ttft_s,
                decode_s,
            )
        )
    return list(_batched("vllm", spans))


# An engine's per-stage spans with times only (no token counts): (queue, prefill, decode) span names.
SGLANG_SLICES = ("prefill_waiting", "prefill_forward", "decode_forward")  # SGLang's RequestStage names
VLLM_LIFECYCLE = ("vllm_queue", "vllm_prefill", "vllm_decode")  # vLLM's proposed lifecycle spans


def stage_span_lines(
    run: Run, worker: int, names: tuple[str, str, str], seed: int = 0
) -> tuple[list[str], dict[str, int]]:
    """Worker `worker`'s requests as an engine that traces each stage with times only (a colocated node):
    SGLang (trace level 1: a request root span, a scheduler thread span under it, the stage slices under
    that; `names` SGLANG_SLICES) or vLLM's proposed lifecycle spans (VLLM_LIFECYCLE, under the request's
    span; the same shape here). Spans in the order they end, as the engines' exporters send them.
    Returns (lines, trace id -> request index)."""
    assert run.deployment.kind == "colocated"
    ids = _Ids(seed * 1000 + worker + 500)
    spans: list[dict[str, Any]] = []
    index_of: dict[str, int] = {}
    for r in run.requests:
        if r.prefill_worker != worker:
            continue
        trace, root, thread = ids.trace(), ids.span(), ids.span()
        index_of[trace] = r.index
        spans.append(_span(trace, root, "", "Req colocated", v.KIND_INTERNAL, r.arrival_s, r.end_s, {}))
        spans.append(_span(trace, thread, root, "Scheduler [TP 0]", v.KIND_INTERNAL, r.arrival_s, r.end_s, {}))
        queue, prefill, decode = names
        for name, start_s, end_s in (
            (queue, r.arrival_s, r.prefill_start_s),
            (prefill, r.prefill_start_s, r.prefill_end_s),
            (decode, r.first_token_s, r.end_s),
        ):
            spans.append(_span(trace, ids.span(), thread, name, v.KIND_INTERNAL, start_s, end_s, {}))
    spans.sort(key=lambda span: int(span["endTimeUnixNano"]))
    return list(_batched("engine", spans)), index_of


def vllm_pd_lines(run: Run, seed: int = 0) -> dict[tuple[str, int], list[str]]:
    """A split run as stock vLLM behind a P/D proxy (vLLM 0.32, NIXL-style KV pull): per request, the
    proxy's trace holds two `llm_request` spans, one per instance. (pool, worker) -> that instance's lines.

    - prefill instance (the proxy sends max_tokens=1): arrives with the request, queues, prefills and
      answers its one token when the prefill ends;
    - decode instance: the proxy forwards the request when the prefill answer is back; vLLM queues it
      (WAITING_FOR_REMOTE_KVS) until the KV cache has arrived and the engine admits it, which is when
      the first token streams (the oracle's decode worker sends it on admission); then it decodes.
    """
    assert run.deployment.kind == "split"
    ids = _Ids(seed)
    spans: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in run.requests:
        trace = ids.trace()  # the proxy's trace: both halves carry it
        prefill_s = r.prefill_end_s - r.prefill_start_s
        forwarded_s = r.prefill_end_s
        spans.setdefault((v.Pool.PREFILL, r.prefill_worker), []).append(
            _llm_request(
                ids,
                trace,
                r.index,
                r.arrival_s,
                r.prefill_end_s,
                r.prompt_tokens,
                1,
                r.prefill_start_s - r.arrival_s,
                prefill_s,
                r.prefill_end_s - r.arrival_s,
                0.0,
            )
        )
        spans.setdefault((v.Pool.DECODE, r.decode_worker), []).append(
            _llm_request(
                ids,
                trace,
                r.index,
                forwarded_s,
                r.end_s,
                r.prompt_tokens,
                r.output_tokens,
                r.first_token_s - forwarded_s,
                0.0,
                r.first_token_s - forwarded_s,
                r.end_s - r.first_token_s,
            )
        )
    return {key: list(_batched("vllm", group)) for key, group in sorted(spans.items())}
