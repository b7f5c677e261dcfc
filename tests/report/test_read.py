"""The report's reader: OTLP/JSON lines and the collector's protobuf records, told apart by content; step
spans read straight into columns give exactly the tables the generic reader gives."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from array import array

import numpy as np
import pytest
from google.protobuf import json_format
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.trace.v1.trace_pb2 import TracesData
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

import tracer.report.tables as tables
from tests.synthetic import TraceOptions, scenario, write_traces
from tracer import TraceContext, start_tracing
from tracer import spans as s
from tracer.export.otel import OtlpJsonFileExporter
from tracer.metrics import Catalogue
from tracer.otlp import ReadStats, TraceFileError, iter_spans
from tracer.report.tables import TraceData, TraceDataError, load_traces

MS = 1_000_000


def _generic_load(monkeypatch, paths, **kwargs) -> TraceData:
    """The tables as the generic reader (tracer.otlp.iter_spans: a Span for every span) gives them."""
    with monkeypatch.context() as patch:
        patch.setattr(
            tables,
            "iter_report_spans",
            lambda p, *, skip_bad, stats, steps: iter_spans(p, skip_bad=skip_bad, stats=stats),
        )
        return load_traces(paths, **kwargs)


def _assert_same_tables(one: TraceData, other: TraceData) -> None:
    for table in ("requests", "steps", "transfers"):
        left, right = getattr(one, table), getattr(other, table)
        for name in left.__dataclass_fields__:
            a, b = getattr(left, name), getattr(right, name)
            assert a.dtype == b.dtype, (table, name)
            assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), (table, name)
    assert (one.workers, one.models) == (other.workers, other.models)
    assert (one.read.lines, one.read.spans, one.skipped_spans) == (
        other.read.lines,
        other.read.spans,
        other.skipped_spans,
    )


def _rewrite(path, out, change) -> None:
    """Copy an OTLP/JSON file, passing every span dict through `change` (which edits it in place)."""
    with open(path) as source, open(out, "w") as sink:
        for line in source:
            request = json.loads(line)
            for resource_spans in request["resourceSpans"]:
                for scope_spans in resource_spans["scopeSpans"]:
                    for span in scope_spans["spans"]:
                        change(span)
            sink.write(json.dumps(request) + "\n")


def test_steps_read_into_columns_equal_the_generic_readers_tables(scenario_traces, monkeypatch):
    _, path, truth = scenario_traces("wrong-split")
    data = load_traces([path])
    assert len(data.steps) == sum(len(log.duration_s) for log in truth.steps.values()) > 1000
    _assert_same_tables(data, _generic_load(monkeypatch, [path]))


def test_unusual_step_attributes_read_as_the_generic_reader_reads_them(tmp_path, monkeypatch):
    """Every way a step span can leave the fast path, in OTLP/JSON and in protobuf: the tables still equal
    the generic reader's."""
    sc = scenario("long-prompts", n_requests=40)
    path, odd = tmp_path / "t.jsonl", tmp_path / "odd.jsonl"
    write_traces(path, sc.layout, sc.workload, sc.costs, options=TraceOptions(spans_per_line=64))
    count = 0

    def change(span):
        nonlocal count
        if span["name"] != s.SPAN_STEP:
            return
        count += 1
        attributes = {a["key"]: a for a in span["attributes"]}
        variant = count % 8
        if variant == 0:  # weight as a double, and an unknown attribute
            span["attributes"].append({"key": s.ATTR_SAMPLE_WEIGHT, "value": {"doubleValue": 2.5}})
            span["attributes"].append({"key": "x.extra", "value": {"arrayValue": {"values": [{"intValue": "1"}]}}})
        elif variant == 1:  # a token count written as a double: the generic path truncates it
            attributes[s.ATTR_STEP_CONTEXT_TOKENS]["value"] = {"doubleValue": 123.75}
        elif variant == 2:  # attention work as an int, weight as an int
            attributes[s.ATTR_STEP_PREFILL_ATTENTION_TOKENS2]["value"] = {"intValue": "4096"}
            span["attributes"].append({"key": s.ATTR_SAMPLE_WEIGHT, "value": {"intValue": "10"}})
        elif variant == 3:  # no attention work recorded
            span["attributes"].remove(attributes[s.ATTR_STEP_PREFILL_ATTENTION_TOKENS2])
        elif variant == 4:  # a NaN weight reads as "not recorded"
            span["attributes"].append({"key": s.ATTR_SAMPLE_WEIGHT, "value": {"doubleValue": "NaN"}})
        elif variant == 5:  # ids in upper case, an attribute given twice (the last one holds)
            span["traceId"] = span["traceId"].upper()
            span["attributes"].append({"key": s.ATTR_STEP_DECODE_REQUESTS, "value": {"intValue": "7"}})

    _rewrite(path, odd, change)
    _assert_same_tables(load_traces([odd]), _generic_load(monkeypatch, [odd]))
    # The same spans as protobuf records (ids from hex to bytes, the rest by the protobuf JSON mapping).
    proto = tmp_path / "odd.pb"
    with open(odd, "rb") as source, open(proto, "wb") as sink:
        for line in source:
            request = json.loads(line)
            for resource_spans in request["resourceSpans"]:
                for scope_spans in resource_spans["scopeSpans"]:
                    for span in scope_spans["spans"]:
                        for key in ("traceId", "spanId", "parentSpanId"):
                            if span.get(key):
                                span[key] = base64.b64encode(bytes.fromhex(span[key])).decode()
            sink.write(_frame(json_format.ParseDict(request, TracesData()).SerializeToString()))
    _assert_same_tables(load_traces([proto]), _generic_load(monkeypatch, [proto]))
    _assert_same_tables(load_traces([proto]), load_traces([odd]))


@pytest.mark.parametrize(
    "value, message",
    [
        (None, "lacks attribute 'splitscope.step.prefill_tokens'"),
        ({"stringValue": "12"}, "is not a number"),
        ({"boolValue": True}, "is not a number"),
    ],
)
def test_a_bad_step_span_is_named_and_skip_bad_counts_it(tmp_path, monkeypatch, value, message):
    sc = scenario("long-prompts", n_requests=30)
    path, bad = tmp_path / "t.jsonl", tmp_path / "bad.jsonl"
    write_traces(path, sc.layout, sc.workload, sc.costs)
    done = []

    def change(span):
        if span["name"] == s.SPAN_STEP and not done:
            done.append(span)
            kept = [a for a in span["attributes"] if a["key"] != s.ATTR_STEP_PREFILL_TOKENS]
            span["attributes"] = kept + ([{"key": s.ATTR_STEP_PREFILL_TOKENS, "value": value}] if value else [])

    _rewrite(path, bad, change)
    with pytest.raises(TraceDataError, match=message):
        load_traces([bad])
    skipped = load_traces([bad], skip_bad=True)
    assert skipped.skipped_spans == 1 and message in skipped.first_skip
    _assert_same_tables(skipped, _generic_load(monkeypatch, [bad], skip_bad=True))


# ------------------------------------------------------------------------------------- OTLP protobuf


def _exported_spans(n_requests: int):
    """Finished SDK spans from real tracing sessions (a router and a worker), as our exporter gets them."""
    exporters = (InMemorySpanExporter(), InMemorySpanExporter())  # a session's shutdown shuts its exporter
    catalogue = Catalogue(CollectorRegistry())
    router = start_tracing(None, None, catalogue=catalogue, processors=[SimpleSpanProcessor(exporters[0])])
    worker = start_tracing(
        "colocated", "colocated-0", catalogue=catalogue, processors=[SimpleSpanProcessor(exporters[1])]
    )
    t = 10_000 * MS
    for i in range(n_requests):
        client = TraceContext.new_root().child(0x1234 + i)
        root_id = s.new_span_id()
        ctx = client.child(root_id)
        start = t + i * 200 * MS
        prompt, output = 100 + 10 * i, 3 + i % 4
        worker.tracer.stage("queue", ctx, start, start + 2 * MS)
        worker.tracer.stage(
            "prefill",
            ctx,
            start + 2 * MS,
            start + 50 * MS,
            {s.ATTR_PREFILL_TOKENS: prompt, s.ATTR_PREFILL_CACHED_TOKENS: i % 3 * 16, s.ATTR_PREFILL_CHUNKS: 1},
        )
        worker.tracer.step(start + 2 * MS, start + 50 * MS, 0, prompt, prompt, prompt**2)
        tokens = array("q", [start + 50 * MS + k * 10 * MS for k in range(output)])
        for k in range(1, output):
            worker.tracer.step(tokens[k - 1], tokens[k], 1, 0, prompt + k)
        end = int(tokens[-1])
        worker.tracer.decode(ctx, start + 50 * MS, end, tokens, None, {s.ATTR_OUTPUT_TOKENS: output})
        router.tracer.request(
            client,
            root_id,
            start - MS,
            end + MS,
            start + 51 * MS,
            model="tiny",
            mode="colocated",
            request_id=f"req-{i}",
            input_tokens=prompt,
            output_tokens=output,
            token_gap_s=array("d", [0.01] * (output - 1)),
        )
    router.shutdown(5.0)
    worker.shutdown(5.0)
    return [span for exporter in exporters for span in exporter.get_finished_spans()]


def _frame(message: bytes) -> bytes:
    """The collector file exporter's `format: proto` framing: a 4-byte big-endian length, then the bytes."""
    return len(message).to_bytes(4, "big") + message


@pytest.fixture(scope="module")
def json_and_proto(tmp_path_factory):
    """The same exported spans as OTLP/JSON lines (our file exporter) and as protobuf records."""
    folder = tmp_path_factory.mktemp("proto")
    spans = _exported_spans(24)
    assert len(spans) > 24 * 5
    json_path, proto_path = folder / "traces.jsonl", folder / "traces.jsonl.pb"
    exporter = OtlpJsonFileExporter(json_path)
    records = []
    for first in range(0, len(spans), 50):  # batches, as a batch processor hands them on
        batch = spans[first : first + 50]
        exporter.export(batch)
        message = encode_spans(batch).SerializeToString()  # the OTLP exporters' own protobuf encoder
        assert TracesData.FromString(message).resource_spans  # the message the file exporter writes
        records.append(_frame(message))
    proto_path.write_bytes(b"".join(records))
    return json_path, proto_path, len(spans), len(records)


def test_a_protobuf_file_reads_the_same_requests_as_the_json_file(json_and_proto, monkeypatch):
    json_path, proto_path, n_spans, n_records = json_and_proto
    from_json, from_proto = load_traces([json_path]), load_traces([proto_path])
    assert len(from_json.requests) == 24 and len(from_json.steps) > 24
    assert from_proto.read.spans == n_spans and from_proto.read.lines == n_records
    _assert_same_tables(from_proto, from_json)
    _assert_same_tables(from_proto, _generic_load(monkeypatch, [proto_path]))  # protobuf steps into columns
    assert from_proto.requests.output_tokens.tolist() == [3 + i % 4 for i in range(24)]


def test_the_format_is_told_by_content_not_by_name(json_and_proto, tmp_path):
    json_path, proto_path, n_spans, _ = json_and_proto
    misnamed_json, misnamed_proto = tmp_path / "spans.pb", tmp_path / "spans.jsonl"
    misnamed_json.write_bytes(json_path.read_bytes())
    misnamed_proto.write_bytes(proto_path.read_bytes())
    assert sum(1 for _ in iter_spans([misnamed_proto])) == sum(1 for _ in iter_spans([misnamed_json])) == n_spans
    _assert_same_tables(load_traces([misnamed_proto]), load_traces([misnamed_json]))


def test_generic_reader_reads_protobuf_spans_like_json_ones(json_and_proto):
    json_path, proto_path, _, _ = json_and_proto
    from_json, from_proto = list(iter_spans([json_path])), list(iter_spans([proto_path]))
    assert from_proto == from_json  # ids, times, kinds, attributes, resource, events, status


@pytest.mark.parametrize(
    "content, message",
    [
        (b"hello, not traces\n", "not a trace file"),
        (_frame(b"\xff\xff\xff\xff"), "not an OTLP protobuf TracesData message"),
        (_frame(b"\x28\xb5\x2f\xfd" + b"\x00" * 8), "zstd-compressed"),
    ],
)
def test_a_bad_file_is_one_clear_error(tmp_path, content, message):
    path = tmp_path / "bad.bin"
    path.write_bytes(content)
    with pytest.raises(TraceFileError, match=message) as error:
        load_traces([path])
    assert error.value.line_number == 1


def test_a_truncated_protobuf_file_fails_at_its_last_record_or_is_counted(json_and_proto, tmp_path):
    _, proto_path, _, n_records = json_and_proto
    truncated = tmp_path / "truncated.pb"
    truncated.write_bytes(proto_path.read_bytes()[:-10])
    with pytest.raises(TraceFileError, match="truncated OTLP protobuf file") as error:
        load_traces([truncated])
    assert error.value.line_number == n_records
    stats = ReadStats()
    assert sum(1 for _ in iter_spans([truncated], skip_bad=True, stats=stats)) > 0
    assert (stats.lines, stats.skipped_lines) == (n_records - 1, 1)
    assert list(iter_spans([truncated], growing=True))  # a file being written: the partial record waits


def test_the_cli_says_what_is_wrong_with_a_bad_file_in_one_line(tmp_path):
    path = tmp_path / "traces.jsonl"
    path.write_bytes(b"\x00\x00\x01\x00" + b"\x0a\x03abc")
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from tracer.cli.main import main; main()",
            "report",
            str(path),
            "--slo-ttft",
            "1",
            "--slo-itl",
            "0.1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    (line,) = done.stderr.strip().splitlines()
    assert f"{path}:1:" in line and "not a trace file" in line and "declares 256 bytes but 5 follow" in line
