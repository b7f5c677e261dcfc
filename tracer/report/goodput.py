"""Goodput search (DistServe): the highest request rate per GPU at which the SLO attainment target holds.

Every candidate rate replays the same resampled requests and arrival pattern, only stretched in time
(common random numbers), so attainment falls almost monotonically with rate and bisection is sound.
Pure computation; blocking.
"""

from __future__ import annotations

from dataclasses import dataclass

from tracer.report.simulate import SLO, Costs, EngineParams, Layout, SimResult, Workload, simulate

_BRACKET_STEPS = 12  # doublings/halvings: a factor of 4096 either way from the starting rate
_BISECT_STEPS = 9  # a 2x bracket narrowed to about 0.2%


@dataclass(frozen=True)
class GoodputResult:
    layout: Layout
    rate_per_s: float  # total requests/s the layout sustains at the attainment target
    goodput_per_gpu: float  # rate_per_s / GPUs
    at_rate: SimResult | None  # the simulation at that rate (None when even a trickle misses the SLOs)
    simulations: int


def search_goodput(
    layout: Layout,
    workload: Workload,
    costs: Costs,
    slo: SLO,
    *,
    start_rate_per_s: float,
    min_requests: int = 100,
    duration_s: float = 30.0,
    params: EngineParams = EngineParams(),
    bisect_steps: int = _BISECT_STEPS,
) -> GoodputResult:
    """Bisect the highest total arrival rate whose simulated attainment is at least `slo.attainment`.

    `workload` is the request sample to replay (its own rate is irrelevant; it is rescaled). Each run
    replays a prefix of it long enough to cover `duration_s` of arrivals (at least `min_requests`, at most
    all of it), so an overload shows as a growing queue rather than hiding in a short burst.
    """
    runs = 0

    def passes(rate: float) -> SimResult | None:
        nonlocal runs
        runs += 1
        n = int(min(len(workload), max(min_requests, rate * duration_s)))
        result = simulate(layout, workload.head(n).scaled_to_rate(rate), costs, slo, params=params)
        return result if (result.attainment or 0.0) >= slo.attainment else None

    rate = max(start_rate_per_s, 1e-6)
    best = passes(rate)
    if best is not None:
        low, high = rate, None
        for _ in range(_BRACKET_STEPS):
            trial = low * 2
            outcome = passes(trial)
            if outcome is None:
                high = trial
                break
            low, best = trial, outcome
        if high is None:  # saturates nothing within the bracket; report the bracket's top
            return GoodputResult(layout, low, low / layout.gpus, best, runs)
    else:
        high, low = rate, None
        for _ in range(_BRACKET_STEPS):
            trial = high / 2
            outcome = passes(trial)
            if outcome is not None:
                low, best = trial, outcome
                break
            high = trial
        if low is None:
            return GoodputResult(layout, 0.0, 0.0, None, runs)
    assert low is not None and high is not None  # both brackets above leave a passing and a failing rate
    for _ in range(bisect_steps):
        middle = (low + high) / 2
        outcome = passes(middle)
        if outcome is None:
            high = middle
        else:
            low, best = middle, outcome
    return GoodputResult(layout, low, low / layout.gpus, best, runs)
