"""One observed deployment per oracle case: its truth table, the verdict it calls for, and its traces."""

from __future__ import annotations

from dataclasses import dataclass

from tests.oracle.cases import (
    CASES,
    HELD_TEXT,
    THROTTLED,
    Case,
    Expected,
    expected,
    gpu_cases,
    traffic,
    truth,
)
from tests.oracle.engine import Deployment, Run, serve

TRUTH_REQUESTS = 200
TRACE_REQUESTS = 200
LOAD_SHARE = 0.6  # the traced deployment runs at this share of its own goodput
NOISE_SIGMA = 0.03  # lognormal spread of iteration times in the traced run


@dataclass
class Observed:
    case: Case
    seed: int
    table: dict[str, tuple[Deployment, float]]
    expected: Expected
    run: Run
    rate_per_s: float


def observe(name: str, seed: int, margin: float) -> Observed:
    """The truth for case `name` at workload seed `seed`, and a traced run of its current deployment."""
    case = {
        THROTTLED.name: THROTTLED,
        HELD_TEXT.name: HELD_TEXT,
        **CASES,
        **gpu_cases(),
    }[name]
    table = truth(case, seed, TRUTH_REQUESTS)
    verdict = expected(case, table, margin)
    current_goodput = table[case.current.name][1] * case.current.gpus
    best_goodput = max(g for _, g in table.values()) * case.current.gpus
    # At a share of what the deployment sustains; a deployment that sustains nothing runs at a trickle.
    rate = LOAD_SHARE * (current_goodput if current_goodput > 0 else 0.1 * best_goodput)
    seen = traffic(case, TRACE_REQUESTS, seed + 1000)
    run = serve(
        case.current,
        seen.at(rate),
        seen.prompt_tokens,
        seen.output_tokens,
        case.physics,
        noise_sigma=NOISE_SIGMA,
        seed=seed,
        held_share=seen.held_share,
    )
    return Observed(case, seed, table, verdict, run, rate)
