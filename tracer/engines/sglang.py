"""SGLang's request trace slices -> our stage spans, beside each slice in the same trace.

SGLang (`--enable-trace --otlp-traces-endpoint HOST:PORT`, newer versions `--trace-level 1-3`) traces a
request as a bootstrap-room span over one request root span per node (router, prefill, decode), one
span per thread under it, and one span per *slice* under each thread, named by the slice's stage
(python/sglang/srt/observability/req_time_stats.py `RequestStage`, `stage_name`). The slices that are
one of our stages, with their interval in SGLang's own time stats:

    prefill_waiting            wait queue -> forward entry            splitscope.queue
    decode_waiting             (decode node) wait queue -> forward    splitscope.queue
    prefill_forward            the prefill forward pass(es)           splitscope.prefill
    decode_forward             decode (trace level 1)                 splitscope.decode
    decode_loop                decode (trace level 3; the same span)  splitscope.decode
    prefill_transfer_kv_cache  prefill node: KV sent                  splitscope.kv_transfer.send
    decode_transferred         decode node: transfer queue -> wait    splitscope.kv_transfer

Each slice is exported unchanged and our span is added under the slice's parent with the slice's times
(`splitscope.timing.source=host`, pool and worker from `--pool` / `--worker`). One stage per thread
span (one node's scheduler): when two of its slices map to the same stage (decode_forward and decode_loop
at level 3), the first one seen wins; a prefill and a decode node sending to one sidecar each get theirs. Not mapped: tokenize, dispatch, request_process, prefill_prepare / prefill_bootstrap /
decode_prepare / decode_bootstrap (bootstrap handshake and KV allocation: no counterpart in our stages;
they stay visible as SGLang's own slices), chunked_prefill (sub-slices of prefill_forward).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tracer import spans as s
from tracer.engines.adapter import Adaptation

SLICE_STAGES = {
    "prefill_waiting": s.SPAN_QUEUE,
    "decode_waiting": s.SPAN_QUEUE,
    "prefill_forward": s.SPAN_PREFILL,
    "decode_forward": s.SPAN_DECODE,
    "decode_loop": s.SPAN_DECODE,
    "prefill_transfer_kv_cache": s.SPAN_KV_SEND,
    "decode_transferred": s.SPAN_KV_TRANSFER,
}


@dataclass
class SglangAdapter:
    """`pool`/`worker` name the SGLang node's role. Export thread only; remembers at most `max_traces`
    recent (trace, thread) pairs (oldest forgotten) to keep one span per stage."""

    pool: str = s.Pool.COLOCATED
    worker: str = "sglang"
    max_traces: int = 65_536
    _made: OrderedDict[tuple[int, int], set[str]] = field(default_factory=OrderedDict, repr=False)

    engine = "sglang"

    def adapt(self, span: s.SpanData, resource: Mapping[str, Any]) -> Adaptation | None:
        """`tracer.engines.EngineAdapter.adapt`: our stage beside one of SGLang's slices (none when its
        thread already has that stage); None for any other span."""
        if not self.matches(span):
            return None
        stage = self.stage_span(span)
        return Adaptation([] if stage is None else [stage])

    def matches(self, span: s.SpanData) -> bool:
        return span.name in SLICE_STAGES

    def stage_span(self, span: s.SpanData) -> s.SpanData | None:
        """Our stage span for one SGLang slice, or None when this node's thread already has that stage."""
        name = SLICE_STAGES[span.name]
        key = (span.trace_id, span.parent_span_id)  # one thread of one node: a node's slices share it
        made = self._made.get(key)
        if made is None:
            made = self._made[key] = set()
            if len(self._made) > self.max_traces:
                self._made.popitem(last=False)
        if name in made:
            return None
        made.add(name)
        return s.SpanData(
            name=name,
            kind=s.KIND_INTERNAL,
            trace_id=span.trace_id,
            span_id=s.new_span_id(),
            parent_span_id=span.parent_span_id,
            start_ns=span.start_ns,
            end_ns=span.end_ns,
            attributes={s.ATTR_POOL: self.pool, s.ATTR_WORKER: self.worker, s.ATTR_TIMING_SOURCE: s.SOURCE_HOST},
            error_type=span.error_type,
        )
