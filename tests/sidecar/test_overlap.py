"""The request-level interference classifier (tracer/sidecar/overlap.py) against the independent oracle.

The oracle (tests/oracle) serves requests iteration by iteration and knows, for every request, whether any
iteration of its decode carried another request's prefill tokens, and how long each worker ran
iterations. Its requests go through the real vLLM adapter as stock vLLM's `llm_request` spans; the
classifier sees only those. Metrics are read from a fresh registry's exposition.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from tests.oracle.cases import CASES, traffic
from tests.oracle.engine import Deployment, Run, serve
from tests.oracle.traces import vllm_request_lines
from tracer import spans as s
from tracer.engines.vllm import VllmAdapter
from tracer.metrics import (
    DECODE_SECONDS_COUNTER,
    DECODE_STEPS_COUNTER,
    DECODE_TPOT_HISTOGRAM,
    OVERLAP_LATE_PREFILLS_COUNTER,
    OVERLAP_PREFILL_SECONDS_COUNTER,
    OVERLAP_PREFILL_STEPS_COUNTER,
    OVERLAP_UNCLASSIFIED_COUNTER,
    WORKER_BUSY_COUNTER,
    WORKER_PREFILL_BUSY_COUNTER,
    Catalogue,
)
from tracer.sidecar.otlp_decode import decode_json
from tracer.sidecar.overlap import OverlapClassifier
from tracer.vocabulary import Pool

HOLD_S = 30.0


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


@dataclass
class Truth:
    """What the oracle's own iterations say about the requests with two or more output tokens."""

    overlapped: int = 0  # requests with an iteration carrying another request's prefill in their decode
    clean: int = 0
    steps_true: int = 0  # decode iterations of the overlapped requests
    steps_false: int = 0
    prefill_steps: int = 0  # of those, iterations carrying prefill tokens...
    prefill_s: float = 0.0  # ...and their time
    decode_s_true: float = 0.0  # the overlapped requests' decode time
    busy_s: dict[int, tuple[float, float]] = field(default_factory=dict)  # worker -> (busy, prefill busy)


def _truth(run: Run) -> Truth:
    by_worker: dict[int, list] = {}
    for it in run.iterations or []:
        by_worker.setdefault(it.worker, []).append(it)
    truth = Truth()
    for r in run.requests:
        if r.output_tokens < 2:
            continue
        decode = by_worker[r.decode_worker][r.first_iteration : r.first_iteration + r.output_tokens - 1]
        with_prefill = [it for it in decode if it.prefill_tokens > 0]
        if with_prefill:
            truth.overlapped += 1
            truth.steps_true += len(decode)
            truth.prefill_steps += len(with_prefill)
            truth.prefill_s += sum(it.end_s - it.start_s for it in with_prefill)
            truth.decode_s_true += decode[-1].end_s - decode[0].start_s
        else:
            truth.clean += 1
            truth.steps_false += len(decode)
    for w, its in by_worker.items():
        truth.busy_s[w] = (
            sum(it.end_s - it.start_s for it in its),
            sum(it.end_s - it.start_s for it in its if it.prefill_tokens),
        )
    return truth


def _classify(run: Run, clock: FakeClock, registry: CollectorRegistry) -> OverlapClassifier:
    classifier = OverlapClassifier(Catalogue(registry, worker_gauges=False), hold_s=HOLD_S, clock_s=clock)
    stages = []
    for worker in range(run.deployment.workers):
        adapter = VllmAdapter(pool=Pool.COLOCATED, worker=f"vllm-{worker}")
        for line in vllm_request_lines(run, worker):
            for batch in decode_json(line.encode()):
                stages.extend(st for span in batch.spans for st in adapter.stage_spans(span))
    # As an engine sends them: a request's stages together, when the request finishes.
    request_end = {}
    for stage in stages:
        request_end[stage.trace_id] = max(request_end.get(stage.trace_id, 0), stage.end_ns)
    stages.sort(key=lambda st: request_end[st.trace_id])
    for i, stage in enumerate(stages):
        classifier.add(stage)
        if i % 50 == 0:
            classifier.advance()
    classifier.advance()  # as the export thread does after every drain
    clock.now_s += 2 * HOLD_S  # the engine goes quiet: every held decode's hold passes
    classifier.advance()
    return classifier


@pytest.mark.parametrize(
    "case_name, free_prefill",
    [("bursty", False), ("medium-max-gap", False), ("short-chats", False), ("medium-max-gap", True)],
)
def test_classification_matches_the_oracles_iterations(case_name: str, free_prefill: bool) -> None:
    """Colocated (whole prompts in one step). `free_prefill`: prefill tokens cost nothing, so requests
    overlap as often but nothing interferes."""
    case = CASES[case_name]
    physics = (
        replace(case.physics, per_prefill_token_s=0.0, per_attention_token2_s=0.0) if free_prefill else case.physics
    )
    sample = traffic(case, 300, seed=3)
    run = serve(Deployment("colocated", workers=2), sample.at(1.5), sample.prompt_tokens, sample.output_tokens, physics)
    truth = _truth(run)
    assert truth.overlapped > 20 and truth.clean > 5, "the workload must have both kinds of request"

    registry = CollectorRegistry()
    _classify(run, FakeClock(), registry)

    def value(name: str, **labels: str) -> float:
        return _value(registry, name, pool="colocated", **labels)

    count = DECODE_TPOT_HISTOGRAM + "_count"
    assert value(count, prefill_overlap="true") == truth.overlapped
    assert value(count, prefill_overlap="false") == truth.clean
    assert value(DECODE_STEPS_COUNTER, prefill_overlap="true") == truth.steps_true
    assert value(DECODE_STEPS_COUNTER, prefill_overlap="false") == truth.steps_false
    assert value(OVERLAP_PREFILL_STEPS_COUNTER) == truth.prefill_steps
    assert value(OVERLAP_PREFILL_SECONDS_COUNTER) == pytest.approx(truth.prefill_s, rel=1e-6)
    assert value(DECODE_SECONDS_COUNTER, prefill_overlap="true") == pytest.approx(truth.decode_s_true, rel=1e-6)
    assert value(OVERLAP_LATE_PREFILLS_COUNTER) == 0
    for worker, (busy_s, prefill_busy_s) in truth.busy_s.items():
        labels = {"pool": "colocated", "worker": f"vllm-{worker}"}
        assert _value(registry, WORKER_BUSY_COUNTER, **labels) == pytest.approx(busy_s, rel=1e-6)
        assert _value(registry, WORKER_PREFILL_BUSY_COUNTER, **labels) == pytest.approx(prefill_busy_s, rel=1e-6)

    # The step ratio read from requests (what the alert compares with 1.5): against the oracle's own
    # iteration times over all its steps, within the weighting (a step counts once per decode it slowed).
    prefill_step_s = truth.prefill_s / truth.prefill_steps
    decode_step_s = (truth.decode_s_true - truth.prefill_s) / (truth.steps_true - truth.prefill_steps)
    its = run.iterations or []
    with_prefill = [it.end_s - it.start_s for it in its if it.prefill_tokens and it.running]
    without = [it.end_s - it.start_s for it in its if not it.prefill_tokens]
    oracle_ratio = (sum(with_prefill) / len(with_prefill)) / (sum(without) / len(without))
    if free_prefill:
        assert prefill_step_s / decode_step_s < 1.1 and oracle_ratio < 1.1
    else:
        assert prefill_step_s / decode_step_s > 1.5 and oracle_ratio > 1.5


def test_prefills_arriving_after_the_hold_are_counted_late_not_guessed() -> None:
    case = CASES["bursty"]
    sample = traffic(case, 200, seed=5)
    run = serve(
        Deployment("colocated", workers=1), sample.at(1.5), sample.prompt_tokens, sample.output_tokens, case.physics
    )
    truth = _truth(run)
    overlapped, clean = truth.overlapped, truth.clean

    # Everything arrives in random order, with the hold passing after every stage: decodes are classified
    # before most of the prefills that overlapped them arrive.
    registry = CollectorRegistry()
    clock = FakeClock()
    classifier = OverlapClassifier(Catalogue(registry, worker_gauges=False), hold_s=1e-3, clock_s=clock)
    adapter = VllmAdapter(pool=Pool.COLOCATED, worker="vllm-0")
    stages = [
        st
        for line in vllm_request_lines(run, 0)
        for b in decode_json(line.encode())
        for span in b.spans
        for st in adapter.stage_spans(span)
    ]
    np.random.default_rng(0).shuffle(stages)
    for stage in stages:
        classifier.add(stage)
        clock.now_s += 1.0
        classifier.advance()

    count = DECODE_TPOT_HISTOGRAM + "_count"
    classified_true = _value(registry, count, pool="colocated", prefill_overlap="true")
    classified_false = _value(registry, count, pool="colocated", prefill_overlap="false")
    assert classified_true + classified_false == overlapped + clean  # every request classified once
    assert classified_true < overlapped  # some overlaps were not known in time...
    late = _value(registry, OVERLAP_LATE_PREFILLS_COUNTER, pool="colocated")
    assert late > 0  # ...and they are counted


def test_a_held_decode_waits_for_its_hold_on_the_timeline_or_the_wall_clock() -> None:
    registry = CollectorRegistry()
    clock = FakeClock()
    classifier = OverlapClassifier(Catalogue(registry, worker_gauges=False), hold_s=10.0, clock_s=clock)
    common = {s.ATTR_POOL: Pool.COLOCATED, s.ATTR_WORKER: "w"}

    def stage(name: str, start_s: float, end_s: float, **attrs: int) -> s.SpanData:
        return s.SpanData(
            name=name,
            kind=s.KIND_INTERNAL,
            trace_id=1,
            span_id=s.new_span_id(),
            parent_span_id=0,
            start_ns=int(start_s * 1e9),
            end_ns=int(end_s * 1e9),
            attributes={**common, **attrs},
        )

    classifier.add(stage(s.SPAN_DECODE, 100.0, 101.0, **{s.ATTR_OUTPUT_TOKENS: 11}))
    assert classifier.advance() == 0
    # Another request's prefill inside that decode arrives 5 s later (its own request finished then).
    classifier.add(
        stage(s.SPAN_PREFILL, 100.5, 100.6, **{s.ATTR_PREFILL_TOKENS: 1000, s.ATTR_PREFILL_CACHED_TOKENS: 200})
    )
    classifier.add(stage(s.SPAN_DECODE, 100.6, 105.0, **{s.ATTR_OUTPUT_TOKENS: 2}))
    assert classifier.advance() == 0
    clock.now_s += 5.9  # timeline 105 s + 5.9 s idle < 101 s + 10 s hold
    assert classifier.advance() == 0
    clock.now_s += 0.2
    assert classifier.advance() == 1
    assert _value(registry, DECODE_TPOT_HISTOGRAM + "_sum", pool="colocated", prefill_overlap="true") == pytest.approx(
        0.1
    )
    assert _value(registry, OVERLAP_PREFILL_STEPS_COUNTER, pool="colocated") == 1
    assert _value(registry, "splitscope_decode_overlap_prefill_tokens_total", pool="colocated") == pytest.approx(800)
    clock.now_s += 10
    assert classifier.advance() == 1  # the second decode: no prefill overlapped it
    assert _value(registry, DECODE_TPOT_HISTOGRAM + "_count", pool="colocated", prefill_overlap="false") == 1
    assert _value(registry, WORKER_BUSY_COUNTER, pool="colocated", worker="w") == pytest.approx(5.0)


def test_a_decode_longer_than_the_hold_still_meets_the_prefills_inside_it() -> None:
    """A long answer reaches the sidecar when it ends: the prefills that ran early in it arrived, and the
    hold's horizon passed them, long before. They are kept (retain_s) and it is classified overlapped."""
    registry = CollectorRegistry()
    clock = FakeClock()
    classifier = OverlapClassifier(Catalogue(registry, worker_gauges=False), hold_s=5.0, retain_s=60.0, clock_s=clock)
    common = {s.ATTR_POOL: Pool.COLOCATED, s.ATTR_WORKER: "w"}

    def stage(name: str, start_s: float, end_s: float, **attrs: int) -> s.SpanData:
        return s.SpanData(
            name=name,
            kind=s.KIND_INTERNAL,
            trace_id=int(start_s * 1000),
            span_id=s.new_span_id(),
            parent_span_id=0,
            start_ns=int(start_s * 1e9),
            end_ns=int(end_s * 1e9),
            attributes={**common, **attrs},
        )

    classifier.add(stage(s.SPAN_PREFILL, 100.5, 100.6, **{s.ATTR_PREFILL_TOKENS: 1800}))  # inside the long decode
    classifier.add(stage(s.SPAN_DECODE, 100.6, 101.0, **{s.ATTR_OUTPUT_TOKENS: 16}))  # the long prompt's own
    for t in range(102, 120):  # short requests keep coming and are classified as the horizon moves on
        classifier.add(stage(s.SPAN_PREFILL, t, t + 0.01, **{s.ATTR_PREFILL_TOKENS: 10}))
        classifier.add(stage(s.SPAN_DECODE, t + 0.01, t + 0.2, **{s.ATTR_OUTPUT_TOKENS: 8}))
        classifier.advance()
    long_decode = stage(s.SPAN_DECODE, 100.0, 120.0, **{s.ATTR_OUTPUT_TOKENS: 4000})
    assert classifier.add(long_decode, resource=("r",))
    classifier.advance()  # the timeline stands at the long decode's end...
    clock.now_s += 30.0  # ...and the engine goes quiet for longer than the hold
    classifier.advance()
    ((_, linked),) = [(r, span) for r, span in classifier.released() if span is long_decode]
    assert int(100.5 * 1000) in {trace_id for trace_id, _, _ in linked.links}
    assert linked.attributes[s.ATTR_DECODE_STALLED_NS] >= int(0.1e9) - 1


def test_the_hold_is_bounded_and_overflow_is_counted() -> None:
    registry = CollectorRegistry()
    classifier = OverlapClassifier(
        Catalogue(registry, worker_gauges=False), hold_s=100.0, max_held=3, clock_s=FakeClock()
    )
    for i in range(5):
        classifier.add(
            s.SpanData(
                name=s.SPAN_DECODE,
                kind=s.KIND_INTERNAL,
                trace_id=i + 1,
                span_id=s.new_span_id(),
                parent_span_id=0,
                start_ns=i * 10**9,
                end_ns=(i + 1) * 10**9,
                attributes={s.ATTR_POOL: Pool.COLOCATED, s.ATTR_WORKER: "w", s.ATTR_OUTPUT_TOKENS: 5},
            )
        )
    assert _value(registry, OVERLAP_UNCLASSIFIED_COUNTER, pool="colocated") == 2


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError):
        OverlapClassifier(Catalogue(CollectorRegistry()), hold_s=0)


def test_a_chunked_prefill_engine_gets_the_tpot_split_but_no_step_estimate() -> None:
    """Under chunked prefill one prompt's window spans several steps, so its steps cannot be counted."""
    case = CASES["medium-max-gap"]
    sample = traffic(case, 200, seed=3)
    run = serve(
        Deployment("chunked", workers=1, budget_tokens=256),
        sample.at(1.5),
        sample.prompt_tokens,
        sample.output_tokens,
        case.physics,
    )
    registry = CollectorRegistry()
    clock = FakeClock()
    classifier = OverlapClassifier(
        Catalogue(registry, worker_gauges=False), hold_s=HOLD_S, clock_s=clock, prefill_in_one_step=False
    )
    adapter = VllmAdapter(pool=Pool.COLOCATED, worker="vllm-0")
    for line in vllm_request_lines(run, 0):
        for batch in decode_json(line.encode()):
            for span in batch.spans:
                for stage in adapter.stage_spans(span):
                    classifier.add(stage)
    classifier.advance()
    clock.now_s += 2 * HOLD_S
    classifier.advance()
    truth = _truth(run)
    assert (
        _value(registry, DECODE_TPOT_HISTOGRAM + "_count", pool="colocated", prefill_overlap="true") == truth.overlapped
    )
    assert _value(registry, OVERLAP_PREFILL_STEPS_COUNTER, pool="colocated") == 0
    assert _value(registry, OVERLAP_PREFILL_SECONDS_COUNTER, pool="colocated") == 0
