"""vLLM's request spans -> our stage spans, as children in the same trace.

vLLM (0.32, `--otlp-traces-endpoint`) emits one SERVER span `llm_request` per request when it finishes
(vllm/tracing.py `SpanAttributes`, vllm/v1/engine/output_processor.py `do_tracing`). Its start is the
request's arrival at the API server; its attributes carry latencies in seconds, measured on two clocks:
`time_to_first_token` and `e2e` from arrival (front-end wall clock), `time_in_queue`,
`time_in_model_prefill` and `time_in_model_decode` between the engine core's own timestamps (QUEUED,
SCHEDULED, first and last token). The engine core queues a request some milliseconds after arrival
(tokenisation, IPC), so the stages are anchored at the front end's marks and keep vLLM's durations:

    splitscope.prefill  ends at arrival + time_to_first_token, lasts time_in_model_prefill
    splitscope.queue    ends where prefill starts, lasts time_in_queue;
                        `splitscope.frontend_s` = its start - arrival (the front-end gap)
    splitscope.decode   ends at arrival + e2e, lasts time_in_model_decode (starting no earlier than
                        the prefill's end); none for a one-token request

The `llm_request` span itself is passed through unchanged (it is the request span). Stage spans carry
`splitscope.pool` / `splitscope.worker` from the sidecar's `--pool` / `--worker` and
`splitscope.timing.source=host`. On the decode instance of a P/D pair (`--pool decode`) vLLM's
"queue" is the wait for the prefilled KV cache to arrive: it becomes `splitscope.kv_transfer` there,
and the decode starts at the first forward pass (docs/engines.md). The prefill instance's request (one
output token) gets queue and prefill only. Both halves keep the proxy's trace id, so one trace holds
queue and prefill (prefill pool), kv_transfer and decode (decode pool). A metrics-only request span (sampled False) carries
TTFT and e2e for the gen_ai_server_* histograms, labelled with the model (`ModelNames`).

vLLM's proposed lifecycle spans (`vllm_queue`, `vllm_async_kv_transfer`, `vllm_prefill`,
`vllm_decode`; open upstream PR) measure the same stages directly: when a trace has them they are mapped
one to one and the `llm_request`-derived stages are not made for it (`LifecycleTraces`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tracer import spans as s
from tracer.engines.adapter import Adaptation

log = logging.getLogger(__name__)

SPAN_NAME = "llm_request"
ATTR_REQUEST_ID = "gen_ai.request.id"
ATTR_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
ATTR_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
ATTR_RESPONSE_MODEL = "gen_ai.response.model"
ATTR_MAX_TOKENS = "gen_ai.request.max_tokens"
ATTR_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
ATTR_TTFT = "gen_ai.latency.time_to_first_token"
ATTR_PREFILL = "gen_ai.latency.time_in_model_prefill"
ATTR_DECODE = "gen_ai.latency.time_in_model_decode"
ATTR_E2E = "gen_ai.latency.e2e"

# The proposed lifecycle spans -> our stage spans (`vllm_step_execution` has no agreed attributes yet:
# without the step's token counts it cannot be a `splitscope.step`, so it passes through unmapped).
LIFECYCLE_STAGES = {
    "vllm_queue": s.SPAN_QUEUE,
    "vllm_async_kv_transfer": s.SPAN_KV_TRANSFER,
    "vllm_prefill": s.SPAN_PREFILL,
    "vllm_decode": s.SPAN_DECODE,
}
MODEL_UNKNOWN = "unknown"
# Resource attributes that may name the served model (set through OTEL_RESOURCE_ATTRIBUTES).
RESOURCE_MODEL_KEYS = (s.ATTR_MODEL, ATTR_RESPONSE_MODEL)


@dataclass
class ModelNames:
    """The model label of request metrics made from vLLM's spans, in order: the span's own
    `gen_ai.response.model` (vLLM 0.32 sends none), the sidecar's `--model`, the resource's
    `gen_ai.request.model`; else "unknown", said once in the log. (With `--scrape vllm=...` the request
    metrics come from the scrape instead, labelled by vLLM's own `model_name`.) Export thread only."""

    configured: str = ""
    _warned: bool = field(default=False, repr=False)

    def for_span(self, span: s.SpanData, resource: Mapping[str, Any]) -> str:
        own = span.attributes.get(ATTR_RESPONSE_MODEL) or span.attributes.get(s.ATTR_MODEL)
        if isinstance(own, str) and own:
            return own
        if self.configured:
            return self.configured
        for key in RESOURCE_MODEL_KEYS:
            value = resource.get(key)
            if isinstance(value, str) and value:
                return value
        if not self._warned:
            self._warned = True
            log.warning(
                "splitscope sidecar: vLLM's spans name no model; request metrics get model %r "
                "(pass --model, --scrape vllm=URL, or OTEL_RESOURCE_ATTRIBUTES=%s=NAME)",
                MODEL_UNKNOWN,
                s.ATTR_MODEL,
            )
        return MODEL_UNKNOWN


class LifecycleTraces:
    """Which recent traces had lifecycle spans, and which got stages derived from `llm_request`, so one
    trace never gets both. Bounded (oldest forgotten); export thread only."""

    def __init__(self, max_traces: int = 65_536) -> None:
        self.max_traces = max_traces
        self._seen: OrderedDict[int, str] = OrderedDict()

    def claim(self, trace_id: int, source: str) -> bool:
        """True when `source` ("lifecycle" or "derived") may make this trace's stages."""
        held = self._seen.get(trace_id)
        if held is not None:
            return held == source
        self._seen[trace_id] = source
        if len(self._seen) > self.max_traces:
            self._seen.popitem(last=False)
        return True


@dataclass
class VllmAdapter:
    """`pool`/`worker` name the engine's role; `mode` labels the request metrics. Export thread only."""

    pool: str = s.Pool.COLOCATED
    worker: str = "vllm"
    mode: str = s.Mode.COLOCATED
    models: ModelNames = field(default_factory=ModelNames)
    lifecycle: LifecycleTraces = field(default_factory=LifecycleTraces)

    engine = "vllm"

    def adapt(self, span: s.SpanData, resource: Mapping[str, Any]) -> Adaptation | None:
        """`tracer.engines.EngineAdapter.adapt`: stages under an `llm_request` (with its metrics-only
        request span), or beside a lifecycle span; None for any other span."""
        if self.matches(span):
            return Adaptation(self.stage_spans(span), [self.request_metrics_span(span, resource)])
        if self.is_lifecycle(span):
            stage = self.lifecycle_stage(span)
            return Adaptation([] if stage is None else [stage])
        return None

    def matches(self, span: s.SpanData) -> bool:
        return span.name == SPAN_NAME and ATTR_E2E in span.attributes

    def is_lifecycle(self, span: s.SpanData) -> bool:
        return span.name in LIFECYCLE_STAGES

    def _common(self) -> dict[str, Any]:
        # The mode too: vLLM's spans do not say whether the engine runs chunked prefill, and the report
        # estimates a chunked engine's gaps differently (tracer/report/estimate.py).
        return {
            s.ATTR_POOL: self.pool,
            s.ATTR_WORKER: self.worker,
            s.ATTR_TIMING_SOURCE: s.SOURCE_HOST,
            s.ATTR_MODE: self.mode,
        }

    def stage_spans(self, span: s.SpanData) -> list[s.SpanData]:
        """The stage spans under `span` (exported and metered), in stage order; missing stages skipped."""
        if not self.lifecycle.claim(span.trace_id, "derived"):
            return []
        attrs = span.attributes
        arrival_ns = span.start_ns
        prompt_tokens = _int(attrs.get(ATTR_PROMPT_TOKENS))
        output_tokens = _int(attrs.get(ATTR_COMPLETION_TOKENS))
        queue_s, prefill_s, decode_s = (_seconds(attrs.get(k)) for k in (ATTR_TIME_IN_QUEUE, ATTR_PREFILL, ATTR_DECODE))
        ttft_s, e2e_s = _seconds(attrs.get(ATTR_TTFT)), _seconds(attrs.get(ATTR_E2E))
        # (stage, start, end) on vLLM's own timeline; None where vLLM did not report it.
        queue: tuple[int, int] | None = None
        prefill: tuple[int, int] | None = None
        decode: tuple[int, int] | None = None
        if ttft_s is None:  # no front-end anchor (older vLLM): stages laid end to end from arrival
            cursor = arrival_ns
            laid = []
            for seconds in (queue_s, prefill_s, decode_s):
                laid.append(None if seconds is None else (cursor, cursor + _ns(seconds)))
                cursor += _ns(seconds or 0.0)
            queue, prefill, decode = laid
        else:
            first_token_ns = arrival_ns + _ns(ttft_s)
            prefill_start_ns = max(arrival_ns, first_token_ns - _ns(prefill_s or 0.0))
            queue_start_ns = max(arrival_ns, prefill_start_ns - _ns(queue_s or 0.0))
            queue = None if queue_s is None else (queue_start_ns, prefill_start_ns)
            prefill = None if prefill_s is None else (prefill_start_ns, first_token_ns)
            if decode_s is not None and e2e_s is not None and (output_tokens > 1 or decode_s > 0):
                end_ns = arrival_ns + _ns(e2e_s)
                decode = (max(first_token_ns, end_ns - _ns(decode_s)), end_ns)
        intervals: list[tuple[str, tuple[int, int] | None]]
        if self.pool == s.Pool.DECODE:
            # A P/D decode instance (vLLM 0.32 scheduler): a request whose KV cache is pulled from the prefill
            # instance waits in WAITING_FOR_REMOTE_KVS and is stamped SCHEDULED only once the KV has arrived,
            # so vLLM's "queue" there is the block allocation plus the transfer, and its "prefill" is the first
            # forward pass over the last prompt token, which starts the decode.
            if decode is not None and prefill is not None:
                decode = (prefill[0], decode[1])
            intervals = [(s.SPAN_KV_TRANSFER, queue), (s.SPAN_DECODE, decode or prefill)]
        else:
            intervals = [(s.SPAN_QUEUE, queue), (s.SPAN_PREFILL, prefill), (s.SPAN_DECODE, decode)]
        out: list[s.SpanData] = []
        for name, interval in intervals:
            if interval is None:
                continue
            start_ns, end_ns = interval
            extra: dict[str, Any] = {}
            if not out and ttft_s is not None:  # the first stage: what lies before it is the front end's
                extra[s.ATTR_FRONTEND_S] = (start_ns - arrival_ns) / 1e9
            stage_attrs = {**self._common(), **extra}
            if name == s.SPAN_PREFILL:
                stage_attrs[s.ATTR_PREFILL_TOKENS] = prompt_tokens
            elif name == s.SPAN_DECODE:
                stage_attrs[s.ATTR_OUTPUT_TOKENS] = output_tokens
            out.append(
                s.SpanData(
                    name=name,
                    kind=s.KIND_INTERNAL,
                    trace_id=span.trace_id,
                    span_id=s.new_span_id(),
                    parent_span_id=span.span_id,
                    start_ns=start_ns,
                    end_ns=max(start_ns, end_ns),
                    attributes=stage_attrs,
                    error_type=span.error_type if name == s.SPAN_DECODE else "",
                )
            )
        return out

    def lifecycle_stage(self, span: s.SpanData) -> s.SpanData | None:
        """Our stage span for one of vLLM's lifecycle spans (same times, beside it under its parent), or
        None when this trace already got stages derived from `llm_request`."""
        if not self.lifecycle.claim(span.trace_id, "lifecycle"):
            return None
        return s.SpanData(
            name=LIFECYCLE_STAGES[span.name],
            kind=s.KIND_INTERNAL,
            trace_id=span.trace_id,
            span_id=s.new_span_id(),
            parent_span_id=span.parent_span_id,
            start_ns=span.start_ns,
            end_ns=span.end_ns,
            attributes=self._common(),
            error_type=span.error_type,
        )

    def request_metrics_span(self, span: s.SpanData, resource: Mapping[str, Any] | None = None) -> s.SpanData:
        """A metrics-only SERVER span shaped like our root span, for gen_ai_server_* (never exported)."""
        attrs = span.attributes
        e2e_s = _seconds(attrs.get(ATTR_E2E)) or (span.end_ns - span.start_ns) / 1e9
        metric_attrs: dict[str, Any] = {
            s.ATTR_MODEL: self.models.for_span(span, resource or {}),
            s.ATTR_MODE: self.mode,
            s.ATTR_OUTPUT_TOKENS: _int(attrs.get(ATTR_COMPLETION_TOKENS)),
        }
        ttft_s = _seconds(attrs.get(ATTR_TTFT))
        if ttft_s is not None:
            metric_attrs[s.ATTR_TTFT_S] = ttft_s
        return s.SpanData(
            name=span.name,
            kind=s.KIND_SERVER,
            trace_id=span.trace_id,
            span_id=span.span_id,
            parent_span_id=span.parent_span_id,
            start_ns=span.start_ns,
            end_ns=span.start_ns + _ns(e2e_s),
            attributes=metric_attrs,
            error_type=span.error_type,
            sampled=False,
        )


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)


def _seconds(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return max(0.0, float(value))


def _int(value: Any) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0
