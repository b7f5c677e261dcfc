"""The advisor's OTLP/HTTP receiver (`advise --follow --otlp-port`), spoken to by the OpenTelemetry SDK's
own exporter and by plain HTTP clients for the error answers."""

from __future__ import annotations

import gzip
import http.client
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from opentelemetry.exporter.otlp.json.common.trace_encoder import encode_spans as encode_json
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tracer.advise.otlp_in import OtlpInbox

RESOURCE = Resource({"service.name": "worker", "service.namespace": "team-a"})


@pytest.fixture
def inbox() -> Iterator[OtlpInbox]:
    receiver = OtlpInbox("127.0.0.1", 0, max_body_bytes=64 * 1024, max_requests=2)
    yield receiver
    receiver.close()


def _url(inbox: OtlpInbox, path: str = "/v1/traces") -> str:
    return f"http://127.0.0.1:{inbox.address[1]}{path}"


def _sdk_spans(n: int) -> list:
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=RESOURCE)
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("test")
    for i in range(n):
        with tracer.start_as_current_span(f"step-{i}") as span:
            span.set_attribute("splitscope.step.batch_size", i)
    provider.shutdown()
    return list(memory.get_finished_spans())


def _post(inbox: OtlpInbox, body: bytes, headers: dict[str, str], path: str = "/v1/traces") -> tuple[int, bytes]:
    request = urllib.request.Request(_url(inbox, path), data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def test_the_sdk_exporter_delivers_spans_with_ids_times_attributes_and_resource(inbox: OtlpInbox) -> None:
    sent = _sdk_spans(3)
    exporter = OTLPSpanExporter(endpoint=_url(inbox))
    assert exporter.export(sent) == SpanExportResult.SUCCESS
    exporter.shutdown()
    (received,) = inbox.drain()
    assert [(s.name, s.trace_id, s.span_id, s.start_ns, s.end_ns) for s in received] == [
        (s.name, f"{s.context.trace_id:032x}", f"{s.context.span_id:016x}", s.start_time, s.end_time) for s in sent
    ]
    assert [s.attributes["splitscope.step.batch_size"] for s in received] == [0, 1, 2]
    assert received[0].resource["service.namespace"] == "team-a"
    assert inbox.drain() == []


@pytest.mark.parametrize("gzipped", [False, True])
def test_otlp_json_is_taken_gzipped_or_not(inbox: OtlpInbox, gzipped: bool) -> None:
    sent = _sdk_spans(2)
    body = encode_spans(sent).SerializeToString()
    json_body = encode_json(sent).to_json().encode()  # the OpenTelemetry project's OTLP/JSON encoder
    headers = {"Content-Type": "application/json"}
    if gzipped:
        json_body, headers["Content-Encoding"] = gzip.compress(json_body), "gzip"
    assert _post(inbox, json_body, headers) == (200, b"{}")
    assert _post(inbox, body, {"Content-Type": "application/x-protobuf"}) == (200, b"")
    json_spans, proto_spans = inbox.drain()
    assert (
        [s.span_id for s in json_spans]
        == [s.span_id for s in proto_spans]
        == [f"{s.context.span_id:016x}" for s in sent]
    )


@pytest.mark.parametrize(
    "body, headers, status, words",
    [
        (b"{}", {"Content-Type": "text/plain"}, 415, "unsupported content type"),
        (b"{}", {"Content-Type": "application/json", "Content-Encoding": "br"}, 415, "content encoding"),
        (b"not json", {"Content-Type": "application/json"}, 400, "malformed OTLP request"),
        (b"\xff\xff\xff", {"Content-Type": "application/x-protobuf"}, 400, "malformed OTLP request"),
        (b"x" * (64 * 1024 + 1), {"Content-Type": "application/json"}, 413, "exceeds"),
        (
            gzip.compress(b" " * (256 * 1024)),
            {"Content-Type": "application/json", "Content-Encoding": "gzip"},
            413,
            "exceeds",
        ),  # fmt: skip
    ],
)
def test_bad_exports_get_one_clear_4xx_and_take_nothing(inbox, body, headers, status, words) -> None:  # type: ignore[no-untyped-def]
    code, answer = _post(inbox, body, headers)
    assert code == status and words in answer.decode()
    assert inbox.drain() == []


def test_other_paths_methods_and_a_missing_length_are_refused(inbox: OtlpInbox) -> None:
    assert _post(inbox, b"{}", {"Content-Type": "application/json"}, path="/v1/metrics")[0] == 404
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(_url(inbox), timeout=10)
    assert refused.value.code == 405
    connection = http.client.HTTPConnection("127.0.0.1", inbox.address[1], timeout=10)
    connection.putrequest("POST", "/v1/traces")
    connection.putheader("Content-Type", "application/json")
    connection.endheaders()
    assert connection.getresponse().status == 411
    connection.close()


def test_a_full_inbox_answers_503_to_retry_and_loses_nothing_it_accepted(inbox: OtlpInbox) -> None:
    bodies = [encode_spans(_sdk_spans(1)).SerializeToString() for _ in range(3)]
    headers = {"Content-Type": "application/x-protobuf"}
    assert [_post(inbox, body, headers)[0] for body in bodies] == [200, 200, 503]  # max_requests=2
    request = urllib.request.Request(_url(inbox), data=bodies[2], headers=headers)
    with pytest.raises(urllib.error.HTTPError) as full:
        urllib.request.urlopen(request, timeout=10)
    assert full.value.code == 503 and full.value.headers["Retry-After"] == "1"
    assert len(inbox.drain()) == 2 and inbox.refused_full == 2
    assert _post(inbox, bodies[2], headers)[0] == 200  # the retry, once the loop drained
    assert len(inbox.drain()) == 1
