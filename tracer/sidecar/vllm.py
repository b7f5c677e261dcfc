"""vLLM's `llm_request` span -> our stage spans, as children in the same trace.

vLLM emits one SERVER span per request when it finishes; its start is the request's arrival and its
attributes carry the stage latencies in seconds (vllm/tracing.py `SpanAttributes`). The span is kept as
it is (it is the request span) and under it we hang:

    splitscope.queue    [arrival, arrival + time_in_queue]
    splitscope.prefill  [queue end, queue end + time_in_model_prefill]
    splitscope.decode   [prefill end, prefill end + time_in_model_decode]

with `splitscope.pool` / `splitscope.worker` from the sidecar's `--pool` / `--worker` (the engine's role)
and `splitscope.timing.source` = `host` (vLLM stamps host monotonic times). A metrics-only request span
(sampled False) carries TTFT (`gen_ai.latency.time_to_first_token`) and e2e for the gen_ai_server_*
histograms. What vLLM does not report is absent: per-token gaps (no ITL on the decode span, no stall
events), cached prompt tokens, prefill chunks, and any KV transfer span (docs/engines.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tracer import spans as s

SPAN_NAME = "llm_request"
ATTR_REQUEST_ID = "gen_ai.request.id"
ATTR_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
ATTR_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
ATTR_RESPONSE_MODEL = "gen_ai.response.model"
ATTR_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
ATTR_TTFT = "gen_ai.latency.time_to_first_token"
ATTR_PREFILL = "gen_ai.latency.time_in_model_prefill"
ATTR_DECODE = "gen_ai.latency.time_in_model_decode"
ATTR_E2E = "gen_ai.latency.e2e"


@dataclass(frozen=True, slots=True)
class VllmAdapter:
    """Stateless; `pool`/`worker` name the engine's role; `mode` labels the request metrics."""

    pool: str = "colocated"
    worker: str = "vllm"
    mode: str = "colocated"

    def matches(self, span: s.SpanData) -> bool:
        return span.name == SPAN_NAME and ATTR_E2E in span.attributes

    def stage_spans(self, span: s.SpanData) -> list[s.SpanData]:
        """The stage spans under `span` (exported and metered), in stage order; missing stages skipped."""
        attrs = span.attributes
        common = {s.ATTR_POOL: self.pool, s.ATTR_WORKER: self.worker, s.ATTR_TIMING_SOURCE: "host"}
        out = []
        cursor_ns = span.start_ns
        for name, key, extra in (
            (s.SPAN_QUEUE, ATTR_TIME_IN_QUEUE, {}),
            (s.SPAN_PREFILL, ATTR_PREFILL, {s.ATTR_PREFILL_TOKENS: _int(attrs.get(ATTR_PROMPT_TOKENS))}),
            (s.SPAN_DECODE, ATTR_DECODE, {s.ATTR_OUTPUT_TOKENS: _int(attrs.get(ATTR_COMPLETION_TOKENS))}),
        ):
            seconds = _seconds(attrs.get(key))
            if seconds is None:
                continue
            end_ns = cursor_ns + round(seconds * 1e9)
            out.append(
                s.SpanData(
                    name=name, kind=s.KIND_INTERNAL, trace_id=span.trace_id, span_id=s.new_span_id(),
                    parent_span_id=span.span_id, start_ns=cursor_ns, end_ns=end_ns,
                    attributes={**common, **extra}, error_type=span.error_type if name == s.SPAN_DECODE else "",
                )  # fmt: skip
            )
            cursor_ns = end_ns
        return out

    def request_metrics_span(self, span: s.SpanData) -> s.SpanData:
        """A metrics-only SERVER span shaped like our root span, for gen_ai_server_* (never exported)."""
        attrs = span.attributes
        e2e_s = _seconds(attrs.get(ATTR_E2E)) or (span.end_ns - span.start_ns) / 1e9
        metric_attrs: dict[str, Any] = {
            s.ATTR_MODEL: str(attrs.get(ATTR_RESPONSE_MODEL) or attrs.get(s.ATTR_MODEL) or ""),
            s.ATTR_MODE: self.mode,
            s.ATTR_OUTPUT_TOKENS: _int(attrs.get(ATTR_COMPLETION_TOKENS)),
        }
        ttft_s = _seconds(attrs.get(ATTR_TTFT))
        if ttft_s is not None:
            metric_attrs[s.ATTR_TTFT_S] = ttft_s
        return s.SpanData(
            name=span.name, kind=s.KIND_SERVER, trace_id=span.trace_id, span_id=span.span_id,
            parent_span_id=span.parent_span_id, start_ns=span.start_ns, end_ns=span.start_ns + round(e2e_s * 1e9),
            attributes=metric_attrs, error_type=span.error_type, sampled=False,
        )  # fmt: skip


def _seconds(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return max(0.0, float(value))


def _int(value: Any) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0
