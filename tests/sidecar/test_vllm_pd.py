"""vLLM's disaggregated shape and its proposed lifecycle spans, from span shapes written from vLLM's source.

P/D (vLLM 0.32, a proxy in front of a prefill and a decode instance, NIXL-style async KV pull): the proxy
sends the request to the prefill instance with max_tokens=1, then to the decode instance; each instance
emits its own `llm_request` under the proxy's trace. On the decode instance the scheduler keeps a request
in WAITING_FOR_REMOTE_KVS until its KV cache has arrived and stamps SCHEDULED only then
(vllm/v1/core/sched/scheduler.py), so that instance's `time_in_queue` holds the transfer.
Lifecycle spans (`vllm_queue`, `vllm_async_kv_transfer`, `vllm_prefill`, `vllm_decode`): names from the
open upstream PR; children of `llm_request`, timed by vLLM itself. These shapes are hand-made.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import SpanKind

from tests.conftest import wait_for
from tests.sidecar.conftest import read_spans, spans_when
from tracer import spans as s
from tracer.engines import vllm

MS = 1_000_000
T0 = 1_700_000_000_000_000_000
TRACE = 0xABC


def _llm_request(span_id: int, start_ns: int, **attributes: float) -> s.SpanData:
    names = {
        "queue": vllm.ATTR_TIME_IN_QUEUE,
        "prefill": vllm.ATTR_PREFILL,
        "decode": vllm.ATTR_DECODE,
        "ttft": vllm.ATTR_TTFT,
        "e2e": vllm.ATTR_E2E,
        "prompt": vllm.ATTR_PROMPT_TOKENS,
        "completion": vllm.ATTR_COMPLETION_TOKENS,
        "max_tokens": vllm.ATTR_MAX_TOKENS,
    }
    attrs = {names[k]: v for k, v in attributes.items()}
    return s.SpanData(
        vllm.SPAN_NAME,
        s.KIND_SERVER,
        TRACE,
        span_id,
        0x1,
        start_ns,
        start_ns + round(attrs[vllm.ATTR_E2E] * 1e9),
        attrs,
    )


def _pd_pair() -> tuple[s.SpanData, list[s.SpanData], s.SpanData, list[s.SpanData]]:
    """One request served P/D: the prefill instance's `llm_request` and the stage spans its sidecar makes of it,
    then the decode instance's and its stages (both sidecars run with --mode disaggregated)."""
    # Prefill instance: arrives at T0, 3 ms front end, 2 ms queue, 40 ms prefill, one token, nothing decoded.
    p = _llm_request(
        0x10, T0, queue=0.002, prefill=0.040, decode=0.0, ttft=0.045, e2e=0.046, prompt=2000, completion=1, max_tokens=1
    )
    # Decode instance: the proxy forwards at T0 + 50 ms; 1 ms front end, 30 ms waiting for the KV (queue),
    # 5 ms first forward, then 0.5 s decoding 64 tokens.
    d = _llm_request(
        0x20,
        T0 + 50 * MS,
        queue=0.030,
        prefill=0.005,
        decode=0.500,
        ttft=0.036,
        e2e=0.537,
        prompt=2000,
        completion=64,
        max_tokens=64,
    )
    prefill_side = vllm.VllmAdapter(pool="prefill", worker="vllm-p0", mode="disaggregated").stage_spans(p)
    decode_side = vllm.VllmAdapter(pool="decode", worker="vllm-d0", mode="disaggregated").stage_spans(d)
    return p, prefill_side, d, decode_side


def test_pd_pair_gives_one_trace_with_prefill_side_and_decode_side_stages():
    _, prefill_side, _, decode_side = _pd_pair()

    assert [x.name for x in prefill_side] == [s.SPAN_QUEUE, s.SPAN_PREFILL]  # no decode for the one token
    assert [x.name for x in decode_side] == [s.SPAN_KV_TRANSFER, s.SPAN_DECODE]
    queue, prefill = prefill_side
    transfer, decode = decode_side
    assert {x.trace_id for x in prefill_side + decode_side} == {TRACE}
    assert (queue.start_ns, queue.end_ns, prefill.end_ns) == (T0 + 3 * MS, T0 + 5 * MS, T0 + 45 * MS)
    assert queue.attributes[s.ATTR_FRONTEND_S] == 0.003
    # The transfer: from the decode instance's queueing to the start of its first forward pass.
    assert (transfer.start_ns, transfer.end_ns) == (T0 + 51 * MS, T0 + 81 * MS)
    assert transfer.attributes[s.ATTR_FRONTEND_S] == 0.001
    assert (decode.start_ns, decode.end_ns) == (T0 + 81 * MS, T0 + 587 * MS)
    assert [x.attributes[s.ATTR_POOL] for x in prefill_side + decode_side] == ["prefill", "prefill", "decode", "decode"]
    assert prefill.end_ns <= transfer.start_ns  # stage order on one timeline
    assert decode.attributes[s.ATTR_OUTPUT_TOKENS] == 64 and prefill.attributes[s.ATTR_PREFILL_TOKENS] == 2000


def _send_with_lifecycle(endpoint: str, lifecycle_first: bool) -> int:
    provider = TracerProvider(resource=Resource.create({"service.name": "vllm"}))
    provider.add_span_processor(SimpleSpanProcessor(GrpcSpanExporter(endpoint=endpoint, insecure=True)))
    tracer = provider.get_tracer("vllm.llm_engine")
    request = tracer.start_span(
        "llm_request",
        kind=SpanKind.SERVER,
        start_time=T0,
        attributes={
            vllm.ATTR_TIME_IN_QUEUE: 0.002,
            vllm.ATTR_PREFILL: 0.040,
            vllm.ATTR_DECODE: 0.200,
            vllm.ATTR_TTFT: 0.045,
            vllm.ATTR_E2E: 0.246,
            vllm.ATTR_PROMPT_TOKENS: 100,
            vllm.ATTR_COMPLETION_TOKENS: 20,
        },
    )
    context = trace.set_span_in_context(request)
    children = []
    for name, start_ms, end_ms in (("vllm_queue", 3, 5), ("vllm_prefill", 5, 45), ("vllm_decode", 46, 246)):
        child = tracer.start_span(name, context=context, start_time=T0 + start_ms * MS)
        children.append((child, T0 + end_ms * MS))
    if not lifecycle_first:
        request.end(end_time=T0 + 246 * MS)
    for child, end_ns in children:
        child.end(end_time=end_ns)
    if lifecycle_first:
        request.end(end_time=T0 + 246 * MS)
    provider.shutdown()
    return request.context.trace_id


def test_lifecycle_spans_map_one_to_one_and_replace_derived_stages(make_sidecar, tmp_path):
    sidecar = make_sidecar(http_port=None, worker="vllm-0")
    trace_id = _send_with_lifecycle(f"127.0.0.1:{sidecar.grpc_port}", lifecycle_first=True)
    spans = spans_when(tmp_path / "traces.jsonl", 7)  # llm_request, 3 lifecycle spans, 3 of ours
    ours = {x.name: x for x in spans if x.name.startswith("splitscope.")}
    assert sorted(ours) == sorted([s.SPAN_QUEUE, s.SPAN_PREFILL, s.SPAN_DECODE])
    lifecycle = {x.name: x for x in spans if x.name.startswith("vllm_")}
    for theirs, mine in (
        ("vllm_queue", s.SPAN_QUEUE),
        ("vllm_prefill", s.SPAN_PREFILL),
        ("vllm_decode", s.SPAN_DECODE),
    ):
        assert (ours[mine].start_ns, ours[mine].end_ns) == (lifecycle[theirs].start_ns, lifecycle[theirs].end_ns)
        assert ours[mine].parent_span_id == lifecycle[theirs].parent_span_id  # beside it, under llm_request
        assert ours[mine].trace_id == f"{trace_id:032x}" and ours[mine].attributes[s.ATTR_WORKER] == "vllm-0"
    assert (
        sidecar.registry.get_sample_value(
            "splitscope_stage_duration_seconds_count", {"stage": "prefill", "pool": "colocated"}
        )
        == 1
    )


def test_lifecycle_spans_after_derived_stages_are_not_doubled(make_sidecar, tmp_path):
    sidecar = make_sidecar(http_port=None)
    _send_with_lifecycle(f"127.0.0.1:{sidecar.grpc_port}", lifecycle_first=False)
    # A lifecycle span and any stage made from it are written in one line: once all three are in, so is any
    # double. The derived decode leaves after its overlap hold (it waits for its stall links).
    spans = wait_for(
        lambda: (
            (found := read_spans(tmp_path / "traces.jsonl"))
            and sum(x.name.startswith("vllm_") for x in found) == 3
            and any(x.name == s.SPAN_DECODE for x in found)
            and found
        ),
        10,
        "the lifecycle spans",
    )
    assert len(spans) == 7  # llm_request, its 3 derived stages, 3 lifecycle spans
    assert sorted(x.name for x in spans if x.name.startswith("splitscope.")) == sorted(
        [s.SPAN_QUEUE, s.SPAN_PREFILL, s.SPAN_DECODE]
    )
    assert (
        sidecar.registry.get_sample_value(
            "splitscope_stage_duration_seconds_count", {"stage": "prefill", "pool": "colocated"}
        )
        == 1
    )


def test_the_report_reads_a_pd_pair_as_one_request_the_client_saw(tmp_path):
    from tracer.export.otel import encode_line, make_resource, to_readable_span
    from tracer.report.tables import load_traces

    p, prefill_side, d, decode_side = _pd_pair()
    spans = [p, *prefill_side, d, *decode_side]
    path = tmp_path / "pd.jsonl"
    resource = make_resource("vllm")
    path.write_bytes(encode_line([to_readable_span(x, resource) for x in spans]))

    data = load_traces([path])  # the derived transfer has no size: it loads, and counts in TTFT
    table = data.requests
    assert len(table.arrival_ns) == 1
    assert table.arrival_ns[0] == T0 and table.end_ns[0] == T0 + 587 * MS  # the client's whole request
    assert table.output_tokens[0] == 64  # the decode half's tokens, not the prefill half's one
    assert table.ttft_s[0] == 0.086  # reached the decode instance 50 ms in, its first token 36 ms later
    assert list(table.mode) == ["disaggregated"]
    assert len(data.transfers.kv_bytes) == 0
