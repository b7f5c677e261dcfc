"""The report's "Why requests missed the SLO" section (tracer/report/why.py, architecture.md section 7).

The expected causes come from how the scenarios were built: the prompt lengths their workloads drew
(tests/synthetic.py), bucketed here by the edges the section documents (512, 2k, 8k tokens).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.synthetic import TraceOptions, scenario, write_traces
from tracer.report import build, why
from tracer.report.build import build_report
from tracer.report.render import render
from tracer.report.simulate import SLO

from .conftest import N_REQUESTS, quick_options

# The documented buckets, restated: (key, lowest tokens, highest tokens).
BUCKETS = (
    ("prefill_lt512", 0, 511),
    ("prefill_512_2k", 512, 2047),
    ("prefill_2k_8k", 2048, 8191),
    ("prefill_gt8k", 8192, 10**9),
)
LONG_BUCKETS = {"prefill_512_2k", "prefill_2k_8k", "prefill_gt8k"}


def _bucket_of_every_prompt(sc) -> str:
    """The one bucket that holds every uncached prompt of the scenario's workload."""
    prompts = sc.workload.prompt_tokens - sc.workload.cached_tokens
    held = [key for key, low, high in BUCKETS if low <= prompts.min() and prompts.max() <= high]
    assert len(held) == 1, "the scenario's prompts span more than one bucket"
    return held[0]


def _top_by_stall(section) -> str:
    return max(section["causes"], key=lambda c: c["stall_share"])["cause"]


@pytest.fixture(scope="module")
def long_prompts_report(scenario_traces):
    sc, path, _ = scenario_traces("long-prompts")
    return sc, build_report([path], quick_options(sc))


def test_long_prompts_stall_time_goes_to_the_long_prompt_bucket(long_prompts_report):
    sc, report = long_prompts_report
    section = report.why_missed
    expected = _bucket_of_every_prompt(sc)  # 600-1200 prompt tokens: the 512-2k bucket
    assert expected == "prefill_512_2k"
    assert section["missed"] > 0 and section["missed_itl"] > 0
    assert section["stall_windows"] > 0 and not section["estimated"]  # the decode spans carry stall events
    assert _top_by_stall(section) == expected
    top = next(c for c in section["causes"] if c["cause"] == expected)
    assert top["stall_share"] > 0.5 and top["miss_share"] > 0.5


def test_json_fields_exist_and_shares_sum_to_one(long_prompts_report):
    _, report = long_prompts_report
    section = json.loads(render(report, "json"))["why_missed"]
    for key in (
        "requests",
        "missed",
        "missed_ttft",
        "missed_itl",
        "examined",
        "sampled",
        "max_examined",
        "bucket_edges_tokens",
        "stall_windows",
        "stall_s",
        "estimated",
        "top_stall_cause",
        "top_miss_cause",
        "causes",
        "rests_on",
    ):
        assert key in section
    assert section["requests"] == N_REQUESTS
    assert section["bucket_edges_tokens"] == [512, 2048, 8192]
    assert not section["sampled"] and section["examined"] == section["missed"]
    for cause in section["causes"]:
        assert set(cause) >= {"cause", "label", "miss_share", "stall_share", "stall_s", "misses"}
    assert sum(c["miss_share"] for c in section["causes"]) == pytest.approx(1.0, abs=1e-6)
    assert sum(c["stall_share"] for c in section["causes"]) == pytest.approx(1.0, abs=1e-6)
    assert sum(c["stall_s"] for c in section["causes"]) == pytest.approx(section["stall_s"], rel=1e-6)


def test_markdown_and_html_carry_the_section(long_prompts_report):
    _, report = long_prompts_report
    md = render(report, "md")
    assert "## Why requests missed the SLO" in md
    assert "| cause | share of misses | share of stall time | stall time |" in md
    assert "| prefill interference, prompts 512-2k tokens |" in md
    page = render(report, "html")
    assert "<h2>Why requests missed the SLO</h2>" in page
    assert 'alt="Why requests missed the SLO"' in page


def test_short_prompts_do_not_blame_long_prompts(scenario_traces):
    sc, path, _ = scenario_traces("chatty")
    assert _bucket_of_every_prompt(sc) == "prefill_lt512"  # 50-150 prompt tokens: nothing long ran
    # Chatty meets its loose ITL objective; a tight one (its gaps are 10-25 ms) makes requests miss.
    report = build_report([path], quick_options(sc, slo=SLO(sc.slo_ttft_s, 0.015)))
    section = report.why_missed
    assert section["missed_itl"] > 0
    assert _top_by_stall(section) not in LONG_BUCKETS
    assert all(c["stall_share"] == 0 for c in section["causes"] if c["cause"] in LONG_BUCKETS)


def test_no_miss_says_so(scenario_traces):
    sc, path, _ = scenario_traces("chatty")
    report = build_report([path], quick_options(sc))  # its own SLO: every request meets it
    section = report.why_missed
    assert section["missed"] == 0 and section["causes"] == []
    assert "no request missed the SLO" in section["rests_on"]
    assert "0 of 200 requests missed the SLO" in render(report, "md")


def test_off_when_asked(scenario_traces):
    sc, path, _ = scenario_traces("long-prompts")
    report = build_report([path], quick_options(sc, why_missed=False, confidence_resamples=0))
    assert report.why_missed is None
    assert json.loads(render(report, "json"))["why_missed"] is None
    assert "Why requests missed" not in render(report, "md")


def test_large_traces_skip_it_unless_asked_and_say_so(scenario_traces, monkeypatch):
    sc, path, _ = scenario_traces("long-prompts")
    monkeypatch.setattr(build, "WHY_MISSED_AUTO_MAX_BYTES", path.stat().st_size - 1)  # these traces are "large"
    skipped = build_report([path], quick_options(sc, confidence_resamples=0))
    assert skipped.why_missed is None
    assert any(line.startswith("why requests missed the SLO: not built") for line in skipped.assumptions)
    asked = build_report([path], quick_options(sc, why_missed=True, confidence_resamples=0))
    assert asked.why_missed is not None and asked.why_missed["missed"] > 0


@pytest.fixture(scope="module")
def request_spans_only(tmp_path_factory):
    """long-prompts as stock vLLM would trace it: no token times, no step spans."""
    sc = scenario("long-prompts", n_requests=N_REQUESTS)
    path = tmp_path_factory.mktemp("why") / "long-prompts-request-spans.jsonl"
    options = TraceOptions(include_itl=False, include_steps=False)
    write_traces(path, sc.layout, sc.workload, sc.costs, noise_sigma=0.05, seed=7, options=options)
    return sc, path


def test_without_token_times_the_causes_are_estimated(request_spans_only):
    sc, path = request_spans_only
    section = why.why_missed([path], SLO(sc.slo_ttft_s, sc.slo_itl_s))
    assert section["itl_not_traced"] == N_REQUESTS
    assert section["missed_itl"] > 0 and section["estimated"]
    assert section["stall_windows_by_basis"]["request overlap"] == section["stall_windows"] > 0
    assert any("ESTIMATED" in line for line in section["rests_on"])
    assert _top_by_stall(section) == _bucket_of_every_prompt(sc)


def test_many_misses_are_sampled_and_said_so(scenario_traces, request_spans_only, monkeypatch):
    monkeypatch.setattr(why, "MAX_EXAMINED", 3)
    sc, path, _ = scenario_traces("long-prompts")
    report = build_report([path], quick_options(sc))
    section = report.why_missed
    assert section["sampled"] and section["examined"] == 3 < section["missed"]
    assert section["max_examined"] == 3
    assert sum(c["miss_share"] for c in section["causes"]) == pytest.approx(1.0, abs=1e-6)
    assert np.isclose(sum(c["misses"] for c in section["causes"]), 3)
    assert "3 of them examined, evenly spaced in arrival order (at most 3)" in render(report, "md")
    assert why.why_missed([path], report.slo) == section  # deterministic
    # Without token times, the requests scanned for estimated ITL misses are capped too, and it is said.
    sc, path = request_spans_only
    estimated = why.why_missed([path], SLO(sc.slo_ttft_s, sc.slo_itl_s))
    assert estimated["sampled"] and estimated["examined"] <= 3
    assert any("of the 3 looked at" in line for line in estimated["rests_on"])


def test_the_cli_writes_the_section_and_can_skip_it(scenario_traces):
    from click.testing import CliRunner

    from tracer.report.cli import report_command

    sc, path, _ = scenario_traces("long-prompts")
    args = [str(path), "--slo-ttft", str(sc.slo_ttft_s), "--slo-itl", str(sc.slo_itl_s), "--sim-requests", "100"]
    args += ["--confidence-resamples", "0", "--router", "round-robin", "--format", "json"]
    result = CliRunner().invoke(report_command, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["why_missed"]["top_stall_cause"] == _bucket_of_every_prompt(sc)
    skipped = CliRunner().invoke(report_command, args + ["--no-why-missed"])
    assert skipped.exit_code == 0, skipped.output
    assert json.loads(skipped.output)["why_missed"] is None
