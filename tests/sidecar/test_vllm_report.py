"""Traces from the sidecar's vLLM adapter feed `splitscope report`: requests counted, estimates declared."""

from __future__ import annotations

import random

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind

from tests.sidecar.conftest import spans_when
from tracer.engines import vllm
from tracer.report.build import ReportOptions, report_from_data
from tracer.report.simulate import SLO
from tracer.report.tables import load_traces

REQUESTS = 60


def test_report_reads_vllm_request_spans_and_says_what_it_estimated(make_sidecar, tmp_path):
    sidecar = make_sidecar(grpc_port=None)
    provider = TracerProvider(resource=Resource.create({"service.name": "vllm"}))
    provider.add_span_processor(
        BatchSpanProcessor(HttpSpanExporter(endpoint=f"http://127.0.0.1:{sidecar.http_port}/v1/traces"))
    )
    tracer = provider.get_tracer("vllm.llm_engine")
    rng = random.Random(3)
    t0 = 1_700_000_000_000_000_000
    expected_tokens = []
    for i in range(REQUESTS):
        prompt = rng.randint(100, 2000)
        queue_s, prefill_s, decode_s = 0.002, 0.0001 * prompt, 0.02 * 63
        start = t0 + i * 250_000_000
        span = tracer.start_span(
            "llm_request",
            kind=SpanKind.SERVER,
            start_time=start,
            attributes={
                vllm.ATTR_RESPONSE_MODEL: "m",
                vllm.ATTR_REQUEST_ID: f"r{i}",
                vllm.ATTR_PROMPT_TOKENS: prompt,
                vllm.ATTR_COMPLETION_TOKENS: 64,
                vllm.ATTR_TIME_IN_QUEUE: queue_s,
                vllm.ATTR_PREFILL: prefill_s,
                vllm.ATTR_TTFT: queue_s + prefill_s,
                vllm.ATTR_DECODE: decode_s,
                vllm.ATTR_E2E: queue_s + prefill_s + decode_s,
            },
        )
        span.end(end_time=start + round((queue_s + prefill_s + decode_s) * 1e9))
        expected_tokens.append(prompt)
    provider.shutdown()
    path = tmp_path / "traces.jsonl"
    spans_when(path, REQUESTS * 4)

    data = load_traces([path])
    assert len(data.requests) == REQUESTS
    assert sorted(data.requests.input_tokens.tolist()) == sorted(expected_tokens)
    report = report_from_data(data, ReportOptions(SLO(ttft_s=1.0, itl_s=0.1)))
    assert report.verdict  # a decision, or insufficient-data with its reason
    assert any("estimat" in line.lower() for line in report.assumptions), report.assumptions
