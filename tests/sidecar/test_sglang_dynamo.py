"""SGLang's request trace slices and PD metrics, Dynamo's transfer estimate: hand-made shapes from the sources.

SGLang (python/sglang/srt/observability/trace.py and req_time_stats.py): a request root span per node,
a span per thread under it, and slice spans named by `RequestStage.stage_name` under each thread. The
spans below are built the same way and sent over OTLP/HTTP (SGLang's exporter with
OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf). No SGLang CPU build installs from PyPI here, so these
are not captured from a running SGLang (docs/engines.md).
"""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from tests.sidecar.conftest import FIXTURES, http_get, spans_when
from tests.sidecar.test_scrape import _families, _value, engine_server  # noqa: F401 (a fixture)
from tracer import spans as s
from tracer.sidecar.scrape import map_families

MS = 1_000_000
T0 = 1_700_000_000_000_000_000
# (slice name, start ms, end ms) of a prefill node, then of a decode node, in SGLang's order.
PREFILL_SLICES = [
    ("tokenize", 0, 1),
    ("prefill_bootstrap", 1, 9),
    ("prefill_waiting", 9, 12),
    ("prefill_forward", 12, 52),
    ("prefill_transfer_kv_cache", 52, 70),
]
DECODE_SLICES = [
    ("decode_prepare", 2, 3),
    ("decode_bootstrap", 3, 10),
    ("decode_transferred", 52, 71),
    ("decode_waiting", 71, 73),
    ("decode_forward", 73, 400),
    ("decode_loop", 73, 400),
]


def _send_node(endpoint: str, node: str, slices: list[tuple[str, int, int]], trace_id_from=None) -> int:
    provider = TracerProvider(resource=Resource.create({"service.name": f"sglang-{node}"}))
    provider.add_span_processor(SimpleSpanProcessor(HttpSpanExporter(endpoint=endpoint)))
    tracer = provider.get_tracer("sglang")
    root = tracer.start_span(f"Req {node}", context=trace_id_from, start_time=T0)
    thread = tracer.start_span("Scheduler [TP 0]", context=trace.set_span_in_context(root), start_time=T0)
    for name, start_ms, end_ms in slices:
        tracer.start_span(name, context=trace.set_span_in_context(thread), start_time=T0 + start_ms * MS).end(
            end_time=T0 + end_ms * MS
        )
    thread.end(end_time=T0 + slices[-1][2] * MS)
    root.end(end_time=T0 + slices[-1][2] * MS)
    provider.shutdown()
    return root.get_span_context().trace_id


def test_sglang_slices_become_our_stages_beside_them(make_sidecar, tmp_path):
    prefill_side = make_sidecar(grpc_port=None, pool="prefill", worker="sgl-p0", traces_file=str(tmp_path / "p.jsonl"))
    decode_side = make_sidecar(grpc_port=None, pool="decode", worker="sgl-d0", traces_file=str(tmp_path / "d.jsonl"))
    trace_id = _send_node(f"http://127.0.0.1:{prefill_side.http_port}/v1/traces", "prefill", PREFILL_SLICES)
    bootstrap_room = trace.set_span_in_context(
        trace.NonRecordingSpan(
            trace.SpanContext(trace_id, 0x42, is_remote=True, trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED))
        )
    )
    _send_node(f"http://127.0.0.1:{decode_side.http_port}/v1/traces", "decode", DECODE_SLICES, bootstrap_room)

    prefill = spans_when(tmp_path / "p.jsonl", 2 + len(PREFILL_SLICES) + 3)
    decode = spans_when(tmp_path / "d.jsonl", 2 + len(DECODE_SLICES) + 3)
    ours = {(x.name, x.attributes[s.ATTR_POOL]): x for x in prefill + decode if x.name.startswith("splitscope.")}
    expected = {
        (s.SPAN_QUEUE, "prefill"): (9, 12),
        (s.SPAN_PREFILL, "prefill"): (12, 52),
        (s.SPAN_KV_SEND, "prefill"): (52, 70),
        (s.SPAN_KV_TRANSFER, "decode"): (52, 71),
        (s.SPAN_QUEUE, "decode"): (71, 73),
        (s.SPAN_DECODE, "decode"): (73, 400),
    }
    assert {key: ((x.start_ns - T0) // MS, (x.end_ns - T0) // MS) for key, x in ours.items()} == expected
    # decode_forward and decode_loop (trace level 3) are one decode: made once.
    assert sum(x.name == s.SPAN_DECODE for x in decode) == 1
    assert {x.trace_id for x in ours.values()} == {f"{trace_id:032x}"}  # one trace across both nodes
    threads = {x.span_id for x in prefill + decode if x.name == "Scheduler [TP 0]"}
    assert all(x.parent_span_id in threads for x in ours.values())  # beside the slice, under its thread
    assert ours[(s.SPAN_PREFILL, "prefill")].attributes[s.ATTR_WORKER] == "sgl-p0"
    # Metered from the spans (no SGLang scrape on these sidecars).
    assert (
        prefill_side.registry.get_sample_value(
            "splitscope_stage_duration_seconds_count", {"stage": "decode", "pool": "prefill"}
        )
        == 0
    )
    assert prefill_side.registry.get_sample_value(
        "splitscope_stage_duration_seconds_sum", {"stage": "prefill", "pool": "prefill"}
    ) == pytest.approx(0.040)
    assert decode_side.registry.get_sample_value(
        "splitscope_stage_duration_seconds_sum", {"stage": "kv_transfer", "pool": "decode"}
    ) == pytest.approx(0.019)


def test_sglang_pd_metrics_map_transfer_bytes_and_queues(make_sidecar, engine_server):  # noqa: F811
    prefill = make_sidecar(
        grpc_port=None,
        pool="prefill",
        worker="sgl-p0",
        scrape=[("sglang", engine_server(FIXTURES / "sglang-pd-prefill-metrics.txt"))],
    )
    f = _families(http_get(f"http://127.0.0.1:{prefill.http_port}/metrics")[1].decode())
    # 30.5 MiB over four transfers, counted in bytes from the per-transfer histogram's sum.
    assert (
        _value(
            f,
            "splitscope_kv_transfer_bytes",
            "splitscope_kv_transfer_bytes_total",
            src_pool="prefill",
            dst_pool="decode",
        )
        == 30.5 * 2**20
    )
    # Waiting on the prefill node: the wait queue (3) and the bootstrap (prealloc) queue (2), not the 4 in flight.
    assert _value(f, "splitscope_requests_waiting", "splitscope_requests_waiting", worker="sgl-p0") == 5


def test_sglang_decode_node_waiting_counts_prealloc_and_transfer_queues(engine_server):  # noqa: F811
    text = (FIXTURES / "sglang-pd-decode-metrics.txt").read_text()
    f = {m.name: m for m in map_families(text, "sglang", pool="decode", worker="sgl-d0", mode="disaggregated")}
    assert _value(f, "splitscope_requests_waiting", "splitscope_requests_waiting", worker="sgl-d0") == 1 + 5 + 6


ROUTER_ESTIMATE = """\
# HAND-MADE from Dynamo's metric reference (docs: dynamo_component_router_kv_transfer_estimated_latency_seconds,
# histogram, seconds, hierarchy labels + router_id); values invented.
# TYPE dynamo_component_router_kv_transfer_estimated_latency_seconds histogram
dynamo_component_router_kv_transfer_estimated_latency_seconds_bucket{dynamo_namespace="dynamo",router_id="r0",le="0.01"} 3
dynamo_component_router_kv_transfer_estimated_latency_seconds_bucket{dynamo_namespace="dynamo",router_id="r0",le="0.1"} 5
dynamo_component_router_kv_transfer_estimated_latency_seconds_bucket{dynamo_namespace="dynamo",router_id="r0",le="+Inf"} 5
dynamo_component_router_kv_transfer_estimated_latency_seconds_count{dynamo_namespace="dynamo",router_id="r0"} 5
dynamo_component_router_kv_transfer_estimated_latency_seconds_sum{dynamo_namespace="dynamo",router_id="r0"} 0.125
"""


def test_dynamo_router_transfer_estimate_is_the_kv_transfer_stage():
    text = (FIXTURES / "dynamo-frontend-metrics.txt").read_text() + ROUTER_ESTIMATE
    f = {m.name: m for m in map_families(text, "dynamo", pool="decode", worker="frontend", mode="disaggregated")}
    stage = "splitscope_stage_duration_seconds"
    assert _value(f, stage, stage + "_count", stage="kv_transfer", pool="decode") == 5
    assert _value(f, stage, stage + "_sum", stage="kv_transfer", pool="decode") == pytest.approx(0.125)
    assert _value(f, stage, stage + "_bucket", stage="kv_transfer", pool="decode", le="0.01") == 3
    # The frontend's TTFT family is still mapped beside it.
    assert f["gen_ai_server_time_to_first_token_seconds"].samples


def test_both_nodes_through_one_sidecar_keep_each_nodes_stages(make_sidecar, tmp_path):
    sidecar = make_sidecar(grpc_port=None, pool="decode")  # its pool labels every stage it makes
    endpoint = f"http://127.0.0.1:{sidecar.http_port}/v1/traces"
    trace_id = _send_node(endpoint, "prefill", PREFILL_SLICES)
    room = trace.set_span_in_context(
        trace.NonRecordingSpan(
            trace.SpanContext(trace_id, 0x42, is_remote=True, trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED))
        )
    )
    _send_node(endpoint, "decode", DECODE_SLICES, room)
    spans = spans_when(tmp_path / "traces.jsonl", 4 + len(PREFILL_SLICES) + len(DECODE_SLICES) + 6)
    queues = sorted((x.start_ns - T0) // MS for x in spans if x.name == s.SPAN_QUEUE)
    assert queues == [9, 71]  # prefill_waiting and decode_waiting: one per node
