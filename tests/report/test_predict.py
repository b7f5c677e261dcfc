"""predict.py: a layout's attainment at the observed arrivals, from the report's fits, against the ground truth.

The traces are synthetic from known costs (the report fits; it never sees them): the truth for the advised
layout is the same requests at the same arrival times served under the TRUE costs.
"""

from __future__ import annotations

from tests.synthetic import SYNTHETIC_ROUTER
from tracer.report.build import build_report, model_check
from tracer.report.predict import predict_attainment
from tracer.report.simulate import SLO, EngineParams, simulate

from .conftest import quick_options


def test_the_advised_layout_is_predicted_at_the_observed_arrivals_as_the_true_costs_serve_it(scenario_traces):
    sc, path, truth_on_current = scenario_traces("long-prompts")
    report = build_report([path], quick_options(sc))
    assert report.recommended is not None and report.recommended != report.current, report.evidence
    prediction = predict_attainment(report)
    assert prediction is not None and prediction.layout == report.recommended and not prediction.corrected
    slo = SLO(sc.slo_ttft_s, sc.slo_itl_s)
    truth = simulate(report.recommended, sc.workload, sc.costs, slo, params=EngineParams(router=SYNTHETIC_ROUTER))
    assert abs(prediction.attainment - truth.attainment_for(slo)) <= 0.1
    assert prediction.requests == len(sc.workload)
    assert abs(prediction.rate_per_s - sc.workload.rate_per_s) <= 0.02 * sc.workload.rate_per_s
    # The advice helps, in the truth too: the advised layout attains more than the deployed one did.
    assert truth.attainment_for(slo) > truth_on_current.attainment_for(slo)


def test_the_current_layout_is_predicted_as_the_model_check_replays_it(scenario_traces):
    sc, path, _ = scenario_traces("chatty")
    report = build_report([path], quick_options(sc))
    assert report.current is not None and report.costs is not None and report.engine_params is not None
    prediction = predict_attainment(report, report.current)
    assert prediction is not None
    assert report.data is not None and report.step_fit is not None
    check = model_check(
        report.current,
        report.data.requests,
        report.costs,
        report.slo,
        report.step_fit.noise_sigma,
        report.engine_params,
        step_noise=report.step_fit.noise,
    )
    assert prediction.attainment == check["predicted_attainment"]


def test_a_report_without_a_model_predicts_nothing(scenario_traces):
    sc, path, _ = scenario_traces("chatty")
    report = build_report([path], quick_options(sc, min_requests=10**6))  # too few requests: no fit, no layouts
    assert report.costs is None and predict_attainment(report) is None
