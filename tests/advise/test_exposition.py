"""tracer.advise.exposition: the advisor's series, read back from a fresh registry's text exposition
(values, one info series per namespace through changes, confidence absent while skipped), and the closed
set of decision reasons (hold.window_reason)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tracer.advise import hold as hysteresis
from tracer.advise.build import Advice, WindowAdvice
from tracer.advise.deployed import Shape, advised_shape, differs
from tracer.advise.exposition import AdviceExporter
from tracer.metrics import AdviceMetrics
from tracer.vocabulary import AdviceReason, Mode

COLOCATED = Shape(Mode.COLOCATED)


def _window(verdict: str, ratio=None, budget=None, gain=None, confidence=None, requests=40):  # type: ignore[no-untyped-def]
    return WindowAdvice(0, 10, requests, verdict, ratio, budget, gain, confidence, "decided", 0)


def _advice(verdict: str, ratio=None, budget=None) -> Advice:  # type: ignore[no-untyped-def]
    return Advice(verdict, ratio, budget, 0, "decided")


def _samples(registry: CollectorRegistry) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            if not sample.name.endswith("_created"):
                out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def test_the_info_series_follows_the_held_advice_one_at_a_time() -> None:
    registry = CollectorRegistry()
    exporter = AdviceExporter(AdviceMetrics(registry))
    exporter.publish(
        "prod", _window("stay-colocated", gain=0.2), _advice("stay-colocated"), COLOCATED, AdviceReason.FIRST
    )
    series = _samples(registry)
    assert series["splitscope_advice_info"] == [
        ({"namespace": "prod", "verdict": "stay-colocated", "target": "", "deployed": "colocated"}, 1.0)
    ]
    assert series["splitscope_advice_differs"] == [({"namespace": "prod"}, 0.0)]
    assert series["splitscope_advice_gain_ratio"] == [({"namespace": "prod"}, 0.2)]
    assert series["splitscope_advice_window_requests"] == [({"namespace": "prod"}, 40.0)]
    assert "splitscope_advice_confidence_ratio" not in series  # bootstrap skipped: no value, not a 0
    decisions = {labels["reason"]: value for labels, value in series["splitscope_advice_decisions_total"]}
    assert decisions == {reason.value: (1.0 if reason is AdviceReason.FIRST else 0.0) for reason in AdviceReason}

    # A window that disagrees but does not win: the held advice (and its series) stays.
    exporter.publish("prod", _window("split", "1:3", gain=0.4), _advice("stay-colocated"), COLOCATED, AdviceReason.HELD)
    assert [labels["verdict"] for labels, _ in _samples(registry)["splitscope_advice_info"]] == ["stay-colocated"]

    # The split takes over: the old labels are gone, the new series is the only one, and it differs.
    exporter.publish(
        "prod", _window("split", "1:3", gain=0.5, confidence=0.9, requests=7), _advice("split", "1:3"),
        COLOCATED, AdviceReason.CHANGED,
    )  # fmt: skip
    series = _samples(registry)
    assert series["splitscope_advice_info"] == [
        ({"namespace": "prod", "verdict": "split", "target": "1:3", "deployed": "colocated"}, 1.0)
    ]
    assert series["splitscope_advice_differs"] == [({"namespace": "prod"}, 1.0)]
    assert series["splitscope_advice_gain_ratio"] == [({"namespace": "prod"}, 0.5)]
    assert series["splitscope_advice_confidence_ratio"] == [({"namespace": "prod"}, 0.9)]
    assert series["splitscope_advice_window_requests"] == [({"namespace": "prod"}, 7.0)]
    decisions = {labels["reason"]: value for labels, value in series["splitscope_advice_decisions_total"]}
    assert (decisions["first"], decisions["held"], decisions["changed"], decisions["agreed"]) == (1, 1, 1, 0)

    # A window without a decision keeps the last gain and confidence; the next decided one without a
    # bootstrap removes the confidence (it would be stale).
    exporter.publish(
        "prod", _window("insufficient-data"), _advice("split", "1:3"), None, AdviceReason.INSUFFICIENT_DATA
    )
    series = _samples(registry)
    assert series["splitscope_advice_gain_ratio"] == [({"namespace": "prod"}, 0.5)]
    assert series["splitscope_advice_confidence_ratio"] == [({"namespace": "prod"}, 0.9)]
    assert series["splitscope_advice_info"][0][0]["deployed"] == ""  # unknown: no worker spans in the window
    assert series["splitscope_advice_differs"] == [({"namespace": "prod"}, 0.0)]  # unknown never differs
    exporter.publish("prod", _window("split", "1:3", gain=0.3), _advice("split", "1:3"), COLOCATED, AdviceReason.AGREED)
    assert "splitscope_advice_confidence_ratio" not in _samples(registry)


@pytest.mark.parametrize(
    "verdict, ratio, budget, deployed, expected",
    [
        ("stay-colocated", None, None, Shape(Mode.COLOCATED), False),
        ("enable-chunked-prefill", None, 512, Shape(Mode.COLOCATED), True),
        ("enable-chunked-prefill", None, 256, Shape(Mode.CHUNKED), False),  # the budget is not compared
        ("split", "1:3", None, Shape(Mode.DISAGGREGATED, "1:3"), False),
        ("split", "1:3", None, Shape(Mode.COLOCATED), True),
        ("rebalance", "2:2", None, Shape(Mode.DISAGGREGATED, "1:3"), True),
        ("rebalance", "1:3", None, Shape(Mode.DISAGGREGATED, "1:3"), False),  # rebalanced already
        ("merge", None, None, Shape(Mode.DISAGGREGATED, "1:3"), True),
        ("insufficient-data", None, None, Shape(Mode.COLOCATED), False),
        ("split", "1:3", None, None, False),
    ],
)
def test_differs_compares_mode_and_ratio(verdict, ratio, budget, deployed, expected) -> None:  # type: ignore[no-untyped-def]
    assert differs(advised_shape(verdict, ratio, budget), deployed) is expected


@pytest.mark.parametrize(
    "votes, expected",
    [
        ([None], [AdviceReason.INSUFFICIENT_DATA]),
        ([None, "a", "a"], [AdviceReason.INSUFFICIENT_DATA, AdviceReason.FIRST, AdviceReason.AGREED]),
        (["a", "b", "b", "b"], [AdviceReason.FIRST, AdviceReason.HELD, AdviceReason.HELD, AdviceReason.CHANGED]),
        (["a", "b", None, "b", "a"], [AdviceReason.FIRST, AdviceReason.HELD, AdviceReason.INSUFFICIENT_DATA,
                                      AdviceReason.HELD, AdviceReason.AGREED]),
    ],
)  # fmt: skip
def test_each_window_gets_one_reason_of_the_closed_set(votes, expected) -> None:  # type: ignore[no-untyped-def]
    reasons = []
    before = hysteresis.hold([], 3)
    for i, key in enumerate(votes):
        after = hysteresis.hold([(k, j) for j, k in enumerate(votes[: i + 1])], 3)
        reasons.append(hysteresis.window_reason(before, after, key))
        before = after
    assert reasons == expected
