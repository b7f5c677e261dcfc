"""The engine adapters' interface and registry (tracer/engines): what the sidecar relies on to adapt spans."""

from __future__ import annotations

from tracer import spans as s
from tracer.engines import SPAN_ADAPTERS, Adaptation, span_adapters, vllm
from tracer.engines.metrics import ENGINES
from tracer.engines.sglang import SLICE_STAGES

T0 = 1_700_000_000_000_000_000


def _span(name: str, attributes: dict, trace_id: int = 0xABC, parent: int = 0x1) -> s.SpanData:
    return s.SpanData(
        name=name,
        kind=s.KIND_SERVER,
        trace_id=trace_id,
        span_id=0x2,
        parent_span_id=parent,
        start_ns=T0,
        end_ns=T0 + 2_000_000_000,
        attributes=attributes,
    )


def test_each_adapter_is_named_as_its_scrape_is():
    # The sidecar meters an engine's spans unless `--scrape ENGINE=URL` names it: the names must agree,
    # or the same requests would be counted from both.
    adapters = span_adapters(pool="colocated", worker="w", mode="colocated", model="m")
    assert [adapter.engine for adapter in adapters] == list(SPAN_ADAPTERS)
    assert set(SPAN_ADAPTERS) <= set(ENGINES)


def test_our_own_spans_are_no_engine_s():
    ours = _span(s.SPAN_DECODE, {s.ATTR_POOL: "colocated", s.ATTR_WORKER: "w"})
    for adapter in span_adapters(pool="colocated", worker="w", mode="colocated"):
        assert adapter.adapt(ours, {}) is None


def test_vllm_request_span_gives_stages_and_a_metrics_only_span():
    (adapter, _) = span_adapters(pool="colocated", worker="vllm-0", mode="colocated", model="m")
    request = _span(
        vllm.SPAN_NAME,
        {
            vllm.ATTR_TIME_IN_QUEUE: 0.01,
            vllm.ATTR_TTFT: 0.3,
            vllm.ATTR_PREFILL: 0.2,
            vllm.ATTR_DECODE: 1.5,
            vllm.ATTR_E2E: 1.9,
            vllm.ATTR_COMPLETION_TOKENS: 20,
        },
    )
    adaptation = adapter.adapt(request, {})
    assert isinstance(adaptation, Adaptation)
    assert [stage.name for stage in adaptation.stages] == [s.SPAN_QUEUE, s.SPAN_PREFILL, s.SPAN_DECODE]
    assert all(stage.parent_span_id == request.span_id for stage in adaptation.stages)
    (metrics_only,) = adaptation.metrics_only
    assert not metrics_only.sampled and metrics_only.attributes[s.ATTR_MODEL] == "m"


def test_sglang_slice_gives_one_stage_per_thread():
    (_, adapter) = span_adapters(pool="prefill", worker="sglang-p", mode="disaggregated")
    first = adapter.adapt(_span("prefill_forward", {}), {})
    again = adapter.adapt(_span("prefill_forward", {}), {})  # the same thread's second slice of that stage
    assert first is not None and [stage.name for stage in first.stages] == [SLICE_STAGES["prefill_forward"]]
    assert first.stages[0].attributes[s.ATTR_POOL] == "prefill" and not first.metrics_only
    assert again is not None and again.stages == []  # still SGLang's span (exported), no second stage
