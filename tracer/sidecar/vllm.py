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
`splitscope.timing.source=host`. On a decode instance of a P/D pair (`--pool decode`), vLLM's
"prefill" interval is the wait for the remote KV cache plus the first forward pass: it becomes
`splitscope.kv_transfer` there (docs/engines.md). A metrics-only request span (sampled False) carries
TTFT and e2e for the gen_ai_server_* histograms, labelled with the model (`ModelNames`).

vLLM's proposed lifecycle spans (`vllm_queue`, `vllm_async_kv_transfer`, `vllm_prefill`,
`vllm_decode`; open upstream PR) measure the same stages directly: when a trace has them they are mapped
one to one and the `llm_request`-derived stages are not made for it (`LifecycleTraces`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tracer import spans as s

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
    """The model label of a vLLM request, in order: the span's own `gen_ai.response.model` (vLLM 0.32
    sends none), the model the engine's scraped /metrics names (`scraped()`, exactly one), the
    sidecar's `--model`, the resource's `gen_ai.request.model`; else "unknown", said once in the log.
    `for_span` runs on the export thread."""

    configured: str = ""
    scraped: Callable[[], Sequence[str]] = lambda: ()
    _warned: bool = field(default=False, repr=False)

    def for_span(self, span: s.SpanData, resource: dict[str, Any]) -> str:
        own = span.attributes.get(ATTR_RESPONSE_MODEL) or span.attributes.get(s.ATTR_MODEL)
        if isinstance(own, str) and own:
            return own
        scraped = list(self.scraped())
        if len(scraped) == 1:
            return scraped[0]
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
                MODEL_UNKNOWN, s.ATTR_MODEL,
            )  # fmt: skip
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

    pool: str = "colocated"
    worker: str = "vllm"
    mode: str = "colocated"
    models: ModelNames = field(default_factory=ModelNames)
    lifecycle: LifecycleTraces = field(default_factory=LifecycleTraces)

    def matches(self, span: s.SpanData) -> bool:
        return span.name == SPAN_NAME and ATTR_E2E in span.attributes

    def is_lifecycle(self, span: s.SpanData) -> bool:
        return span.name in LIFECYCLE_STAGES

    def _common(self) -> dict[str, Any]:
        return {s.ATTR_POOL: self.pool, s.ATTR_WORKER: self.worker, s.ATTR_TIMING_SOURCE: "host"}

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
        # On a P/D decode instance, time to "first token" is spent pulling the prefilled KV cache.
        first_token_stage = s.SPAN_KV_TRANSFER if self.pool == "decode" else s.SPAN_PREFILL
        intervals: list[tuple[str, int, int, dict[str, Any]]] = []
        if ttft_s is None:
            # No front-end anchor: stages laid end to end from arrival (older vLLM).
            cursor = arrival_ns
            for name, seconds in ((s.SPAN_QUEUE, queue_s), (first_token_stage, prefill_s), (s.SPAN_DECODE, decode_s)):
                if seconds is not None:
                    intervals.append((name, cursor, cursor + _ns(seconds), {}))
                    cursor += _ns(seconds)
        else:
            first_token_ns = arrival_ns + _ns(ttft_s)
            prefill_start_ns = max(arrival_ns, first_token_ns - _ns(prefill_s or 0.0))
            queue_start_ns = max(arrival_ns, prefill_start_ns - _ns(queue_s or 0.0))
            if queue_s is not None:
                frontend = {s.ATTR_FRONTEND_S: (queue_start_ns - arrival_ns) / 1e9}
                intervals.append((s.SPAN_QUEUE, queue_start_ns, prefill_start_ns, frontend))
            if prefill_s is not None:
                intervals.append((first_token_stage, prefill_start_ns, first_token_ns, {}))
            if decode_s is not None and e2e_s is not None and (output_tokens > 1 or decode_s > 0):
                end_ns = arrival_ns + _ns(e2e_s)
                intervals.append((s.SPAN_DECODE, max(first_token_ns, end_ns - _ns(decode_s)), end_ns, {}))
        out = []
        for name, start_ns, end_ns, extra in intervals:
            stage_attrs = {**self._common(), **extra}
            if name == s.SPAN_PREFILL:
                stage_attrs[s.ATTR_PREFILL_TOKENS] = prompt_tokens
            elif name == s.SPAN_DECODE:
                stage_attrs[s.ATTR_OUTPUT_TOKENS] = output_tokens
            out.append(
                s.SpanData(
                    name=name, kind=s.KIND_INTERNAL, trace_id=span.trace_id, span_id=s.new_span_id(),
                    parent_span_id=span.span_id, start_ns=start_ns, end_ns=max(start_ns, end_ns),
                    attributes=stage_attrs, error_type=span.error_type if name == s.SPAN_DECODE else "",
                )  # fmt: skip
            )
        return out

    def lifecycle_stage(self, span: s.SpanData) -> s.SpanData | None:
        """Our stage span for one of vLLM's lifecycle spans (same times, beside it under its parent), or
        None when this trace already got stages derived from `llm_request`."""
        if not self.lifecycle.claim(span.trace_id, "lifecycle"):
            return None
        return s.SpanData(
            name=LIFECYCLE_STAGES[span.name], kind=s.KIND_INTERNAL, trace_id=span.trace_id,
            span_id=s.new_span_id(), parent_span_id=span.parent_span_id, start_ns=span.start_ns,
            end_ns=span.end_ns, attributes=self._common(), error_type=span.error_type,
        )  # fmt: skip

    def request_metrics_span(self, span: s.SpanData, resource: dict[str, Any] | None = None) -> s.SpanData:
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
            name=span.name, kind=s.KIND_SERVER, trace_id=span.trace_id, span_id=span.span_id,
            parent_span_id=span.parent_span_id, start_ns=span.start_ns, end_ns=span.start_ns + _ns(e2e_s),
            attributes=metric_attrs, error_type=span.error_type, sampled=False,
        )  # fmt: skip


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)


def _seconds(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return max(0.0, float(value))


def _int(value: Any) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0
