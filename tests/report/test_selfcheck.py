"""The self-check asks whether a miss matters (selfcheck.judge): a miss far from the objective is stated and
the answer stands; a miss near it is corrected (observed over predicted) and the answer stands only when the
corrected decision is the same one. The throttled deployment the model cannot explain at all is in
test_self_check.py."""

from __future__ import annotations

import json

import pytest

from tracer.report import build, selfcheck
from tracer.report.build import build_report
from tracer.report.confidence import Confidence
from tracer.report.render import render
from tracer.report.selfcheck import (
    ATTAINMENT_TOLERANCE,
    MAX_CORRECTION,
    MAX_ESTIMATED_TYPICAL_MISS,
    MAX_STEP_TYPICAL_MISS,
    MIN_STEP_R2,
    Correction,
    Judgement,
    Outcome,
    judge,
    wilson_interval,
)
from tracer.report.simulate import SLO
from tracer.vocabulary import Verdict

from .conftest import quick_options

SLO_ = SLO(ttft_s=1.0, itl_s=0.1)


def _check(**values: float) -> dict[str, float]:
    """A model check that passes everywhere (predicted == measured, attainment agreeing), with `values`
    (keys of build.model_check) replaced."""
    check = {"predicted_attainment": 0.95, "measured_attainment": 0.95}
    for key, value in (("ttft_p50_s", 0.2), ("ttft_p90_s", 0.3), ("itl_p50_s", 0.01), ("itl_p90_s", 0.02)):
        check[f"predicted_{key}"] = check[f"measured_{key}"] = value
    check.update(values)
    return check


# ------------------------------------------------------------------------------------------ judge()


def test_a_miss_far_below_the_objective_is_stated_and_does_not_matter():
    # ITL p90 off by 2x, 6 ms against a 100 ms objective: no request crosses it either way.
    judgement = judge(_check(predicted_itl_p90_s=0.006, measured_itl_p90_s=0.012), 0.95, SLO_)
    assert len(judgement.misses) == 1 and "ITL p99 p90" in judgement.misses[0]
    assert judgement.mattering == [] and judgement.refusals == [] and judgement.correction is None
    [why] = judgement.harmless
    assert why.startswith(judgement.misses[0]) and "does not matter" in why and "under half" in why


def test_a_miss_near_the_objective_matters_and_yields_observed_over_predicted():
    judgement = judge(_check(predicted_itl_p90_s=0.05, measured_itl_p90_s=0.08), 0.95, SLO_)
    assert judgement.mattering == judgement.misses and len(judgement.misses) == 1
    assert judgement.correction == Correction(ttft_factor=1.0, itl_factor=pytest.approx(1.6))
    # The model underpredicts ITL by 1.6x: it must meet itl_s / 1.6 for the deployment to meet itl_s.
    corrected = judgement.correction.slo(SLO_)
    assert corrected.itl_s == pytest.approx(SLO_.itl_s / 1.6) and corrected.ttft_s == SLO_.ttft_s
    assert (corrected.itl_stat, corrected.attainment) == (SLO_.itl_stat, SLO_.attainment)


def test_a_miss_straddling_the_objective_matters_and_past_the_largest_correction_refuses():
    judgement = judge(_check(predicted_ttft_p90_s=0.2, measured_ttft_p90_s=3.0), 0.95, SLO_)  # 15x
    assert judgement.mattering
    assert judgement.correction is None and len(judgement.refusals) == 1
    within = judge(_check(predicted_ttft_p90_s=0.8, measured_ttft_p90_s=3.0), 0.95, SLO_)  # 3.75x
    assert within.correction == Correction(ttft_factor=3.75, itl_factor=1.0)


def test_the_factor_comes_from_the_mattering_quantile_nearest_the_objective():
    # Both miss and both matter: the p50 by 3x at 60 ms, the p90 by 2x right on the 100 ms objective.
    check = _check(predicted_itl_p50_s=0.02, measured_itl_p50_s=0.06, predicted_itl_p90_s=0.05, measured_itl_p90_s=0.1)
    judgement = judge(check, 0.95, SLO_)
    assert len(judgement.mattering) == 2
    assert judgement.correction == Correction(1.0, pytest.approx(2.0))


def test_an_attainment_gap_matters_even_when_every_quantile_miss_is_far_from_the_objective():
    check = _check(
        predicted_attainment=0.95,
        measured_attainment=0.95 - ATTAINMENT_TOLERANCE - 0.05,
        predicted_itl_p90_s=0.006,
        measured_itl_p90_s=0.012,
    )
    judgement = judge(check, 0.95, SLO_)
    assert any("attainment" in line for line in judgement.mattering)
    assert judgement.harmless and "attainment" not in judgement.harmless[0]  # it does not say attainment agrees
    # The only miss there is gives the factor: something must explain the gap.
    assert judgement.correction == Correction(1.0, pytest.approx(2.0))


def test_an_attainment_gap_with_no_quantile_miss_has_nothing_to_correct_by():
    judgement = judge(_check(measured_attainment=0.5), 0.95, SLO_)
    assert judgement.mattering and judgement.correction is None


def test_an_attainment_gap_a_handful_of_requests_cannot_resolve_is_no_miss():
    # Four of six requests met the objective: 67% measured, yet anything from 30% to 90% fits those six.
    few = _check(predicted_attainment=0.85, measured_attainment=4 / 6, attainment_requests=6.0)
    assert judge(few, 0.95, SLO_).misses == []
    # The same shares over 600 requests are a real miss, and the line says what the count resolves.
    many = judge({**few, "attainment_requests": 600.0}, 0.95, SLO_)
    assert len(many.mattering) == 1 and "what 600 requests resolve" in many.mattering[0]


def test_the_wilson_interval_matches_the_published_values():
    # Wilson (1927) as tabulated by Newcombe (1998), 95%: 4/6 -> 0.300-0.903, 0/10 -> 0-0.278.
    assert wilson_interval(4 / 6, 6) == (pytest.approx(0.300, abs=1e-3), pytest.approx(0.903, abs=1e-3))
    assert wilson_interval(0.0, 10) == (0.0, pytest.approx(0.278, abs=1e-3))


def test_a_step_fit_under_the_floor_refuses_and_is_never_corrected():
    judgement = judge(_check(predicted_itl_p90_s=0.05, measured_itl_p90_s=0.08), MIN_STEP_R2 - 0.1, SLO_)
    assert any("explains too little" in line for line in judgement.refusals)
    assert set(judgement.refusals) <= set(judgement.mattering) <= set(judgement.misses)
    assert judgement.correction is None


def test_a_low_r2_over_steps_the_fit_prices_closely_is_stated_and_does_not_refuse():
    # Steady traffic: one or two batch sizes, step times that vary by the machine's noise alone.
    judgement = judge(_check(), MIN_STEP_R2 - 0.7, SLO_, MAX_STEP_TYPICAL_MISS / 2)
    assert judgement.refusals == [] and judgement.mattering == []
    assert any("R^2" in line and "does not matter" in line for line in judgement.harmless)


def test_a_low_r2_over_steps_the_fit_misses_refuses_whatever_the_replay_says():
    judgement = judge(_check(), MIN_STEP_R2 - 0.1, SLO_, MAX_STEP_TYPICAL_MISS * 1.25)
    assert any("explains too little" in line and "typical step" in line for line in judgement.refusals)
    assert judgement.correction is None


def test_the_typical_miss_separates_a_throttled_gpu_from_steady_traffic(oracle_traces):
    # The oracle's GPU throttled to a third every other 5 s (costs that cannot price its steps) sits over the
    # bound; the same workload unthrottled sits far under it (independent truth: tests/oracle).
    from tracer.report.fit import fit_steps
    from tracer.report.tables import load_traces

    _, throttled, _ = oracle_traces("throttled", 1, 0.15)
    _, steady, _ = oracle_traces("medium-max-gap", 1, 0.15)
    assert fit_steps(load_traces([throttled]).steps).typical_miss > MAX_STEP_TYPICAL_MISS
    assert fit_steps(load_traces([steady]).steps).typical_miss < MAX_STEP_TYPICAL_MISS / 2


def test_a_gap_histogram_miss_near_the_objective_corrects_to_the_nearest_bucket_edge():
    check = _check(predicted_gap_p99_s=0.2, measured_gap_p99_low_s=0.05, measured_gap_p99_high_s=0.075)
    judgement = judge(check, 0.95, SLO_)
    assert any("engine's own gaps" in line for line in judgement.mattering)
    assert judgement.correction == Correction(1.0, pytest.approx(0.075 / 0.2))


# ------------------------------------------------------------------------------------------ the report


def _scaled_itl(source, target, factor: float) -> None:
    """Copy a trace with every recorded inter-token statistic times `factor`: a deployment whose gaps are
    `factor` times what its step spans explain, so the model misses them by that much."""
    with open(source) as lines, open(target, "w") as out:
        for line in lines:
            request = json.loads(line)
            for resource_spans in request["resourceSpans"]:
                for scope_spans in resource_spans["scopeSpans"]:
                    for span in scope_spans["spans"]:
                        for attribute in span.get("attributes", []):
                            key, value = attribute["key"], attribute["value"]
                            if "itl" in key and key.endswith("_s") and "doubleValue" in value:
                                value["doubleValue"] *= factor
            out.write(json.dumps(request) + "\n")


def _report_on_scaled(scenario_traces, tmp_path, name: str, factor: float, **overrides):
    sc, path, _ = scenario_traces(name)
    scaled = tmp_path / f"{name}-itl-x{factor:g}.jsonl"
    _scaled_itl(path, scaled, factor)
    return build_report([scaled], quick_options(sc, **overrides))


def test_misses_far_below_the_objective_leave_the_verdict_and_are_stated(scenario_traces, tmp_path):
    # chatty: gaps of tens of ms against a 250 ms objective; doubling them moves no request across it.
    report = _report_on_scaled(scenario_traces, tmp_path, "chatty", 2.0)
    assert report.verdict == Verdict.STAY_COLOCATED, report.evidence
    assert report.unconfirmed is None
    self_check = report.self_check
    assert self_check["outcome"] == Outcome.MISSES_DO_NOT_MATTER
    assert self_check["misses"] and self_check["mattering"] == [] and self_check["correction"] is None
    for miss in self_check["misses"]:
        assert any(line.startswith(miss) and "does not matter" in line for line in report.evidence)
    document = json.loads(render(report, "json"))
    assert document["self_check"]["outcome"] == "misses-do-not-matter"
    assert document["self_check"]["misses"] == self_check["misses"]
    assert "misses-do-not-matter: 2 model-check misses, 0 able to change the verdict" in render(report, "md")


def test_a_correction_that_moves_the_chunk_budget_answers_with_the_corrected_budget(scenario_traces, tmp_path):
    # long-prompts: gaps near the 100 ms objective; twice them asks for a smaller chunk budget. Chunked
    # prefill both times: the same decision at another setting, answered with the corrected budget.
    plain = build_report([scenario_traces("long-prompts")[1]], quick_options(scenario_traces("long-prompts")[0]))
    report = _report_on_scaled(scenario_traces, tmp_path, "long-prompts", 2.0)
    assert plain.verdict == report.verdict == Verdict.ENABLE_CHUNKED_PREFILL, report.evidence
    assert report.chunk_budget_tokens < plain.chunk_budget_tokens  # the measured gaps are twice the model's
    self_check = report.self_check
    assert self_check["outcome"] == Outcome.CORRECTED_SAME_VERDICT
    assert self_check["correction"]["itl_factor"] == pytest.approx(2.0, rel=0.1)
    assert any(line.startswith("the correction moves the token budget") for line in report.evidence), report.evidence
    assert report.unconfirmed is None


def test_a_correction_that_flips_the_decision_refuses_and_names_the_flip(scenario_traces, tmp_path):
    # strict-itl: twice the gaps make the corrected model ask for another split ratio: another deployment.
    report = _report_on_scaled(scenario_traces, tmp_path, "strict-itl", 2.0)
    assert report.verdict == Verdict.INSUFFICIENT_DATA
    self_check = report.self_check
    assert self_check["outcome"] == Outcome.REFUSED_FLIPS
    assert self_check["correction"]["itl_factor"] == pytest.approx(2.0, rel=0.1)
    assert self_check["corrected_verdict"] and self_check["corrected_verdict"] != report.unconfirmed
    flip = f"the correction flips the verdict: {report.unconfirmed} -> {self_check['corrected_verdict']}"
    assert flip in report.evidence, report.evidence
    # A split both times, at another ratio: the guess and the corrected decision name different pools.
    assert report.unconfirmed.startswith("split ") and self_check["corrected_verdict"].startswith("split ")
    assert any(line.startswith("unconfirmed best guess") for line in report.evidence)


def test_a_correction_that_agrees_answers_with_the_corrected_table(scenario_traces, tmp_path):
    # wrong-split: a 3:1 split of a decode-heavy load; gaps 1.6x the model's still call for 1:3.
    report = _report_on_scaled(scenario_traces, tmp_path, "wrong-split", 1.6)
    assert (report.verdict, report.from_ratio, report.ratio) == (Verdict.REBALANCE, "3:1", "1:3"), report.evidence
    self_check = report.self_check
    assert self_check["outcome"] == Outcome.CORRECTED_SAME_VERDICT
    assert self_check["corrected_verdict"] == "rebalance 3:1 -> 1:3"
    factor = self_check["correction"]["itl_factor"]
    assert factor == pytest.approx(1.6, rel=0.1)
    assert any(line.startswith("self-check correction") for line in report.evidence)
    assert any(line.startswith("the corrected decision agrees: rebalance 3:1 -> 1:3") for line in report.evidence)
    # The table shown is the corrected run's: decided against the objective the model must meet.
    uncorrected = build_report([scenario_traces("wrong-split")[1]], quick_options(scenario_traces("wrong-split")[0]))
    assert [o.label for o in report.goodput] == [o.label for o in uncorrected.goodput]
    assert report.goodput != uncorrected.goodput


def test_a_correction_that_only_takes_the_margin_refuses_and_says_so(scenario_traces, monkeypatch):
    # long-prompts at a 150% margin: chunked prefill clears it; with the model's gaps taken as 0.7x the
    # deployment's (a looser objective for the model), plain colocated catches up to within the margin.
    sc, path, _ = scenario_traces("long-prompts")
    said = Judgement(["a miss"], ["a miss"], [], [], Correction(ttft_factor=1.0, itl_factor=0.7))
    monkeypatch.setattr(build.selfcheck, "judge", lambda check, step_r2, slo, *fit_spread: said)
    report = build_report([path], quick_options(sc, margin=1.5))
    assert report.verdict == Verdict.INSUFFICIENT_DATA
    assert report.self_check["outcome"] == Outcome.REFUSED_MARGIN
    assert any(line.startswith("the correction erases its margin") for line in report.evidence), report.evidence


def test_a_corrected_answer_is_as_sure_as_the_weaker_of_its_two_bootstraps(scenario_traces, tmp_path, monkeypatch):
    def bootstrap(decided, *rest):
        share = 0.9 if decided.slo.itl_s == sc.slo_itl_s else 0.6  # the corrected objective is the less sure one
        return Confidence(share, 20, {decided.decision.verdict: round(share * 20)})

    sc = scenario_traces("wrong-split")[0]
    monkeypatch.setattr(build, "bootstrap", bootstrap)
    report = _report_on_scaled(scenario_traces, tmp_path, "wrong-split", 1.6, confidence_resamples=20)
    assert report.self_check["outcome"] == Outcome.CORRECTED_SAME_VERDICT
    assert report.confidence == 0.6
    assert any("the lower of the bootstrap" in line for line in report.evidence)


def test_a_passing_check_says_passed(scenario_traces):
    sc, path, _ = scenario_traces("chatty")
    report = build_report([path], quick_options(sc))
    assert report.self_check["outcome"] == selfcheck.Outcome.PASSED and report.self_check["misses"] == []


def test_an_estimated_fit_under_the_r2_floor_stands_only_on_its_tighter_typical_miss():
    # Step costs estimated from request spans price each request's mean step: the same typical miss that
    # clears a fit on single steps is far too much for one on means (selfcheck.MAX_ESTIMATED_TYPICAL_MISS).
    check = _check()
    on_steps = judge(check, 0.1, SLO_, 0.2, MAX_STEP_TYPICAL_MISS)
    on_means = judge(check, 0.1, SLO_, 0.2, MAX_ESTIMATED_TYPICAL_MISS)
    assert on_steps.refusals == [] and any("does not matter" in line for line in on_steps.harmless)
    assert len(on_means.refusals) == 1 and "misses a typical step by 22%" in on_means.refusals[0]
    assert judge(check, 0.1, SLO_, 0.005, MAX_ESTIMATED_TYPICAL_MISS).refusals == []


def test_a_mattering_miss_past_the_largest_correction_refuses_instead_of_being_clipped():
    # ITL p90 predicted 0.03 s, measured 0.15 s against a 0.1 s objective: off by 5x. Clipping the factor to
    # 4 would decide against an objective the model still misses; the model is wrong here, not a little off.
    judgement = judge(_check(predicted_itl_p90_s=0.03, measured_itl_p90_s=0.15), 0.95, SLO_)
    assert judgement.correction is None
    assert len(judgement.refusals) == 1 and f"off by more than {MAX_CORRECTION:g}x" in judgement.refusals[0]
    within = judge(_check(predicted_itl_p90_s=0.05, measured_itl_p90_s=0.15), 0.95, SLO_)  # 3x: corrected
    assert within.refusals == [] and within.correction is not None
    assert within.correction.itl_factor == pytest.approx(3.0)


def test_a_quantile_between_stalled_and_unstalled_requests_is_no_miss_when_the_shares_over_the_objective_agree():
    # Bursts of long prompts on the reference server (bench/verdict_ab.py, 71 requests): ITL p90 predicted
    # 0.027 s vs measured 0.155 s under a 0.1 s objective, with 7.0% vs 11.3% of the requests over it. The
    # per-request ITL is two-humped; the p90 sits between the humps and a request or two moves it far.
    shares = dict(predicted_itl_over_slo=0.070, measured_itl_over_slo=0.113, attainment_requests=71.0)
    knife_edge = judge(_check(predicted_itl_p90_s=0.027, measured_itl_p90_s=0.155, **shares), 0.95, SLO_)
    assert knife_edge.refusals == [] and knife_edge.mattering == [] and knife_edge.correction is None
    assert any("7.0% of requests over the ITL objective" in line and "11.3%" in line for line in knife_edge.harmless)
    # The same quantiles over 1,000 requests resolve 7% from 11%: the model is wrong about the stalls.
    many = judge(
        _check(predicted_itl_p90_s=0.027, measured_itl_p90_s=0.155, **{**shares, "attainment_requests": 1000.0}),
        0.95,
        SLO_,
    )
    assert len(many.refusals) == 1 and f"off by more than {MAX_CORRECTION:g}x" in many.refusals[0]
    # ... and so do shares far apart over few requests (2% predicted vs 30% measured of 71).
    apart = judge(
        _check(
            predicted_itl_p90_s=0.027,
            measured_itl_p90_s=0.155,
            predicted_itl_over_slo=0.02,
            measured_itl_over_slo=0.3,
            attainment_requests=71.0,
        ),
        0.95,
        SLO_,
    )
    assert apart.mattering and apart.refusals
    # A miss near the objective but on one side of it is headroom the goodput search spends at higher rates:
    # it matters even where the shares over the objective agree.
    near = judge(_check(predicted_itl_p90_s=0.06, measured_itl_p90_s=0.095, **shares), 0.95, SLO_)
    assert near.mattering and near.correction is not None
