"""The bootstrap's refits (fit.NormalEquations) against numpy's least squares (fit.fit_nonnegative, lstsq):
the same non-negative coefficients on step-shaped designs whose columns span ten orders of magnitude."""

from __future__ import annotations

import numpy as np
import pytest

from tracer.report.fit import NormalEquations, fit_nonnegative


def _steps(n: int, rng: np.random.Generator) -> np.ndarray:
    """Columns as fit_steps builds them: 1, context tokens, decode requests, prefill tokens, tokens^2."""
    prefill = rng.integers(0, 2048, n) * (rng.random(n) < 0.1)
    return np.column_stack(
        [np.ones(n), rng.uniform(0, 2e5, n), rng.integers(1, 64, n), prefill, prefill.astype(float) ** 2]
    )


@pytest.mark.parametrize("weighted", [False, True])
def test_refits_match_least_squares_with_and_without_weights(weighted):
    rng = np.random.default_rng(3)
    design = _steps(50_000, rng)
    weights = rng.integers(1, 10, len(design)).astype(float) if weighted else None
    solver = NormalEquations(design, weights)
    for draw in range(3):
        target = design @ [0.02, 1e-7, 1e-3, 5e-5, 1e-9] * rng.lognormal(0, 0.1, len(design))
        expected = fit_nonnegative(design, target, weights).coefficients
        assert solver.solve(target) == pytest.approx(expected, rel=1e-6, abs=1e-15), draw


def test_a_negative_coefficient_drops_its_column_as_least_squares_does():
    rng = np.random.default_rng(4)
    design = _steps(20_000, rng)
    target = design @ [0.02, 1e-7, 1e-3, 5e-5, 1e-9] - 0.05  # the intercept comes out negative
    expected = fit_nonnegative(design, target).coefficients
    assert expected[0] == 0.0
    assert NormalEquations(design, None).solve(target) == pytest.approx(expected, rel=1e-6, abs=1e-15)


def test_a_column_never_seen_stays_at_zero():
    rng = np.random.default_rng(5)
    design = _steps(5_000, rng)
    design[:, 3] = design[:, 4] = 0.0  # no prefill at all
    target = design @ [0.02, 1e-7, 1e-3, 0.0, 0.0]
    solved = NormalEquations(design, None).solve(target)
    assert solved[3] == solved[4] == 0.0
    assert solved[:3] == pytest.approx([0.02, 1e-7, 1e-3], rel=1e-6)


def test_collinear_columns_give_the_fit_least_squares_gives_not_an_error():
    # Every prompt 64 tokens long (bench/verdict_ab.py's chat shape): a step's attention is 64 x its prefill
    # tokens, the two columns are one, and the Gram matrix is singular.
    rng = np.random.default_rng(6)
    design = _steps(5_000, rng)
    design[:, 3] = 64.0 * (rng.random(len(design)) < 0.1)  # one 64-token prompt in a tenth of the steps
    design[:, 4] = design[:, 3] ** 2
    target = design @ [0.02, 1e-7, 1e-3, 5e-5, 1e-9] * rng.lognormal(0, 0.05, len(design))
    expected = fit_nonnegative(design, target)
    solved = NormalEquations(design, None).solve(target)
    assert design @ solved == pytest.approx(design @ expected.coefficients, rel=1e-6)
