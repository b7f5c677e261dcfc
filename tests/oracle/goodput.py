"""The oracle's goodput: the highest request rate per GPU at which a deployment, served by the oracle
engine, keeps the SLO attainment target (DistServe's definition), found by doubling then bisection over
the same requests with their arrival times stretched. Blocking, pure Python."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tests.oracle.engine import Deployment, Physics, serve

_DOUBLINGS = 10
_BISECTIONS = 5  # a 2x bracket narrowed to 3%: margins between verdicts are 15%


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    itl_s: float
    itl_stat: str  # p99 | max | mean
    attainment: float = 0.9


@dataclass(frozen=True)
class Traffic:
    """Requests at a mean rate of one per second; `at(rate)` stretches their arrivals to another rate."""

    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    held_share: float = 0.0  # tokens the front end holds back a step (the text's, not the layout's)

    def at(self, rate_per_s: float) -> np.ndarray:
        return self.arrival_s / rate_per_s


def attainment(deployment: Deployment, traffic: Traffic, rate_per_s: float, physics: Physics, slo: Slo) -> float:
    run = serve(
        deployment,
        traffic.at(rate_per_s),
        traffic.prompt_tokens,
        traffic.output_tokens,
        physics,
        record=False,
        held_share=traffic.held_share,
    )
    return run.attainment(slo.ttft_s, slo.itl_s, slo.itl_stat)


def goodput_per_gpu(
    deployment: Deployment, traffic: Traffic, physics: Physics, slo: Slo, start_rate_per_s: float
) -> float:
    """Requests/s per GPU; 0 when even a trickle misses the target."""

    def holds(rate: float) -> bool:
        return attainment(deployment, traffic, rate, physics, slo) >= slo.attainment

    low, high = None, None
    rate = start_rate_per_s
    for _ in range(_DOUBLINGS):
        if holds(rate):
            low = rate
            if high is not None:
                break
            rate *= 2
        else:
            high = rate
            if low is not None:
                break
            rate /= 2
    if low is None:
        return 0.0
    if high is None:
        return low / deployment.gpus
    for _ in range(_BISECTIONS):
        middle = (low + high) / 2
        if holds(middle):
            low = middle
        else:
            high = middle
    return low / deployment.gpus
