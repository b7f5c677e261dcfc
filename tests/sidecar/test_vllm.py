"""vLLM's `llm_request` span, sent the way vLLM sends it (OTLP/gRPC), becomes our stage spans and metrics."""

from __future__ import annotations

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import SpanKind

from tests.sidecar.conftest import spans_when
from tracer import spans as s
from tracer.engines import vllm

T0 = 1_700_000_000_123_456_789
QUEUE_S, PREFILL_S, DECODE_S, TTFT_S, E2E_S = 0.0125, 0.25, 1.49, 0.2705, 1.7651


def _send_vllm_span(endpoint: str, model: str | None = "Qwen/Qwen3-0.6B") -> tuple[int, int]:
    """One finished vLLM request span, as vLLM's OutputProcessor builds it; returns (trace id, span id).
    vLLM before 0.1x set `gen_ai.response.model`; 0.32 does not (`model=None`)."""
    provider = TracerProvider(resource=Resource.create({"service.name": "vllm.llm_engine"}))
    provider.add_span_processor(SimpleSpanProcessor(GrpcSpanExporter(endpoint=endpoint, insecure=True)))
    named = {vllm.ATTR_RESPONSE_MODEL: model} if model else {}
    span = provider.get_tracer("vllm.llm_engine").start_span(
        "llm_request",
        kind=SpanKind.SERVER,
        start_time=T0,
        attributes={
            **named,
            vllm.ATTR_REQUEST_ID: "cmpl-1",
            vllm.ATTR_PROMPT_TOKENS: 33,
            vllm.ATTR_COMPLETION_TOKENS: 300,
            vllm.ATTR_TIME_IN_QUEUE: QUEUE_S,
            vllm.ATTR_TTFT: TTFT_S,
            vllm.ATTR_PREFILL: PREFILL_S,
            vllm.ATTR_DECODE: DECODE_S,
            vllm.ATTR_E2E: E2E_S,
            "gen_ai.request.max_tokens": 300,
        },
    )
    span.end(end_time=T0 + round(E2E_S * 1e9))
    provider.shutdown()
    return span.context.trace_id, span.context.span_id


def test_vllm_request_span_gets_stage_children_with_exact_timings(make_sidecar, tmp_path):
    sidecar = make_sidecar(http_port=None, pool="prefill", worker="vllm-p0", mode="disaggregated")
    trace_id, span_id = _send_vllm_span(f"127.0.0.1:{sidecar.grpc_port}")

    spans = {span.name: span for span in spans_when(tmp_path / "traces.jsonl", 4)}
    request = spans["llm_request"]  # passed through unchanged
    assert request.span_id == f"{span_id:016x}" and request.attributes[vllm.ATTR_REQUEST_ID] == "cmpl-1"
    queue, prefill, decode = spans[s.SPAN_QUEUE], spans[s.SPAN_PREFILL], spans[s.SPAN_DECODE]
    for stage in (queue, prefill, decode):
        assert stage.trace_id == f"{trace_id:032x}" and stage.parent_span_id == request.span_id
        assert stage.attributes[s.ATTR_POOL] == "prefill" and stage.attributes[s.ATTR_WORKER] == "vllm-p0"
        assert stage.resource["service.name"] == "vllm.llm_engine"
    # Anchored on the front end's marks, with vLLM's own durations: prefill ends at arrival + TTFT, decode
    # at arrival + e2e; the queue ends where prefill starts, and what is left before it is the front end's.
    assert (prefill.start_ns, prefill.end_ns) == (T0 + 20_500_000, T0 + 270_500_000)
    assert (queue.start_ns, queue.end_ns) == (T0 + 8_000_000, T0 + 20_500_000)
    assert queue.attributes[s.ATTR_FRONTEND_S] == pytest.approx(0.008)
    assert (decode.start_ns, decode.end_ns) == (T0 + 275_100_000, T0 + 1_765_100_000)
    assert prefill.attributes[s.ATTR_PREFILL_TOKENS] == 33 and decode.attributes[s.ATTR_OUTPUT_TOKENS] == 300

    registry = sidecar.registry
    labels = {"gen_ai_request_model": "Qwen/Qwen3-0.6B", "mode": "disaggregated"}
    assert registry.get_sample_value("gen_ai_server_time_to_first_token_seconds_sum", labels) == pytest.approx(TTFT_S)
    assert registry.get_sample_value("gen_ai_server_request_duration_seconds_sum", labels) == pytest.approx(E2E_S)
    assert registry.get_sample_value("gen_ai_server_time_per_output_token_seconds_sum", labels) == pytest.approx(
        (E2E_S - TTFT_S) / 299
    )
    for stage, seconds in (("queue", QUEUE_S), ("prefill", PREFILL_S), ("decode", DECODE_S)):
        assert registry.get_sample_value(
            "splitscope_stage_duration_seconds_sum", {"stage": stage, "pool": "prefill"}
        ) == pytest.approx(seconds)
    assert registry.get_sample_value("splitscope_tokens_total", {"pool": "prefill", "phase": "decode"}) == 300


def test_when_vllm_metrics_are_scraped_spans_do_not_feed_the_same_families(make_sidecar, tmp_path):
    # One source per engine: with a vLLM scrape configured, the adapted spans are exported, not metered.
    sidecar = make_sidecar(http_port=None, scrape=[("vllm", "http://127.0.0.1:9/metrics")])
    _send_vllm_span(f"127.0.0.1:{sidecar.grpc_port}")
    spans_when(tmp_path / "traces.jsonl", 4)
    assert (
        sidecar.registry.get_sample_value(
            "splitscope_stage_duration_seconds_count", {"stage": "queue", "pool": "colocated"}
        )
        is None
    )


def test_adapter_skips_missing_stages_and_ignores_other_spans():
    adapter = vllm.VllmAdapter()
    other = s.SpanData("llm_request", 2, 1, 2, 0, 0, 10, {"unrelated": 1})
    assert not adapter.matches(other)  # no gen_ai.latency.e2e: not vLLM's span
    partial = s.SpanData(
        "llm_request",
        2,
        1,
        2,
        0,
        1_000,
        9_000,
        {vllm.ATTR_E2E: 8e-6, vllm.ATTR_DECODE: 5e-6, vllm.ATTR_TIME_IN_QUEUE: "x"},
    )
    (decode,) = adapter.stage_spans(partial)
    assert decode.name == s.SPAN_DECODE and (decode.start_ns, decode.end_ns) == (1_000, 6_000)
    metrics_only = adapter.request_metrics_span(partial)
    assert metrics_only.sampled is False and s.ATTR_TTFT_S not in metrics_only.attributes
