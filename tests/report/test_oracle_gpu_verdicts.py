"""The report against the oracle's GPU-shaped costs (tests/oracle/gpu.py: an H200 serving Qwen3-32B with vLLM,
every iteration priced from aiconfigurator's kernel tables), from our full traces and from stock vLLM's spans
through sidecars: the operator names the hardware (roofline) and the model (its config.json), and the report
must name the oracle's very layout. A module of its own so the test runner can give it a core of its own.
"""

from __future__ import annotations

import pytest

from tests.oracle.cases import gpu_cases
from tests.report.conftest import oracle_options
from tests.report.oracle_checks import MARGIN, SEEDS, assert_matches_the_truth, table
from tracer.report.build import build_report


# GPU-shaped costs (an H200 serving Qwen3-32B with vLLM, priced from aiconfigurator's kernel tables), from
# our full traces and from stock vLLM's spans through sidecars (step costs estimated): the operator says the
# hardware is an accelerator (--step-model roofline), and the report must name the oracle's very layout,
# not one within a worker or a power of two of it.
@pytest.mark.parametrize("seed", SEEDS[:2])  # two seeds: a GPU case's truth costs several seconds of one core
@pytest.mark.parametrize("name", list(gpu_cases()))
@pytest.mark.parametrize("shape", ["full traces", "vLLM spans"])
def test_gpu_shaped_costs_reach_the_oracles_exact_layout(oracle_traces, name, seed, shape):
    seen, full, vllm_shaped = oracle_traces(name, seed, MARGIN)
    report = build_report([full if shape == "full traces" else vllm_shaped], oracle_options(seen))
    assert_matches_the_truth(seen, report)
    truth = seen.expected.best
    if truth == seen.case.current and truth.kind == "chunked" and shape == "vLLM spans":
        # Deployed chunked and best as it is: the report keeps it, its budget as inferred from vLLM's spans.
        assert report.recommended == report.current, table(seen, report)
        assert report.chunk_budget_tokens == pytest.approx(truth.budget_tokens, rel=0.05), table(seen, report)
    else:
        assert (report.ratio, report.chunk_budget_tokens) == (
            f"{truth.prefill_workers}:{truth.decode_workers}" if truth.kind == "split" else None,
            truth.budget_tokens or None,
        ), table(seen, report)
    assert any(line.startswith("roofline from the model's config") for line in report.assumptions), report.assumptions


def test_the_step_model_follows_the_traces_timing_source_when_not_told(oracle_traces):
    # Our tracer on a GPU times stages by CUDA events; `--step-model auto` (the default) then prices steps as
    # an accelerator's and reaches the oracle's very layout, as the operator's "roofline" does. Host-timed
    # traces (the CPU-shaped cases) stay linear.
    seen, full, _ = oracle_traces("gpu-chats", SEEDS[0], MARGIN)
    report = build_report([full], oracle_options(seen, step_model="auto"))
    told = build_report([full], oracle_options(seen))
    assert (report.verdict, report.ratio, report.chunk_budget_tokens) == (
        told.verdict,
        told.ratio,
        told.chunk_budget_tokens,
    )
    assert_matches_the_truth(seen, report)
    assert report.fits["step"] == told.fits["step"]
    assert any(line.startswith("step model: roofline, from the traces") for line in report.assumptions)
    host_seen, host_full, _ = oracle_traces("short-chats", SEEDS[0], MARGIN)
    host = build_report([host_full], oracle_options(host_seen, step_model="auto"))
    assert any(line.startswith("step model: linear, from the traces") for line in host.assumptions)
    assert host.fits["step"]["roofline_knee_tokens"] is None
    assert_matches_the_truth(host_seen, host)
