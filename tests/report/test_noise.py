"""Step noise as measured (tracer/report/noise.py, issue 28 point 2d): each step kind's residuals, whether
they run in streaks, and the simulator drawing them."""

from __future__ import annotations

import numpy as np
import pytest

from tracer.report.noise import DECODE, MIXED, PREFILL, STEP_KINDS, NoiseDraws, measure_step_noise

N = 3000


def _ar1(phi: float, sigma: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """A first-order autoregressive series: each value phi times the last plus fresh noise."""
    out = np.zeros(n)
    for i in range(1, n):
        out[i] = phi * out[i - 1] + rng.normal(0.0, sigma)
    return out


def _measure(residuals: np.ndarray, kinds: np.ndarray, weights: np.ndarray | None = None, workers: int = 1):
    """measure_step_noise over one worker's steps 1 ms apart; `kinds` by name."""
    worker = np.array([f"w{i % workers}" for i in range(len(residuals))], dtype=object)
    start_ns = np.arange(len(residuals), dtype=np.int64) * 1_000_000
    codes = np.array([STEP_KINDS.index(k) for k in kinds], dtype=np.int8)
    return measure_step_noise(worker, start_ns, codes, residuals, weights)


def test_streaks_of_slow_steps_are_found_and_drawn_in_blocks():
    rng = np.random.default_rng(1)
    noise = _measure(_ar1(0.5, 0.1, N, rng), np.full(N, DECODE))
    assert noise.lag1_autocorrelation == pytest.approx(0.5, abs=0.06)
    assert noise.block_steps == 15  # ceil(3000^(1/3))
    assert noise.as_json()["block_steps"] == 15


def test_independent_steps_are_drawn_one_at_a_time():
    rng = np.random.default_rng(2)
    noise = _measure(rng.normal(0.0, 0.1, N), np.full(N, DECODE))
    assert abs(noise.lag1_autocorrelation) < 0.06
    assert noise.block_steps == 1


def test_each_kind_keeps_its_own_spread_and_a_kinds_mean_is_no_streak():
    rng = np.random.default_rng(3)
    kinds = rng.choice(np.array([DECODE, MIXED, PREFILL]), N, p=[0.8, 0.15, 0.05])
    spread = {DECODE: 0.02, MIXED: 0.3, PREFILL: 0.1}
    # Mixed steps run 40% over the fit on average: a kind's offset, not a streak.
    residuals = np.array([rng.normal(0.4 if k == MIXED else 0.0, spread[k]) for k in kinds])
    noise = _measure(residuals, kinds)
    for kind, sigma in spread.items():
        assert noise.spread(kind) == pytest.approx(sigma, rel=0.2), kind
    assert noise.block_steps == 1
    draws = NoiseDraws(np.random.default_rng(0), 0.05, noise)
    decode = np.log([draws.step(0, 0, 8) for _ in range(2000)])
    mixed = np.log([draws.step(0, 256, 8) for _ in range(2000)])
    assert np.std(decode) == pytest.approx(0.02, rel=0.2) and abs(np.mean(decode)) < 0.005
    assert np.std(mixed) == pytest.approx(0.3, rel=0.2) and np.mean(mixed) == pytest.approx(0.4, abs=0.05)
    # Every drawn factor is one that was measured for that kind.
    assert set(np.round(decode, 9)) <= set(np.round(noise.log_residuals[DECODE], 9))


def test_a_block_replays_consecutive_residuals_on_one_worker():
    rng = np.random.default_rng(4)
    noise = _measure(_ar1(0.6, 0.1, N, rng), np.full(N, DECODE))
    series = noise.log_residuals[DECODE]
    draws = NoiseDraws(np.random.default_rng(5), 0.0, noise)
    drawn = np.log([draws.step(7, 0, 4) for _ in range(noise.block_steps)])
    start = int(np.flatnonzero(np.isclose(series, drawn[0]))[0])
    assert np.allclose(drawn, np.take(series, range(start, start + noise.block_steps), mode="wrap"))


def test_sampled_spans_are_drawn_independently_and_by_weight():
    rng = np.random.default_rng(6)
    residuals = _ar1(0.5, 0.1, N, rng)
    weights = np.where(np.arange(N) % 2 == 0, 10.0, 1.0)
    noise = _measure(residuals, np.full(N, DECODE), weights)
    assert noise.block_steps == 1  # kept spans are not consecutive engine steps
    draws = NoiseDraws(np.random.default_rng(7), 0.0, noise)
    drawn = np.round(np.log([draws.step(0, 0, 4) for _ in range(4000)]), 9)
    heavy = set(np.round(noise.log_residuals[DECODE][noise.weights[DECODE] == 10.0], 9))
    assert np.mean([d in heavy for d in drawn]) == pytest.approx(10 / 11, abs=0.03)


def test_a_kind_with_too_few_residuals_takes_the_lognormal_spread():
    kinds = np.array([DECODE] * 500 + [PREFILL] * 5)
    noise = _measure(np.zeros(505), kinds)
    draws = NoiseDraws(np.random.default_rng(8), 0.2, noise)
    assert all(draws.step(0, 0, 3) == 1.0 for _ in range(50))  # decode residuals are all zero
    prefill = np.log([draws.step(0, 512, 0) for _ in range(2000)])
    assert np.std(prefill) == pytest.approx(0.2, rel=0.1)


def test_the_report_states_the_measured_noise(scenario_traces):
    from tests.report.conftest import quick_options
    from tracer.report.build import build_report

    sc, path, _ = scenario_traces("chatty")
    report = build_report([path], quick_options(sc))
    noise = report.fits["step"]["noise"]
    # The synthetic traces' steps vary by independent lognormal factors (sigma 0.05): no streaks.
    assert noise["block_steps"] == 1 and abs(noise["lag1_autocorrelation"]) < 0.1
    assert noise["spread_by_kind"]["decode"] == pytest.approx(0.05, rel=0.3)
