"""The demo's advice check without servers: reports on synthetic traces (known costs), the client's summaries
made from request records. The demo test (test_demo.py) runs it end to end; at its size the report refuses,
so the line's other branches are held here."""

from __future__ import annotations

import re

from reference_server.launch.advice_check import advised_layout, check_advice, serve_argv
from reference_server.launch.serve import serve_command
from tests.synthetic import SYNTHETIC_ROUTER, write_traces
from tests.synthetic import scenario as synthetic_scenario
from tracer.load.client import RequestMeasurement
from tracer.load.config import ClientSLO
from tracer.load.stats import Summary, summarize
from tracer.report.build import ReportOptions, build_report
from tracer.report.predict import predict_attainment
from tracer.report.simulate import SLO, Layout

LINE = re.compile(r"^advice check: (.+): predicted attainment (\d+)% at ([\d.]+) req/s, measured (\d+)%$")


def _summary(met: int, missed: int) -> Summary:
    """A client's summary of `met + missed` requests against TTFT <= 1 s: `met` at 0.1 s, the rest at 3 s."""
    records = [
        RequestMeasurement(
            index=i,
            source="test",
            session=None,
            scheduled_s=0.1 * i,
            prompt_tokens=10,
            requested_output_tokens=2,
            sent_s=0.1 * i,
            ttft_s=0.1 if i < met else 3.0,
            e2e_s=3.5,
            output_tokens=2,
            output_chunks=2,
        )
        for i in range(met + missed)
    ]
    return summarize(records, ClientSLO(ttft_s=1.0), wall_s=10.0)


def _report(name: str, tmp_path, **overrides):
    sc = synthetic_scenario(name, n_requests=200)
    path = tmp_path / f"{name}.jsonl"
    write_traces(path, sc.layout, sc.workload, sc.costs, noise_sigma=0.05, seed=7)
    values = dict(
        slo=SLO(sc.slo_ttft_s, sc.slo_itl_s),
        sim_requests=100,
        sim_max_requests=5000,
        sim_duration_s=20.0,
        confidence_resamples=0,
        router=SYNTHETIC_ROUTER,
        why_missed=False,
    )
    values.update(overrides)
    return build_report([path], ReportOptions(**values))


def test_a_change_of_layout_is_checked_on_the_run_that_served_it(tmp_path):
    report = _report("long-prompts", tmp_path)
    assert report.recommended is not None and report.recommended.mode == "chunked", report.evidence
    check = check_advice(report, "chunked", _summary(9, 1), _summary(5, 5), "enable-chunked-prefill")
    assert check is not None and not check.stays
    line = LINE.match(check.line())
    assert line, check.line()
    prediction = predict_attainment(report)
    assert prediction is not None
    assert line.group(1) == report.recommended.label
    assert int(line.group(2)) == round(100 * prediction.attainment)
    assert line.group(4) == "90"
    assert abs(float(line.group(3)) - prediction.rate_per_s) < 0.05 * prediction.rate_per_s
    assert "attainment 50% -> 90%, goodput 0.50 -> 0.90 req/s" in check.against_baseline()
    said = check.to_json()
    assert said["layout"] == report.recommended.label and said["run"] == "chunked" and not said["stays"]
    assert said["measured_attainment"] == 0.9 and said["baseline_attainment"] == 0.5
    assert said["error_points"] == 100 * (prediction.attainment - 0.9)


def test_the_advice_to_stay_is_checked_on_the_run_it_was_given_on(tmp_path):
    report = _report("chatty", tmp_path)
    assert report.verdict == "stay-colocated", report.evidence
    assert advised_layout(report) == report.current
    check = check_advice(report, "colocated", _summary(8, 2), _summary(8, 2), report.verdict)
    assert check is not None and check.stays
    assert LINE.match(check.line()).group(1) == "colocated x4"
    assert "the check is the colocated run itself" in check.against_baseline()


def test_a_refusal_has_no_advice_to_check(tmp_path):
    report = _report("chatty", tmp_path, min_requests=10**6)
    assert advised_layout(report) is None
    assert check_advice(report, "colocated", _summary(1, 0), _summary(1, 0), report.verdict) is None


def test_every_advised_layout_is_a_serve_command_line():
    layouts = {
        "colocated": Layout("colocated", workers=2),
        "chunked": Layout("chunked", workers=2, chunk_budget_tokens=64),
        "disaggregated": Layout("disaggregated", prefill_workers=1, decode_workers=1),
    }
    for layout in layouts.values():
        params = serve_command.make_context("serve", serve_argv(layout)).params
        assert params["mode"] == layout.mode
        if layout.mode == "disaggregated":
            assert (params["prefill_workers"], params["decode_workers"]) == (1, 1)
        else:
            assert params["workers"] == 2
    assert serve_command.make_context("serve", serve_argv(layouts["chunked"])).params["token_budget"] == 64
