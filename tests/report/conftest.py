"""Synthetic traces for the report tests, generated once per session from the named ground truths."""

from __future__ import annotations

from pathlib import Path

import pytest

from tracer.report.build import ReportOptions
from tracer.report.simulate import SLO
from tracer.report.synthetic import Scenario, scenario, write_traces

N_REQUESTS = 200  # small: every report test must stay quick on two cores


def quick_options(sc: Scenario, **overrides) -> ReportOptions:
    """Report options sized for tests: short simulations, otherwise the defaults the CLI uses."""
    values = dict(
        slo=SLO(sc.slo_ttft_s, sc.slo_itl_s), link_gbps=sc.link_gbps, sim_requests=100, sim_max_requests=5000, sim_duration_s=20.0,
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
