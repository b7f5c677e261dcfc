"""Synthetic traces for the report tests, generated once per session from the named ground truths."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.oracle.gpu import QWEN3_32B_CONFIG, GpuPhysics
from tests.synthetic import SYNTHETIC_ROUTER, Scenario, scenario, write_traces
from tracer.report.build import ReportOptions
from tracer.report.simulate import SLO

N_REQUESTS = 200  # small: every report test must stay quick on two cores


def quick_options(sc: Scenario, **overrides) -> ReportOptions:
    """Report options sized for tests: short simulations, otherwise the defaults the CLI uses."""
    values = dict(
        slo=SLO(sc.slo_ttft_s, sc.slo_itl_s),
        link_gbps=sc.link_gbps,
        sim_requests=100,
        sim_max_requests=5000,
        sim_duration_s=20.0,
        confidence_resamples=0,  # the bootstrap has its own tests (test_confidence.py)
        router=SYNTHETIC_ROUTER,  # how the synthetic deployments route: an operator knows their router
    )
    values.update(overrides)
    return ReportOptions(**values)


@pytest.fixture(scope="session")
def scenario_traces(tmp_path_factory):
    """name -> (Scenario, trace path, ground-truth SimResult); generated lazily."""
    cache: dict[str, tuple] = {}
    folder = tmp_path_factory.mktemp("scenarios")

    def get(name: str):
        if name not in cache:
            sc = scenario(name, n_requests=N_REQUESTS)
            path = Path(folder) / f"{name}.jsonl"
            truth = write_traces(path, sc.layout, sc.workload, sc.costs, noise_sigma=0.05, seed=7)
            cache[name] = (sc, path, truth)
        return cache[name]

    return get


def oracle_options(seen, **overrides) -> ReportOptions:
    """Report options for an oracle case: what its operator knows, short simulations, no bootstrap."""
    case = seen.case
    values = dict(
        slo=SLO(case.slo.ttft_s, case.slo.itl_s, case.slo.itl_stat, case.slo.attainment),
        # What an operator knows about the hardware: the link and the model's KV size.
        link_gbps=case.physics.link_bytes_per_s * 8 / 1e9,
        kv_bytes_per_token=case.physics.kv_bytes_per_token,
        margin=0.15,
        sim_requests=100,
        sim_max_requests=1000,
        sim_duration_s=10.0,
        confidence_resamples=0,
        # How the oracle's deployment routes: an operator knows their router, and their hardware.
        router=case.current.router,
        step_model="roofline" if isinstance(case.physics, GpuPhysics) else "linear",
        # ... and the model it serves (the GPU physics' tables price Qwen3-32B).
        model_config=str(QWEN3_32B_CONFIG) if isinstance(case.physics, GpuPhysics) else None,
    )
    values.update(overrides)
    return ReportOptions(**values)


@pytest.fixture(scope="session")
def oracle_traces(tmp_path_factory):
    """(case name, seed, margin) -> (Observed, full trace path, vLLM-shaped trace path): the
    independent oracle's truth and traces (tests/oracle), computed once per session."""
    from tests.oracle.observe import observe
    from tests.oracle.through_sidecar import write_via_sidecars
    from tests.oracle.traces import write_full

    cache: dict[tuple, tuple] = {}
    folder = Path(tmp_path_factory.mktemp("oracle"))

    def get(name: str, seed: int, margin: float):
        if (name, seed, margin) not in cache:
            seen = observe(name, seed, margin)
            full = folder / f"{name}-{seed}.jsonl"
            write_full(full, seen.run, seed)
            # Stock vLLM: one engine per sidecar (a P/D pair of instances per request when split).
            vllm_shaped = folder / f"{name}-{seed}-vllm.jsonl"
            write_via_sidecars(vllm_shaped, seen.run, seed)
            cache[(name, seed, margin)] = (seen, full, vllm_shaped)
        return cache[(name, seed, margin)]

    return get
