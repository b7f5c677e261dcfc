"""OTLP in, our file and metrics out: the OpenTelemetry SDK's own exporters against a running sidecar."""

from __future__ import annotations

import gzip
import urllib.request

import pytest
from opentelemetry.exporter.otlp.json.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode

from tests.sidecar.conftest import spans_when
from tracer import spans as s

T0 = 1_700_000_000_000_000_000
MS = 1_000_000


def _emit_worker_spans(exporter) -> list:
    """Spans in our vocabulary plus one foreign span, exported through `exporter` by the SDK itself."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "worker-a"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("test")
    root = tracer.start_span(
        "text_completion tiny",
        kind=SpanKind.SERVER,
        start_time=T0,
        attributes={s.ATTR_MODEL: "tiny", s.ATTR_MODE: "colocated", s.ATTR_TTFT_S: 0.05, s.ATTR_OUTPUT_TOKENS: 5},
    )
    from opentelemetry import trace

    ctx = trace.set_span_in_context(root)
    prefill = tracer.start_span(
        s.SPAN_PREFILL,
        context=ctx,
        start_time=T0 + 2 * MS,
        attributes={
            s.ATTR_POOL: "colocated",
            s.ATTR_WORKER: "w0",
            s.ATTR_PREFILL_TOKENS: 100,
            s.ATTR_PREFILL_CACHED_TOKENS: 16,
        },
    )
    prefill.end(end_time=T0 + 50 * MS)
    foreign = tracer.start_span("db.query", context=ctx, start_time=T0 + 1 * MS, attributes={"db.rows": 3})
    foreign.set_status(Status(StatusCode.ERROR, "timeout"))
    foreign.end(end_time=T0 + 3 * MS)
    root.end(end_time=T0 + 150 * MS)
    provider.shutdown()
    return memory.get_finished_spans()


def _check_roundtrip(sidecar, tmp_path, sent) -> None:
    spans = {span.name: span for span in spans_when(tmp_path / "traces.jsonl", 3)}
    assert set(spans) == {"text_completion tiny", s.SPAN_PREFILL, "db.query"}
    for original in sent:
        got = spans[original.name]
        assert got.trace_id == f"{original.context.trace_id:032x}" and got.span_id == f"{original.context.span_id:016x}"
        assert (got.start_ns, got.end_ns) == (original.start_time, original.end_time)
        assert got.resource["service.name"] == "worker-a"
    assert spans[s.SPAN_PREFILL].parent_span_id == spans["text_completion tiny"].span_id
    assert spans[s.SPAN_PREFILL].attributes[s.ATTR_PREFILL_TOKENS] == 100
    assert spans["db.query"].status_code == 2 and spans["db.query"].status_message == "timeout"
    registry = sidecar.registry
    # Our spans feed the catalogue exactly as in-process tracing would; the foreign one does not.
    assert (
        registry.get_sample_value("splitscope_stage_duration_seconds_count", {"stage": "prefill", "pool": "colocated"})
        == 1
    )
    assert registry.get_sample_value("splitscope_tokens_total", {"pool": "colocated", "phase": "prefill"}) == 84
    labels = {"gen_ai_request_model": "tiny", "mode": "colocated"}
    assert registry.get_sample_value("gen_ai_server_time_to_first_token_seconds_sum", labels) == pytest.approx(0.05)
    assert registry.get_sample_value("gen_ai_server_request_duration_seconds_sum", labels) == pytest.approx(0.15)
    assert (
        registry.get_sample_value(
            "gen_ai_server_request_duration_seconds_count", {"gen_ai_request_model": "", "mode": ""}
        )
        is None
    )


def test_otlp_http_protobuf_from_the_sdk_exporter(make_sidecar, tmp_path):
    sidecar = make_sidecar(grpc_port=None)
    exporter = HttpSpanExporter(endpoint=f"http://127.0.0.1:{sidecar.http_port}/v1/traces")
    sent = _emit_worker_spans(exporter)
    _check_roundtrip(sidecar, tmp_path, sent)


def test_otlp_grpc_from_the_sdk_exporter(make_sidecar, tmp_path):
    sidecar = make_sidecar(http_port=None)
    exporter = GrpcSpanExporter(endpoint=f"127.0.0.1:{sidecar.grpc_port}", insecure=True)
    sent = _emit_worker_spans(exporter)
    _check_roundtrip(sidecar, tmp_path, sent)


@pytest.mark.parametrize("gzipped", [False, True])
def test_otlp_http_json_with_hex_ids(make_sidecar, tmp_path, gzipped):
    sidecar = make_sidecar(grpc_port=None)
    memory = InMemorySpanExporter()
    sent = _emit_worker_spans(memory)
    body = encode_spans(sent).to_json().encode()  # the OpenTelemetry project's OTLP/JSON encoder
    assert f'"{sent[0].context.trace_id:032x}"' in body.decode()  # hex ids on the wire, not base64
    headers = {"Content-Type": "application/json"}
    if gzipped:
        body, headers["Content-Encoding"] = gzip.compress(body), "gzip"
    request = urllib.request.Request(f"http://127.0.0.1:{sidecar.http_port}/v1/traces", data=body, headers=headers)
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200 and response.headers["Content-Type"].startswith("application/json")
    _check_roundtrip(sidecar, tmp_path, sent)


def test_a_full_ingest_queue_answers_partial_success_and_counts_the_drop(make_sidecar):
    sidecar = make_sidecar(grpc_port=None, max_queued_spans=2)
    sidecar.export.shutdown(1.0)  # nobody drains: the queue stays full
    exporter = HttpSpanExporter(endpoint=f"http://127.0.0.1:{sidecar.http_port}/v1/traces")
    memory = InMemorySpanExporter()
    batch = _emit_worker_spans(memory)  # 3 spans in one resource: more than the queue holds
    assert exporter.export(batch) == SpanExportResult.SUCCESS  # OTLP: partial success is not an error
    assert len(sidecar.queue) == 0
    assert (
        sidecar.registry.get_sample_value("splitscope_tracer_dropped_records_total", {"reason": "sidecar_queue_full"})
        == 3
    )
