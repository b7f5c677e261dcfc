"""Records -> spans and metrics, asserted on an in-memory exporter and on the exposition text."""

from __future__ import annotations

import re
from array import array

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.exposition import (
    generate_latest as openmetrics_latest,
)

from tests.conftest import wait_for
from tracer import TraceContext, start_tracing
from tracer import spans as s
from tracer.export.gpu import GpuSampler
from tracer.export.local_sink import MetricsRecorder
from tracer.export.otel import otlp_exporter_from_env, to_readable_span
from tracer.metrics import Catalogue
from tracer.otlp import iter_spans
from tracer.pipeline import SpanBuilder
from tracer.records import KIND_REQUEST, KIND_STEP, RequestRecord
from tracer.slo_outcome import RequestSlo
from tracer.timing import default_clock
from tracer.vocabulary import SloObjective

MS = 1_000_000


class Exporters:
    """One in-memory exporter per session (shutting a session down shuts its exporter)."""

    def __init__(self):
        self.exporters = []

    def new(self):
        self.exporters.append(InMemorySpanExporter())
        return self.exporters[-1]

    def get_finished_spans(self):
        return [span for e in self.exporters for span in e.get_finished_spans()]


@pytest.fixture
def traced():
    exporter = Exporters()
    registry = CollectorRegistry()
    catalogue = Catalogue(registry)
    sessions = []

    def start(pool, worker, **kwargs):
        session = start_tracing(
            pool, worker, catalogue=catalogue, processors=[SimpleSpanProcessor(exporter.new())], **kwargs
        )
        sessions.append(session)
        return session

    yield start, exporter, registry
    for session in sessions:
        session.shutdown(1.0)


def sample(registry, name, labels):
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_one_request_across_router_and_worker_has_the_contract_structure(traced):
    start, exporter, registry = traced
    router = start(None, None)
    worker = start("colocated", "w0")
    client = TraceContext.new_root().child(0x1234)
    root_id = s.new_span_id()
    ctx = client.child(root_id)  # what the router propagates to the worker in traceparent
    t = 10_000 * MS  # marks are host perf_counter_ns values; these are made up but consistent
    worker.tracer.stage("queue", ctx, t, t + 2 * MS)
    worker.tracer.stage(
        "prefill",
        ctx,
        t + 2 * MS,
        t + 50 * MS,
        {s.ATTR_PREFILL_TOKENS: 100, s.ATTR_PREFILL_CACHED_TOKENS: 16, s.ATTR_PREFILL_CHUNKS: 1},
    )
    token_times = array("q", [t + 50 * MS + i * 10 * MS for i in range(5)])
    token_times[3] += 60 * MS  # a stall between tokens 2 and 3, with a 2000-token prefill in that step
    prefill_in_step = array("i", [0, 0, 0, 2000, 0])
    worker.tracer.decode(ctx, t + 50 * MS, t + 150 * MS, token_times, prefill_in_step, {s.ATTR_OUTPUT_TOKENS: 5})
    router.tracer.request(
        client,
        root_id,
        t - 1 * MS,
        t + 150 * MS,
        t + 51 * MS,
        model="tiny",
        mode="colocated",
        request_id="req-1",
        input_tokens=100,
        output_tokens=5,
        token_gap_s=array("d", [0.02, 0.0, 0.07, 0.01]),  # token 2's text came with token 3
    )
    router.shutdown(1.0)
    worker.shutdown(1.0)

    spans = {span.name: span for span in exporter.get_finished_spans()}
    root = spans["text_completion tiny"]
    assert root.kind == SpanKind.SERVER and root.parent.span_id == 0x1234
    assert root.attributes[s.ATTR_MODE] == "colocated" and root.attributes[s.ATTR_REQUEST_ID] == "req-1"
    assert root.attributes[s.ATTR_TTFT_S] == pytest.approx(0.052)
    assert root.attributes[s.ATTR_ITL_JOINED_TOKENS] == 1 and root.attributes[s.ATTR_ITL_MAX_S] == pytest.approx(0.07)
    for name in (s.SPAN_QUEUE, s.SPAN_PREFILL, s.SPAN_DECODE):
        span = spans[name]
        assert span.context.trace_id == root.context.trace_id
        assert span.parent.span_id == root_id
        assert span.attributes[s.ATTR_POOL] == "colocated" and span.attributes[s.ATTR_WORKER] == "w0"
        assert span.attributes[s.ATTR_TIMING_SOURCE] == "host"
        assert span.end_time > span.start_time
    assert spans[s.SPAN_PREFILL].end_time - spans[s.SPAN_PREFILL].start_time == 48 * MS
    decode = spans[s.SPAN_DECODE]
    assert decode.attributes[s.ATTR_DECODE_STALLS] == 1
    assert decode.attributes[s.ATTR_DECODE_ITL_MAX_S] == pytest.approx(0.07)
    assert decode.attributes[s.ATTR_DECODE_ITL_P50_S] == pytest.approx(0.01)
    (stall,) = decode.events
    assert stall.name == s.EVENT_DECODE_STALL and stall.attributes["prefill_tokens"] == 2000
    assert stall.attributes["gap_s"] == pytest.approx(0.07)

    assert sample(registry, "splitscope_stage_duration_seconds_count", {"stage": "prefill", "pool": "colocated"}) == 1
    assert sample(registry, "splitscope_inter_token_latency_seconds_count", {"pool": "colocated"}) == 4
    assert sample(registry, "splitscope_tokens_total", {"pool": "colocated", "phase": "prefill"}) == 84
    assert sample(registry, "splitscope_prefix_cache_hit_tokens_total", {"pool": "colocated"}) == 16
    labels = {"gen_ai_request_model": "tiny", "mode": "colocated"}
    assert sample(registry, "gen_ai_server_time_to_first_token_seconds_sum", labels) == pytest.approx(0.052)
    # TPOT = (e2e - ttft) / (tokens - 1) = (0.151 - 0.052) / 4
    assert sample(registry, "gen_ai_server_time_per_output_token_seconds_sum", labels) == pytest.approx(0.02475)


def test_latency_histograms_carry_the_trace_id_as_an_exemplar(traced):
    start, _, registry = traced
    router = start(None, None)
    ctx = TraceContext.new_root()
    router.tracer.request(
        ctx,
        77,
        0,
        300 * MS,
        120 * MS,
        model="m",
        mode="disaggregated",
        request_id="r",
        input_tokens=10,
        output_tokens=3,
    )
    router.shutdown(1.0)
    text = openmetrics_latest(registry).decode()
    line = next(
        row
        for row in text.splitlines()
        if row.startswith("gen_ai_server_time_to_first_token_seconds_bucket") and "#" in row
    )
    assert re.search(r'# \{trace_id="%032x"\} 0\.12' % ctx.trace_id, line), line


def test_a_steps_prefill_attention_is_an_attribute_only_when_the_engine_gives_it(traced):
    start, exporter, _ = traced
    worker = start("colocated", "w0")
    worker.tracer.step(0, 20 * MS, 4, 512, 1000, 1536**2 - 1024**2)  # a 512-token chunk at offset 1024
    worker.tracer.step(30 * MS, 40 * MS, 4, 0, 1004)
    worker.shutdown(1.0)
    steps = sorted(
        (span for span in exporter.get_finished_spans() if span.name == s.SPAN_STEP), key=lambda x: x.start_time
    )
    assert steps[0].attributes[s.ATTR_STEP_PREFILL_ATTENTION_TOKENS2] == 1536**2 - 1024**2
    assert s.ATTR_STEP_PREFILL_ATTENTION_TOKENS2 not in steps[1].attributes


def test_step_records_split_by_prefill_and_sampled_one_in_n(traced):
    start, exporter, registry = traced
    worker = start("colocated", "w0", step_sample_every=3)
    for i in range(9):
        t = i * 100 * MS
        worker.tracer.step(t, t + (80 if i % 2 else 20) * MS, 4, 2000 if i % 2 else 0, 1000)
    worker.shutdown(1.0)
    steps = [span for span in exporter.get_finished_spans() if span.name == s.SPAN_STEP]
    # Stratified: all 4 steps with prefill tokens (weight 1), 1 in 3 of the 5 decode-only ones (weight 3).
    weights = sorted(
        (span.attributes[s.ATTR_STEP_PREFILL_TOKENS] > 0, span.attributes[s.ATTR_SAMPLE_WEIGHT]) for span in steps
    )
    assert weights == [(False, 3), (False, 3), (True, 1), (True, 1), (True, 1), (True, 1)]
    assert len({span.context.trace_id for span in steps}) == 1  # one trace per worker window
    with_prefill = {"pool": "colocated", "prefill_in_step": "true"}
    without = {"pool": "colocated", "prefill_in_step": "false"}
    assert sample(registry, "splitscope_step_duration_seconds_count", with_prefill) == 4
    assert sample(registry, "splitscope_step_duration_seconds_count", without) == 5
    assert sample(registry, "splitscope_step_duration_seconds_sum", with_prefill) == pytest.approx(0.32)
    assert sample(
        registry, "splitscope_worker_busy_seconds_total", {"pool": "colocated", "worker": "w0"}
    ) == pytest.approx(0.42)


def test_errors_set_status_and_error_type(traced):
    start, exporter, registry = traced
    worker = start("prefill", "p0")
    ctx = TraceContext.new_root().child(9)
    worker.tracer.stage_wall("kv_transfer", ctx, 1_000, 2_000, {s.ATTR_KV_BYTES: 10}, error_type="checksum")
    worker.shutdown(1.0)
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code == StatusCode.ERROR and span.attributes["error.type"] == "checksum"
    assert sample(registry, "splitscope_kv_transfer_failures_total", {"reason": "checksum"}) == 1


def test_a_full_ring_drops_oldest_and_counts_it_in_the_metric(traced):
    start, exporter, registry = traced
    worker = start("decode", "d0", ring_capacity=8, interval_s=3600)  # the thread will not drain in time
    for i in range(20):
        worker.tracer.step(i, i + 1, 1, 0, 10)
    worker.shutdown(1.0)
    assert len([x for x in exporter.get_finished_spans()]) == 8
    assert sample(registry, "splitscope_tracer_dropped_records_total", {"reason": "ring_full"}) == 12


def test_traces_file_written_by_a_session_reads_back(tmp_path):
    path = tmp_path / "t.jsonl"
    session = start_tracing("colocated", "w0", traces_file=str(path))
    ctx = TraceContext.new_root().child(3)
    session.tracer.stage("prefill", ctx, 0, 5 * MS, {s.ATTR_PREFILL_TOKENS: 7})
    session.shutdown(2.0)
    (span,) = list(iter_spans([path]))
    assert span.name == s.SPAN_PREFILL and span.trace_id == f"{ctx.trace_id:032x}"
    assert span.attributes[s.ATTR_PREFILL_TOKENS] == 7
    assert span.resource["service.name"] == "splitscope-colocated"


def test_disabled_tracing_is_a_noop():
    session = start_tracing("colocated", "w0", enabled=False)
    t = session.tracer
    assert t.enabled is False and t.mark() == 0
    assert t.stage("prefill", None, 0, 0, span_id=5) == 5
    session.shutdown()


@pytest.mark.parametrize(
    "header, expected",
    [
        (
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            (0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, True),
        ),
        (
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00",
            (0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, False),
        ),
        ("00-00000000000000000000000000000000-b7ad6b7169203331-01", None),
        ("ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", None),
        ("garbage", None),
        (None, None),
    ],
)
def test_traceparent_extract(header, expected):
    ctx = TraceContext.from_traceparent(header)
    assert (None if ctx is None else (ctx.trace_id, ctx.span_id, ctx.sampled)) == expected
    if ctx is not None:
        assert TraceContext.from_traceparent(ctx.traceparent()) == ctx


def test_otlp_exporter_follows_the_environment():
    assert otlp_exporter_from_env({}) is None
    grpc = otlp_exporter_from_env(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    )
    http = otlp_exporter_from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    assert "grpc" in type(grpc).__module__ and "http" in type(http).__module__
    with pytest.raises(ValueError, match="not one of"):
        otlp_exporter_from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "x", "OTEL_EXPORTER_OTLP_PROTOCOL": "carrier-pigeon"})


def test_gpu_sampler_without_a_driver_reports_down_and_raises_nothing():
    registry = CollectorRegistry()
    catalogue = Catalogue(registry)
    sampler = GpuSampler(catalogue).start()  # no NVIDIA driver on this machine
    sampler.stop()
    assert sampler.available is False and sampler.reason
    assert registry.get_sample_value("splitscope_gpu_telemetry_up") == 0


def test_gpu_sampler_with_nvml_sets_utilisation_and_memory():
    class FakeNvml:  # the GPU boundary: NVML's API shape
        def nvmlInit(self):
            pass

        def nvmlDeviceGetCount(self):
            return 1

        def nvmlDeviceGetHandleByIndex(self, i):
            return i

        def nvmlDeviceGetUtilizationRates(self, h):
            return type("U", (), {"gpu": 87})()

        def nvmlDeviceGetMemoryInfo(self, h):
            return type("M", (), {"used": 5 * 2**30})()

    registry = CollectorRegistry()
    sampler = GpuSampler(Catalogue(registry), interval_s=0.01, nvml=FakeNvml()).start()
    try:
        wait_for(
            lambda: registry.get_sample_value("splitscope_gpu_memory_used_bytes", {"gpu": "0"}) is not None,
            timeout_s=5,
            what="the GPU sampler's first report",
        )
    finally:
        sampler.stop()
    assert registry.get_sample_value("splitscope_gpu_utilization_ratio", {"gpu": "0"}) == pytest.approx(0.87)
    assert registry.get_sample_value("splitscope_gpu_telemetry_up") == 1


def test_a_malformed_record_is_dropped_and_counted_without_losing_the_batch(traced):
    start, exporter, registry = traced
    worker = start("colocated", "w0", interval_s=3600)
    ctx = TraceContext.new_root().child(1)
    worker.tracer.stage("prefill", ctx, 0, 10)
    worker.tracer.stage("no-such-stage", ctx, 0, 10)
    worker.tracer.stage("decode-ish", None, 0, 10)
    worker.tracer.stage("queue", ctx, 0, 10)
    worker.shutdown(1.0)
    assert sorted(span.name for span in exporter.get_finished_spans()) == [s.SPAN_PREFILL, s.SPAN_QUEUE]
    assert sample(registry, "splitscope_tracer_dropped_records_total", {"reason": "bad_record"}) == 2


def test_a_tuple_that_is_no_record_is_counted_as_bad_without_losing_the_batch(traced):
    start, exporter, registry = traced
    worker = start("colocated", "w0", interval_s=3600)
    ctx = TraceContext.new_root().child(1)
    worker.tracer.stage("prefill", ctx, 0, 10)
    worker.tracer.ring.append((KIND_STEP, 0))  # too short for a step record
    worker.tracer.ring.append((99,))  # no such record kind
    worker.tracer.stage("queue", ctx, 0, 10)
    worker.shutdown(1.0)
    assert sorted(span.name for span in exporter.get_finished_spans()) == [s.SPAN_PREFILL, s.SPAN_QUEUE]
    assert sample(registry, "splitscope_tracer_dropped_records_total", {"reason": "bad_record"}) == 2


@pytest.mark.parametrize(
    "kind, expected",
    [
        (1, SpanKind.INTERNAL),
        (2, SpanKind.SERVER),
        (3, SpanKind.CLIENT),
        (4, SpanKind.PRODUCER),
        (5, SpanKind.CONSUMER),
    ],
)
def test_span_kinds_pass_through_to_the_sdk_span(kind, expected):
    from opentelemetry.sdk.resources import Resource

    data = s.SpanData("x", kind, 1, 2, 0, 10, 20, {})
    assert to_readable_span(data, Resource({})).kind == expected


def test_failure_counters_exist_at_zero_before_the_first_failure():
    from prometheus_client import generate_latest

    from tracer.metrics import KV_TRANSFER_FAILURE_REASONS

    registry = CollectorRegistry()
    Catalogue(registry)
    text = generate_latest(registry).decode()
    for reason in KV_TRANSFER_FAILURE_REASONS:
        assert f'splitscope_kv_transfer_failures_total{{reason="{reason}"}} 0.0' in text
    assert 'splitscope_tracer_dropped_records_total{reason="ring_full"} 0.0' in text


def _metered_spans():
    """Two workers' steps (with and without prefill), stages with samples, KV transfers, requests."""
    spans, t = [], 10**18
    for i in range(40):
        worker = {s.ATTR_POOL: "colocated", s.ATTR_WORKER: f"w{i % 2}"}
        spans.append(
            s.SpanData(
                s.SPAN_STEP,
                s.KIND_INTERNAL,
                1,
                100 + i,
                0,
                t,
                t + (i % 7 + 1) * MS,
                {**worker, s.ATTR_STEP_PREFILL_TOKENS: 512 if i % 3 == 0 else 0},
            )
        )
        if i % 4 == 0:
            trace = 1000 + i
            spans += [
                s.SpanData(
                    s.SPAN_PREFILL,
                    s.KIND_INTERNAL,
                    trace,
                    2,
                    1,
                    t,
                    t + 30 * MS,
                    {**worker, s.ATTR_PREFILL_TOKENS: 100 + i, s.ATTR_PREFILL_CACHED_TOKENS: 16},
                ),
                s.SpanData(
                    s.SPAN_DECODE,
                    s.KIND_INTERNAL,
                    trace,
                    3,
                    1,
                    t,
                    t + 90 * MS,
                    {**worker, s.ATTR_OUTPUT_TOKENS: 5},
                    samples={"itl_gaps_s": [0.01 * (i % 5 + 1)] * 4},
                ),
                s.SpanData(
                    s.SPAN_KV_TRANSFER,
                    s.KIND_INTERNAL,
                    trace,
                    4,
                    1,
                    t,
                    t + 2 * MS,
                    {s.ATTR_POOL: "prefill", s.ATTR_WORKER: "p0", s.ATTR_KV_BYTES: 4096},
                    error_type="checksum" if i % 8 == 0 else "",
                ),
                s.SpanData(
                    "text_completion tiny",
                    s.KIND_SERVER,
                    trace,
                    1,
                    0,
                    t,
                    t + 120 * MS,
                    {s.ATTR_MODEL: "tiny", s.ATTR_MODE: "colocated", s.ATTR_TTFT_S: 0.04, s.ATTR_OUTPUT_TOKENS: 5},
                ),
            ]
        t += 10 * MS
    return spans


def _exposition_without_timestamps(registry):
    """Exposition lines without exemplars' and `_created` wall times; values to 9 digits (a batch sums in
    another order than one span at a time)."""
    out = []
    for line in openmetrics_latest(registry).decode().splitlines():
        line = line.split(" # ")[0]
        if "_created" in line:
            continue
        if not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            line = f"{series} {float(value):.9g}"
        out.append(line)
    return out


def test_a_batch_is_metered_exactly_as_its_spans_one_by_one():
    one_by_one, batched = (
        MetricsRecorder(Catalogue(CollectorRegistry())),
        MetricsRecorder(Catalogue(CollectorRegistry())),
    )
    spans = _metered_spans()
    for span in spans:
        one_by_one.record(span)
    batched.record_many(spans[:17])
    batched.record_many(spans[17:])
    expected = _exposition_without_timestamps(one_by_one.catalogue.registry)
    assert _exposition_without_timestamps(batched.catalogue.registry) == expected
    assert any(
        line.startswith('splitscope_step_duration_seconds_count{pool="colocated",prefill_in_step="true"} 14')
        for line in expected
    )
    assert any(
        line.startswith('splitscope_inter_token_latency_seconds_count{pool="colocated"} 40') for line in expected
    )


class _FlakySink:
    """A sink that raises on every other batch it is handed, and keeps what it took."""

    def __init__(self):
        self.calls = 0
        self.taken = []

    def emit(self, batch):
        self.calls += 1
        if self.calls % 2 == 0:
            raise RuntimeError("exporter bug")
        self.taken.extend(batch)

    def shutdown(self, timeout_s):
        pass


def test_a_raising_sink_loses_only_its_slice_and_counts_it_as_sink_error():
    from tracer.pipeline import EMIT_SLICE

    sink = _FlakySink()
    session = start_tracing("colocated", "w0", sink=sink, registry=CollectorRegistry(), interval_s=3600)
    records = 5 * EMIT_SLICE + 7  # six slices: the 2nd, 4th and 6th raise
    for i in range(records):
        session.tracer.step(i * 1000, i * 1000 + 500, 1, 0, 10)
    session.pipeline.drain_once()
    lost = records - len(sink.taken)
    assert lost == 2 * EMIT_SLICE + 7
    assert session.dropped_records.by_reason() == {"sink_error": lost}
    dropped = session.registry.get_sample_value("splitscope_tracer_dropped_records_total", {"reason": "sink_error"})
    assert dropped == lost
    session.shutdown(1.0)


@pytest.mark.parametrize(
    "slo, ttft_ms, gap_ms, missed",
    [
        (RequestSlo(0.1, 0.05), 120, 10, SloObjective.TTFT),
        (RequestSlo(0.1, 0.05), 50, 60, SloObjective.ITL),
        (RequestSlo(0.1, 0.05), 150, 60, f"{SloObjective.TTFT},{SloObjective.ITL}"),
        (RequestSlo(0.1, 0.05), 50, 10, None),
        (RequestSlo(itl_s=0.05), 900, 10, None),
    ],
)
def test_the_root_span_says_which_objective_the_request_missed(slo, ttft_ms, gap_ms, missed):
    clock = default_clock("cpu")
    builder = SpanBuilder(clock, None, None, slo=slo)
    start = 1_000 * MS
    first = start + ttft_ms * MS
    record = RequestRecord(
        KIND_REQUEST,
        TraceContext.new_root(),
        7,
        start,
        first + 3 * gap_ms * MS,
        first,
        "m",
        "colocated",
        "r",
        4,
        4,
        array("d", [gap_ms / 1e3] * 3),
        "",
        "text_completion",
    )
    attrs = builder.request(record, clock.resolve(record.start, record.end, record.end)).attributes
    assert attrs[s.ATTR_SLO_VIOLATED] is (missed is not None)
    assert attrs.get(s.ATTR_SLO_MISSED) == missed


def test_without_objectives_the_root_span_has_no_outcome():
    clock = default_clock("cpu")
    record = RequestRecord(
        KIND_REQUEST,
        TraceContext.new_root(),
        7,
        0,
        10 * MS,
        5 * MS,
        "m",
        "colocated",
        "r",
        1,
        2,
        array("d", [0.005]),
        "",
        "text_completion",
    )
    attrs = SpanBuilder(clock, None, None).request(record, clock.resolve(0, 10 * MS, 10 * MS)).attributes
    assert s.ATTR_SLO_VIOLATED not in attrs and s.ATTR_SLO_MISSED not in attrs


def test_a_stalled_decode_span_links_to_the_prefills_of_its_stalled_steps(traced):
    """The step record names its prefills; the decode span built later links to them, each with its
    tokens' share of the gap, the largest first, at most MAX_STALL_LINKS (the rest counted)."""
    from tracer.pipeline import MAX_STALL_LINKS

    start, exporter, _ = traced
    worker = start("colocated", "w0")
    ctx = TraceContext.new_root().child(s.new_span_id())
    t = 10_000 * MS
    token_times = array("q", [t + i * 10 * MS for i in range(6)])
    token_times[3] += 60 * MS  # token 3 ends a 70 ms gap: two prompts ran in its step
    token_times[4] += 60 * MS
    token_times[5] += 60 * MS + 45 * MS  # token 5 ends a 55 ms gap: 40 prompts of one token each
    big, small = (TraceContext.new_root().trace_id, 0xB16), (TraceContext.new_root().trace_id, 0x5A1)
    many = tuple((TraceContext.new_root().trace_id, 0x1000 + i, 1) for i in range(40))
    worker.tracer.step(t, t + MS, 1, 0, 10, emitted_perf_ns=token_times[1])  # no prefill: no link
    worker.tracer.step(t, t + MS, 1, 2000, 10, emitted_perf_ns=token_times[3], prefills=(big + (1500,), small + (500,)))
    worker.tracer.step(t, t + MS, 1, 40, 10, emitted_perf_ns=token_times[5], prefills=many)
    worker.tracer.decode(ctx, t, t + 200 * MS, token_times, None, {s.ATTR_OUTPUT_TOKENS: 6})
    worker.shutdown(1.0)

    (decode,) = [span for span in exporter.get_finished_spans() if span.name == s.SPAN_DECODE]
    assert decode.attributes[s.ATTR_DECODE_STALLS] == 2
    assert decode.attributes[s.ATTR_DECODE_STALLED_NS] == 125 * MS
    links = decode.links
    assert len(links) == MAX_STALL_LINKS
    assert decode.attributes[s.ATTR_DECODE_STALL_LINKS_DROPPED] == 40 + 2 - MAX_STALL_LINKS
    assert [(link.context.trace_id, link.context.span_id) for link in links[:2]] == [big, small]
    assert links[0].attributes[s.ATTR_LINK_STALLED_NS] == round(70 * MS * 0.75)
    assert links[1].attributes[s.ATTR_LINK_STALLED_NS] == round(70 * MS * 0.25)
    assert links[0].attributes[s.ATTR_LINK_PREFILL_TOKENS] == 1500
    assert all(link.attributes[s.ATTR_LINK_STALLED_NS] == round(55 * MS / 40) for link in links[2:])


def test_a_decode_span_without_stalls_has_no_links(traced):
    start, exporter, _ = traced
    worker = start("colocated", "w0")
    ctx = TraceContext.new_root().child(s.new_span_id())
    t = 10_000 * MS
    token_times = array("q", [t + i * 10 * MS for i in range(4)])
    other = (TraceContext.new_root().trace_id, 0xB16, 100)
    worker.tracer.step(t, t + MS, 1, 100, 10, emitted_perf_ns=token_times[2], prefills=(other,))
    worker.tracer.decode(ctx, t, t + 40 * MS, token_times, None)
    worker.shutdown(1.0)
    (decode,) = [span for span in exporter.get_finished_spans() if span.name == s.SPAN_DECODE]
    assert not decode.links and decode.attributes[s.ATTR_DECODE_STALLED_NS] == 0
    assert s.ATTR_DECODE_STALL_LINKS_DROPPED not in decode.attributes


def test_the_inter_token_histogram_leads_to_a_stalled_requests_trace(traced):
    """Each decode span's longest gap is its bucket's exemplar, so the ITL panel's high buckets open the
    trace of a request that stalled there."""
    start, _, registry = traced
    worker = start("colocated", "w0")
    calm, stalled = TraceContext.new_root().child(1), TraceContext.new_root().child(2)
    t = 10_000 * MS
    worker.tracer.decode(calm, t, t + 40 * MS, array("q", [t + i * 10 * MS for i in range(5)]), None)
    times = array("q", [t + i * 10 * MS for i in range(5)])
    times[4] += 400 * MS  # a 410 ms gap
    worker.tracer.decode(stalled, t, t + 500 * MS, times, None)
    worker.shutdown(1.0)
    text = openmetrics_latest(registry).decode()
    rows = [row for row in text.splitlines() if row.startswith("splitscope_inter_token_latency_seconds_bucket")]
    with_exemplar = {re.search(r'le="([^"]+)"', row).group(1): row for row in rows if "#" in row}
    assert set(with_exemplar) == {"0.01", "0.5"}, rows
    assert re.search(r'# \{trace_id="%032x"\} 0\.41' % stalled.trace_id, with_exemplar["0.5"])
    assert '# {trace_id="%032x"} 0.01' % calm.trace_id in with_exemplar["0.01"]
