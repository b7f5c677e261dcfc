"""The sidecar's local tail sampler: violators kept whole, a share of the rest by trace id, drops counted."""

from __future__ import annotations

import random

import pytest

from tests.conftest import wait_for
from tests.sidecar.conftest import read_spans
from tracer import spans as s
from tracer.metrics import TAIL_SAMPLER_SPANS
from tracer.sidecar.client import SidecarSink
from tracer.sidecar.tail_sampler import (
    DECIDED_AT_TIMEOUT,
    DECIDED_BUFFER_FULL,
    TailSampler,
)

RATE = 0.1
T0_NS = 1_700_000_000_000_000_000
CHILDREN = (s.SPAN_QUEUE, s.SPAN_PREFILL, s.SPAN_DECODE)


def _request(trace_id: int, violated: bool, error: bool = False) -> tuple[s.SpanData, list[s.SpanData]]:
    """A root span and its worker's stage spans (times are irrelevant to the sampler, but a trace file
    needs them non-zero)."""
    root_id = random.getrandbits(63) + 1
    root = s.SpanData(
        f"{s.ROOT_SPAN_PREFIX} tiny",
        s.KIND_SERVER,
        trace_id,
        root_id,
        0,
        T0_NS,
        T0_NS + 10,
        {s.ATTR_SLO_VIOLATED: violated},
    )
    children = [
        s.SpanData(
            name,
            s.KIND_INTERNAL,
            trace_id,
            random.getrandbits(63) + 1,
            root_id,
            T0_NS + 1,
            T0_NS + 9,
            {s.ATTR_POOL: "colocated", s.ATTR_WORKER: "w0"},
            error_type="boom" if error and name == s.SPAN_DECODE else "",
        )
        for name in CHILDREN
    ]
    return root, children


def _spans(released) -> list[s.SpanData]:
    return [span for _, spans in released for span in spans]


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def test_a_violating_trace_is_kept_whole_and_late_spans_follow_the_decision():
    clock = FakeClock()
    sampler = TailSampler(0.0, keep_violations=True, root_grace_s=2.0, clock=clock)
    root, children = _request(5, violated=True)
    assert _spans(sampler.offer("w", children[:2])) == []  # waiting for the root
    assert _spans(sampler.offer("r", [root])) == [*children[:2], root]  # a keep: at once
    assert _spans(sampler.offer("w", children[2:])) == children[2:]  # decided: kept
    quiet_root, quiet_children = _request(6, violated=False)
    assert _spans(sampler.offer("r", [quiet_root])) == [] and _spans(sampler.offer("w", quiet_children)) == []
    clock.now_s = 1.9
    assert _spans(sampler.expire()) == [] and sampler.dropped_spans == 0  # a drop waits for stragglers
    clock.now_s = 2.0
    assert _spans(sampler.expire()) == []
    assert (sampler.kept_spans, sampler.dropped_spans) == (4, 4)
    assert _spans(sampler.offer("w", quiet_children[:1])) == [] and sampler.dropped_spans == 5  # decided: dropped


def test_a_failed_span_after_the_root_within_the_grace_keeps_the_trace():
    clock = FakeClock()
    sampler = TailSampler(0.0, keep_violations=True, root_grace_s=2.0, clock=clock)
    root, children = _request(11, violated=False, error=True)
    assert _spans(sampler.offer("r", [root])) == []
    clock.now_s = 1.0
    assert len(_spans(sampler.offer("w", children))) == 4


def test_an_error_anywhere_in_the_trace_makes_it_a_violator():
    sampler = TailSampler(0.0, keep_violations=True, root_grace_s=0.0)
    root, children = _request(7, violated=False, error=True)
    sampler.offer("w", children)
    assert len(_spans(sampler.offer("r", [root]))) == 4


def test_without_keep_violations_only_the_trace_id_decides():
    sampler = TailSampler(0.0, keep_violations=False)
    root, children = _request(8, violated=True)
    assert _spans(sampler.offer("w", children + [root])) == []


def test_the_share_kept_is_the_rate_by_trace_id_alone():
    sampler = TailSampler(RATE)
    ids = [random.getrandbits(128) for _ in range(20_000)]
    kept = sum(sampler.sampled(trace_id) for trace_id in ids)
    assert abs(kept - RATE * len(ids)) < 5 * (len(ids) * RATE * (1 - RATE)) ** 0.5
    assert [TailSampler(RATE).sampled(t) for t in ids[:100]] == [sampler.sampled(t) for t in ids[:100]]


def test_a_trace_without_its_root_is_decided_at_the_timeout():
    clock, decisions = FakeClock(), []
    sampler = TailSampler(
        1.0, decision_timeout_s=30.0, clock=clock, on_decision=lambda keep, why: decisions.append((keep, why))
    )
    _, children = _request(9, violated=False)
    sampler.offer("w", children)
    clock.now_s = 29.0
    assert _spans(sampler.expire()) == []
    clock.now_s = 30.5
    assert _spans(sampler.expire()) == children and decisions == [(True, DECIDED_AT_TIMEOUT)]


def test_the_buffer_is_bounded_and_decides_its_oldest_trace_when_full():
    decisions = []
    sampler = TailSampler(0.0, max_buffered_spans=30, on_decision=lambda keep, why: decisions.append(why))
    for trace_id in range(100):
        sampler.offer("w", _request(trace_id + 1, violated=False)[1])
        assert sampler.buffered_spans <= 30
    assert decisions.count(DECIDED_BUFFER_FULL) == 90 and sampler.dropped_spans == 270


def test_step_spans_pass_through():
    sampler = TailSampler(0.0)
    step = s.SpanData(s.SPAN_STEP, s.KIND_INTERNAL, 3, 4, 0, 0, 1, {s.ATTR_SAMPLE_WEIGHT: 10})
    assert _spans(sampler.offer("w", [step])) == [step]


@pytest.mark.parametrize("options", [{"sample_rate": 1.5}, {"sample_rate": 0.1, "max_buffered_spans": 0}])
def test_bad_settings_are_refused(options):
    with pytest.raises(ValueError):
        TailSampler(**options)


def test_under_a_flood_a_real_sidecar_keeps_every_violator_whole_and_counts_what_it_dropped(make_sidecar, tmp_path):
    """12,000 spans from a router and a worker through the Unix ingest, roots before or after their
    children; 10% of requests violate their SLO, 5% more fail in decode."""
    socket_path = tmp_path / "sidecar.sock"
    sidecar = make_sidecar(unix_socket=str(socket_path), sample_rate=RATE, keep_violations=True)
    rng = random.Random(20)
    requests = []
    for _ in range(3000):
        kind = rng.random()
        requests.append(_request(rng.getrandbits(128), violated=kind < 0.10, error=0.10 <= kind < 0.15))
    lost = []
    router = SidecarSink(socket_path, on_drop=lost.append, resource={"service.name": "splitscope-router"})
    worker = SidecarSink(socket_path, on_drop=lost.append, resource={"service.name": "splitscope-colocated"})
    try:
        for first in range(0, len(requests), 100):
            chunk = requests[first : first + 100]
            early_roots = [root for i, (root, _) in enumerate(chunk) if i % 2]
            router.emit(early_roots)
            worker.emit([child for _, children in chunk for child in children])
            router.emit([root for i, (root, _) in enumerate(chunk) if not i % 2])
        sent = 4 * len(requests)
        sampler = sidecar.export.tail_sampler
        wait_for(lambda: sampler.kept_spans + sampler.dropped_spans == sent, 60, "a decision for every span")
    finally:
        router.shutdown(2.0)
        worker.shutdown(2.0)
    assert not lost  # the flood reached the sidecar: every drop below is the sampler's
    sidecar.stop(5.0)
    written: dict[int, list[str]] = {}
    for span in read_spans(tmp_path / "traces.jsonl"):
        written.setdefault(int(span.trace_id, 16), []).append(span.name)
    expected = sorted([f"{s.ROOT_SPAN_PREFIX} tiny", *CHILDREN])
    for root, children in requests:
        violator = root.attributes[s.ATTR_SLO_VIOLATED] or any(c.error_type for c in children)
        if violator:
            assert sorted(written.get(root.trace_id, [])) == expected  # whole
        else:
            assert root.trace_id not in written or sorted(written[root.trace_id]) == expected
    quiet = [
        root.trace_id
        for root, children in requests
        if not root.attributes[s.ATTR_SLO_VIOLATED] and not any(c.error_type for c in children)
    ]
    kept_quiet = sum(trace_id in written for trace_id in quiet)
    assert abs(kept_quiet - RATE * len(quiet)) < 5 * (len(quiet) * RATE * (1 - RATE)) ** 0.5
    spans_written = sum(len(names) for names in written.values())
    counted = sidecar.registry.get_sample_value
    assert counted(TAIL_SAMPLER_SPANS + "_total", {"decision": "dropped"}) == sent - spans_written
    assert counted(TAIL_SAMPLER_SPANS + "_total", {"decision": "kept"}) == spans_written
