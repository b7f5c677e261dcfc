"""What the report does with thin, partial or windowed data."""

from __future__ import annotations

import pytest

from tests.synthetic import TraceOptions, scenario, write_traces
from tracer.report.build import build_report
from tracer.report.decide import Decision, combine_windows
from tracer.report.simulate import Layout

from .conftest import quick_options


def test_too_few_requests_is_insufficient_data_and_says_what_is_missing(tmp_path):
    sc = scenario("long-prompts", n_requests=5)
    path = tmp_path / "few.jsonl"
    write_traces(path, sc.layout, sc.workload, sc.costs)
    report = build_report([path], quick_options(sc))
    assert report.verdict == "insufficient-data"
    assert any("5 requests" in line and "at least 20" in line for line in report.evidence)


def test_without_step_spans_costs_are_estimated_and_the_verdict_holds(tmp_path):
    sc = scenario("long-prompts", n_requests=200)
    path = tmp_path / "vllm-like.jsonl"
    write_traces(path, sc.layout, sc.workload, sc.costs, options=TraceOptions(include_steps=False))
    report = build_report([path], quick_options(sc))
    assert report.read["steps"] == 0
    assert report.fits["step"]["source"] == "estimated from request spans"
    assert any("ESTIMATED" in line for line in report.assumptions)
    assert report.verdict == "enable-chunked-prefill"
    assert report.fits["step"]["base_s"] == pytest.approx(sc.costs.step.base_s, rel=0.25)


def test_windows_each_decide_and_a_consistent_change_holds(scenario_traces):
    sc, path, truth = scenario_traces("strict-itl")
    span_s = float(truth.timeline["arrival_s"].max())
    report = build_report([path], quick_options(sc, window_s=span_s / 2 + 1e-3, min_requests=20))
    assert len(report.windows) == 2
    assert [w.decision.verdict for w in report.windows] == ["split", "split"]
    assert report.verdict == "split"
    assert any("2 of 2 windows" in line for line in report.evidence)


def _d(verdict: str, ratio: str | None = None, changes: bool = True) -> Decision:
    return Decision(verdict, None, ratio=ratio, changes_layout=changes, reasons=[verdict])


def test_hysteresis_needs_a_strict_majority_of_windows_to_change_layout():
    current = Layout("colocated", workers=4)
    stay = _d("stay-colocated", changes=False)
    assert combine_windows(current, [_d("split", "1:3"), stay]).verdict == "stay-colocated"
    assert combine_windows(current, [_d("split", "1:3"), _d("split", "2:2"), stay]).verdict == "split"
    majority = combine_windows(current, [_d("split", "1:3"), _d("split", "1:3"), _d("split", "2:2"), stay, stay])
    assert (majority.verdict, majority.ratio) == ("split", "1:3")  # 3 of 5, at the most common ratio
    # Windows without enough data do not vote.
    thin = Decision("insufficient-data", None, reasons=["few"])
    assert combine_windows(current, [_d("enable-chunked-prefill"), thin, thin]).verdict == "enable-chunked-prefill"
    deployed = Layout("disaggregated", prefill_workers=1, decode_workers=3)
    kept = combine_windows(deployed, [_d("rebalance", "2:2"), _d("split", "1:3", changes=False)])
    assert (kept.verdict, kept.ratio) == ("split", "1:3")


def test_transfers_without_their_size_still_count_in_ttft_but_not_in_the_link_fit(tmp_path):
    """Engine adapters derive kv_transfer spans from timing alone (vLLM P/D, SGLang): no bytes on them."""
    import json

    from tracer import spans as s
    from tracer.report.tables import load_traces

    sc = scenario("wrong-split", n_requests=60)
    full, sizeless = tmp_path / "full.jsonl", tmp_path / "sizeless.jsonl"
    write_traces(full, sc.layout, sc.workload, sc.costs)
    with open(full) as source, open(sizeless, "w") as out:
        for line in source:
            request = json.loads(line)
            for resource_spans in request["resourceSpans"]:
                for scope_spans in resource_spans["scopeSpans"]:
                    for span in scope_spans["spans"]:
                        span["attributes"] = [a for a in span["attributes"] if a["key"] != s.ATTR_KV_BYTES]
            out.write(json.dumps(request) + "\n")
    with_size, without = load_traces([full]), load_traces([sizeless])
    assert len(with_size.transfers.kv_bytes) == 60 and len(without.transfers.kv_bytes) == 0
    assert without.requests.ttft_s == pytest.approx(with_size.requests.ttft_s)
