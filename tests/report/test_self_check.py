"""The report checks itself: a deployment whose iteration time depends on something outside the cost model
(a GPU that throttles to a third of its speed every other 5 s, in the independent oracle) must not get a
confident verdict, from full traces or from vLLM-shaped spans; it gets `insufficient-data` with the
reason, and its best guess shown as unconfirmed in every format."""

from __future__ import annotations

import json

import pytest

from tests.report.conftest import oracle_options
from tracer.report.build import build_report
from tracer.report.render import render
from tracer.report.selfcheck import MIN_STEP_R2
from tracer.vocabulary import Verdict


@pytest.mark.parametrize("shape", ["full", "vllm"])
def test_a_deployment_the_model_cannot_explain_gets_insufficient_data_with_the_reason(oracle_traces, shape):
    seen, full, vllm_shaped = oracle_traces("throttled", 1, 0.15)
    report = build_report([full if shape == "full" else vllm_shaped], oracle_options(seen))
    assert report.verdict == Verdict.INSUFFICIENT_DATA, report.evidence
    reasons = [
        line for line in report.evidence if line.startswith("model check misses") or "explains too little" in line
    ]
    assert reasons, report.evidence
    # The step fit's floor is stated, and this fit is under it.
    assert report.fits["step"]["r2"] < MIN_STEP_R2
    assert report.unconfirmed  # what the model would have said, flagged as unconfirmed
    assert any(line.startswith("unconfirmed best guess") for line in report.evidence)
    document = json.loads(render(report, "json"))
    assert document["verdict"] == Verdict.INSUFFICIENT_DATA and document["unconfirmed_best_guess"] == report.unconfirmed
    assert f"{report.unconfirmed}: not a recommendation" in render(report, "md")
    assert "Unconfirmed best guess" in render(report, "html")


def test_the_same_workload_without_the_throttle_passes_its_self_check(oracle_traces):
    seen, full, _ = oracle_traces("medium-max-gap", 1, 0.15)
    report = build_report([full], oracle_options(seen))
    assert report.verdict != Verdict.INSUFFICIENT_DATA, report.evidence
    assert report.unconfirmed is None
    check = report.model_check
    for key in ("ttft_p50_s", "ttft_p90_s", "itl_p50_s", "itl_p90_s"):
        assert check[f"predicted_{key}"] == pytest.approx(check[f"measured_{key}"], rel=0.25)
