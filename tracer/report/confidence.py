"""How sure the verdict is: the share of bootstrap re-runs that reach it (architecture.md §7).

Each re-run draws the requests again with replacement (Workload.resample), refits the step model on its
fitted values plus residuals drawn with replacement (StepFit.resampled), searches goodput again for the
layouts that matter to the verdict (the current one, plain colocated, the best chunked budget and the
two best splits), and decides with the same margin. A verdict that holds in 19 of 20 re-runs is
firm; one that flips in half of them is a near-tie, whatever its margin in the main run. Re-runs simulate
at most RERUN_DURATION_S of arrivals and bisect coarser than the main search (a bootstrap needs many
runs, each only precise enough to fall on one side of the margin). Blocking, CPU only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from tracer.report.decide import Decision, decide
from tracer.report.fit import StepFit
from tracer.report.goodput import GoodputResult, search_goodput
from tracer.report.simulate import SLO, Costs, EngineParams, Layout, Workload
from tracer.vocabulary import Mode, Verdict

MIN_RESAMPLES = 20
# Re-runs simulate at most this much (the main search may simulate more): twenty re-runs must cost a few
# main searches, not twenty.
RERUN_REQUESTS = 100
RERUN_DURATION_S = 10.0
RERUN_SAMPLE_REQUESTS = 1000
_RERUN_BISECT_STEPS = 5  # 3%: enough to tell which side of a 15% margin a re-run falls


@dataclass(frozen=True)
class Confidence:
    share: float  # re-runs reaching the same verdict (and ratio, for split / rebalance)
    resamples: int
    verdicts: dict[str, int]  # what the re-runs said


def _same(a: Decision, b: Decision) -> bool:
    if a.verdict != b.verdict:
        return False
    return a.ratio == b.ratio if a.verdict in (Verdict.SPLIT, Verdict.REBALANCE) else True


def _layouts_that_matter(current: Layout, results: list[GoodputResult]) -> list[Layout]:
    ranked = sorted(results, key=lambda r: -r.goodput_per_gpu)
    chosen = [current] + [r.layout for r in results if r.layout.mode == Mode.COLOCATED]
    chosen += [r.layout for r in ranked if r.layout.mode == Mode.CHUNKED][:1]
    chosen += [r.layout for r in ranked if r.layout.mode == Mode.DISAGGREGATED][:2]
    unique: dict[str, Layout] = {}
    for layout in chosen:
        unique.setdefault(layout.label, layout)
    return list(unique.values())


@dataclass(frozen=True)
class Decided:
    """A decision and what it was taken from: what a bootstrap takes again."""

    decision: Decision
    current: Layout
    results: list[GoodputResult]  # each candidate layout's goodput, simulated on `observed`
    observed: Workload
    step_fit: StepFit
    costs: Costs
    slo: SLO
    margin: float
    params: EngineParams
    merge_margin: float | None = None  # decide's: None, the margin


@dataclass(frozen=True)
class RerunSize:
    """How much each re-run simulates: at least `min_requests` over `duration_s` of arrivals, drawn from
    `sample_requests` resampled requests."""

    min_requests: int = RERUN_REQUESTS
    duration_s: float = RERUN_DURATION_S
    sample_requests: int = RERUN_SAMPLE_REQUESTS


def bootstrap(
    decided: Decided, resamples: int = MIN_RESAMPLES, seed: int = 0, size: RerunSize = RerunSize()
) -> Confidence:
    """Re-run the decision `resamples` times on resampled requests and refitted costs."""
    rng = np.random.default_rng(seed)
    current, results, observed = decided.current, decided.results, decided.observed
    layouts = _layouts_that_matter(current, results)
    # Each re-run starts its search at the main run's answer for that layout: a resample moves it a little.
    main_rates = {r.layout.label: r.rate_per_s for r in results}
    start_rates = {
        layout.label: max(main_rates.get(layout.label, 0.0), observed.rate_per_s, 1e-3) for layout in layouts
    }
    said: dict[str, int] = {}
    agree = 0
    for k in range(resamples):
        sample = observed.resample(size.sample_requests, seed + 1 + k)
        run_costs = replace(decided.costs, step=decided.step_fit.resampled(rng))
        rerun = [
            search_goodput(
                layout,
                sample,
                run_costs,
                decided.slo,
                start_rate_per_s=start_rates[layout.label],
                min_requests=size.min_requests,
                duration_s=size.duration_s,
                params=decided.params,
                bisect_steps=_RERUN_BISECT_STEPS,
            )
            for layout in layouts
        ]
        again = decide(current, rerun, decided.margin, decided.merge_margin)
        said[again.verdict] = said.get(again.verdict, 0) + 1
        agree += _same(again, decided.decision)
    return Confidence(agree / resamples if resamples else float("nan"), resamples, said)
