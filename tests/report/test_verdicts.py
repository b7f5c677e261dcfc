"""Verdicts on synthetic traces from known ground-truth cost models (the report fits; it never sees them).

Each test names the margin its winner must clear (ReportOptions.margin, 15% by default) and checks that
the chosen ratio is within one worker of the best ratio under the TRUE costs (an oracle search with the
same simulator), so a wrong fit shows up as a wrong ratio.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.synthetic import SYNTHETIC_ROUTER, scenario, write_traces
from tracer.report.build import build_report
from tracer.report.goodput import search_goodput
from tracer.report.simulate import SLO, EngineParams, Layout

from .conftest import quick_options

MARGIN = 0.15


def _prefill_workers(ratio: str) -> int:
    return int(ratio.split(":")[0])


def _oracle_best_ratio(sc, gpus: int = 4) -> str:
    sample = sc.workload.resample(5000, 0)
    slo = SLO(sc.slo_ttft_s, sc.slo_itl_s)
    results = [
        search_goodput(
            Layout("disaggregated", prefill_workers=p, decode_workers=gpus - p),
            sample,
            sc.costs,
            slo,
            start_rate_per_s=sc.workload.rate_per_s,
            min_requests=100,
            duration_s=20.0,
            params=EngineParams(router=SYNTHETIC_ROUTER),
        )
        for p in range(1, gpus)
    ]
    return max(results, key=lambda r: r.goodput_per_gpu).layout.ratio


def _goodput(report, label: str) -> float:
    return next(o.goodput_per_gpu for o in report.goodput if o.label == label)


def test_short_prompts_loose_itl_stay_colocated(scenario_traces):
    sc, path, _ = scenario_traces("chatty")
    report = build_report([path], quick_options(sc, margin=MARGIN))
    assert report.verdict == "stay-colocated", report.evidence
    colocated = _goodput(report, "colocated x4")
    best_split = max(o.goodput_per_gpu for o in report.goodput if o.mode == "disaggregated")
    assert best_split < colocated * (1 + MARGIN)  # no split clears the margin


def test_long_prompts_enable_chunked_prefill_with_a_budget(scenario_traces):
    sc, path, _ = scenario_traces("long-prompts")
    report = build_report([path], quick_options(sc, margin=MARGIN))
    assert report.verdict == "enable-chunked-prefill", report.evidence
    assert report.chunk_budget_tokens == 512
    # The winner's stated margin: chunked beats plain colocated by far more than 15% here (about 4x).
    assert report.win_margin is not None and report.win_margin >= 1.0
    chunked = _goodput(report, "chunked 512 x4")
    assert max(o.goodput_per_gpu for o in report.goodput if o.mode == "disaggregated") < chunked * (1 + MARGIN)


def test_strict_itl_splits_at_the_ratio_the_true_costs_favour(scenario_traces):
    sc, path, _ = scenario_traces("strict-itl")
    report = build_report([path], quick_options(sc, margin=MARGIN))
    assert report.verdict == "split", report.evidence
    assert abs(_prefill_workers(report.ratio) - _prefill_workers(_oracle_best_ratio(sc))) <= 1
    # Splitting must clear the 15% margin over the best single pool (chunked at its best budget); here
    # the true costs give it about +60%.
    assert report.win_margin is not None and report.win_margin >= 0.3


def test_a_prefill_heavy_split_on_a_decode_heavy_workload_is_rebalanced(scenario_traces):
    sc, path, _ = scenario_traces("wrong-split")
    report = build_report([path], quick_options(sc, margin=MARGIN))
    assert report.verdict == "rebalance", report.evidence
    assert report.from_ratio == "3:1"
    assert abs(_prefill_workers(report.ratio) - _prefill_workers(_oracle_best_ratio(sc))) <= 1
    assert report.win_margin is not None and report.win_margin >= MARGIN  # about +200% over 3:1 here


def test_a_split_over_a_slow_link_is_merged(scenario_traces):
    sc, path, _ = scenario_traces("slow-link")
    report = build_report([path], quick_options(sc, margin=MARGIN))
    assert report.verdict == "merge", report.evidence
    # The link speed was measured on the transfers, not told: 1 Gb/s ground truth.
    assert report.fits["transfer"]["observed"]
    assert report.fits["transfer"]["bandwidth_gbps"] == pytest.approx(1.0, rel=0.15)
    assert all(o.goodput_per_gpu == 0 for o in report.goodput if o.mode == "disaggregated")


def test_a_slow_link_flag_turns_a_winning_split_into_a_loss(scenario_traces):
    sc, path, _ = scenario_traces("strict-itl")
    fast = build_report([path], quick_options(sc, link_gbps=100.0))
    slow = build_report([path], quick_options(sc, link_gbps=1.0))
    assert fast.verdict == "split"
    assert slow.verdict != "split", slow.evidence
    assert any("1 Gb/s" in line for line in slow.assumptions)
    assert slow.network["required_gbps_total"] > 1.0  # the KV traffic alone exceeds the link


def test_goodput_fits_recover_the_ground_truth_model(scenario_traces):
    sc, path, _ = scenario_traces("long-prompts")
    report = build_report([path], quick_options(sc))
    step = report.fits["step"]
    truth = sc.costs.step
    assert step["base_s"] == pytest.approx(truth.base_s, rel=0.1)
    assert step["decode_s_per_request"] == pytest.approx(truth.decode_s_per_request, rel=0.2)
    assert step["prefill_s_per_token"] == pytest.approx(truth.prefill_s_per_token, rel=0.1)
    assert report.fits["interference_factor"] > 2  # whole prefills make mixed steps several times slower


def test_model_check_predicts_measured_latency_on_the_current_layout(scenario_traces):
    sc, path, truth = scenario_traces("long-prompts")
    report = build_report([path], quick_options(sc))
    check = report.model_check
    assert check["predicted_ttft_p50_s"] == pytest.approx(check["measured_ttft_p50_s"], rel=0.15)
    assert check["predicted_itl_p50_s"] == pytest.approx(check["measured_itl_p50_s"], rel=0.15)
    assert check["measured_ttft_p50_s"] == pytest.approx(float(np.median(truth.ttft_s)), rel=0.02)


def test_max_batch_bounds_goodput_at_what_a_capped_engine_serves(tmp_path):
    """An engine that runs at most 4 requests per worker serves far less than the same costs uncapped: the
    report told the cap matches the oracle under the true costs and cap, and without it overestimates."""
    sc = scenario("chatty", n_requests=200)
    capped = EngineParams(max_running_requests=4, router=SYNTHETIC_ROUTER)
    path = tmp_path / "capped.jsonl"
    write_traces(path, sc.layout, sc.workload, sc.costs, noise_sigma=0.05, seed=7, params=capped)
    told = build_report([path], quick_options(sc, max_batch=4))
    untold = build_report([path], quick_options(sc))

    oracle = search_goodput(
        sc.layout,
        sc.workload.resample(5000, 0),
        sc.costs,
        SLO(sc.slo_ttft_s, sc.slo_itl_s),
        start_rate_per_s=sc.workload.rate_per_s,
        min_requests=100,
        duration_s=20.0,
        params=capped,
    )
    assert _goodput(told, "colocated x4") == pytest.approx(oracle.goodput_per_gpu, rel=0.2)
    assert _goodput(untold, "colocated x4") > 3 * oracle.goodput_per_gpu
    assert any("at most 4 requests at once" in line for line in told.assumptions)
