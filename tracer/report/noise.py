"""Step-time noise as measured: what the step fit leaves of each observed step, replayed by the simulator.

A fitted step cost is a mean; real steps scatter around it, and not alike: a decode-only step on a warm
batch scatters little, a step that runs a prefill chunk beside decodes more, and a slow step is often
followed by another (a neighbour's burst of work, a clock change: lag-1 autocorrelation 0.3-0.5 measured on
the reference server beside a busy core). `StepNoise` keeps each step kind's log residuals (log of observed
cycle time over the fit's price) in time order and whether they run in streaks; `NoiseDraws` gives one
simulation its factors: a step of kind k is multiplied by exp(a residual of kind k), drawn a block of
consecutive residuals at a time when they are correlated (so streaks of slow steps are replayed, not
averaged away), one at a time when they are not. Transfers keep a lognormal factor of the fit's spread.

Pure; numpy only. A `NoiseDraws` is one simulation's and not thread-safe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tracer.vocabulary import Stage

# A step that runs decodes only, prefill only, or both (a prefill's work beside running decodes).
DECODE, PREFILL, MIXED = str(Stage.DECODE), str(Stage.PREFILL), "mixed"
STEP_KINDS = (DECODE, PREFILL, MIXED)
# A kind needs this many residuals to be drawn from; with fewer, its steps take the lognormal spread.
MIN_KIND_RESIDUALS = 20
# Correlation is judged on at least this many consecutive pairs; with fewer, draws are independent.
MIN_PAIRS = 30


_DECODE_CODE, _PREFILL_CODE, _MIXED_CODE = (STEP_KINDS.index(kind) for kind in (DECODE, PREFILL, MIXED))


def step_kind(prefill_tokens: int, decode_requests: int) -> str:
    """One step's kind (step_kinds' rule, for a step at a time)."""
    if prefill_tokens <= 0:
        return DECODE
    return MIXED if decode_requests > 0 else PREFILL


def step_kinds(prefill_tokens: np.ndarray, decode_requests: np.ndarray) -> np.ndarray:
    """Every step's kind as its index in STEP_KINDS (int8: a million steps' kinds as strings cost seconds)."""
    mixed_or_prefill = np.where(decode_requests > 0, _MIXED_CODE, _PREFILL_CODE)
    return np.where(prefill_tokens <= 0, _DECODE_CODE, mixed_or_prefill).astype(np.int8)


@dataclass(frozen=True)
class StepNoise:
    """Measured step noise. `log_residuals[kind]`: that kind's residuals in time order, worker after worker;
    `weights[kind]`: how many steps each stands for (sampled spans), or None; `lag1_autocorrelation`: of
    consecutive steps' residuals on one worker (each kind's mean removed), NaN when there were too few
    pairs; `block_steps`: consecutive residuals drawn together (1: independent)."""

    log_residuals: dict[str, np.ndarray]
    weights: dict[str, np.ndarray] | None
    lag1_autocorrelation: float
    pairs: int
    block_steps: int

    def spread(self, kind: str) -> float:
        """Standard deviation of a kind's log residuals (NaN when it has too few to be drawn from)."""
        values = self.log_residuals.get(kind)
        return float(np.std(values)) if values is not None and len(values) >= MIN_KIND_RESIDUALS else float("nan")

    def as_json(self) -> dict[str, object]:
        return {
            "lag1_autocorrelation": None
            if math.isnan(self.lag1_autocorrelation)
            else round(self.lag1_autocorrelation, 3),
            "pairs": self.pairs,
            "block_steps": self.block_steps,
            "spread_by_kind": {
                kind: round(self.spread(kind), 4) for kind in STEP_KINDS if not math.isnan(self.spread(kind))
            },
        }


def measure_step_noise(
    worker: np.ndarray,
    start_ns: np.ndarray,
    kinds: np.ndarray,
    log_residuals: np.ndarray,
    weights: np.ndarray | None,
) -> StepNoise:
    """StepNoise from parallel arrays over the usable steps (`kinds` as step_kinds gives them).

    Residuals are judged correlated when the lag-1 autocorrelation of consecutive steps on one worker is
    positive and beyond two standard errors (2 / sqrt(pairs)); then blocks of n^(1/3) consecutive
    residuals (n: the most any kind has) are drawn together, the usual order for a block bootstrap. On
    sampled spans consecutive kept steps are not consecutive engine steps, so draws stay independent."""
    worker_index = np.zeros(len(worker), dtype=np.int64)
    for i, name in enumerate(set(worker.tolist())):  # a few workers: one comparison pass each
        worker_index[worker == name] = i
    order = np.lexsort((start_ns, worker_index))
    worker, kinds, log_residuals = worker_index[order], kinds[order], log_residuals[order]
    weights = None if weights is None else weights[order]
    centred = log_residuals.copy()
    by_kind: dict[str, np.ndarray] = {}
    kind_weights: dict[str, np.ndarray] | None = None if weights is None else {}
    for code, kind in enumerate(STEP_KINDS):
        mask = kinds == code
        if not mask.any():
            continue
        by_kind[kind] = log_residuals[mask]
        if kind_weights is not None and weights is not None:
            kind_weights[kind] = weights[mask]
        centred[mask] -= log_residuals[mask].mean()
    same_worker = worker[1:] == worker[:-1]
    pairs = int(same_worker.sum())
    lag1 = float("nan")
    if pairs >= MIN_PAIRS:
        a, b = centred[:-1][same_worker], centred[1:][same_worker]
        denominator = math.sqrt(float(np.sum(a * a)) * float(np.sum(b * b)))
        lag1 = float(np.sum(a * b)) / denominator if denominator > 0 else 0.0
    correlated = weights is None and not math.isnan(lag1) and lag1 > 2 / math.sqrt(pairs)
    longest = max((len(v) for v in by_kind.values()), default=0)
    block = max(1, math.ceil(longest ** (1 / 3))) if correlated else 1
    return StepNoise(by_kind, kind_weights, lag1, pairs, block)


_DRAW_BATCH = 4096


class NoiseDraws:
    """One simulation's time factors, seeded. Steps: from `measured` where its kind has residuals enough,
    else lognormal(0, `sigma`); transfers: lognormal(0, `sigma`). Each worker keeps its own position in
    each kind's residuals, so a block replays one streak on one worker."""

    def __init__(self, rng: np.random.Generator, sigma: float, measured: StepNoise | None) -> None:
        self._rng, self._sigma = rng, sigma
        self._kinds: dict[str, tuple[np.ndarray, np.ndarray | None]] = {}  # kind -> (factors, cumulative weights)
        self._block = 1
        if measured is not None:
            self._block = measured.block_steps
            for kind, values in measured.log_residuals.items():
                if len(values) >= MIN_KIND_RESIDUALS:
                    w = None if measured.weights is None else measured.weights[kind]
                    self._kinds[kind] = (np.exp(values), None if w is None else np.cumsum(w))
        # (worker, kind) -> [next index, steps left in its block]
        self._cursor: dict[tuple[int, str], list[int]] = {}
        # Draws made _DRAW_BATCH at a time (a million steps one numpy call each took seconds): kind -> indices
        # not yet used, and transfer factors likewise; popped from the end.
        self._indices: dict[str, list[int]] = {}
        self._lognormals: list[float] = []

    def step(self, worker: int, prefill_tokens: int, decode_requests: int) -> float:
        kind = step_kind(prefill_tokens, decode_requests)
        drawn = self._kinds.get(kind)
        if drawn is None:
            return self.wire()  # the fit's lognormal spread
        factors, cumulative = drawn
        if self._block == 1:
            return float(factors[self._index(kind, len(factors), cumulative)])
        cursor = self._cursor.setdefault((worker, kind), [0, 0])
        if cursor[1] == 0:
            cursor[0], cursor[1] = self._index(kind, len(factors), cumulative), self._block
        factor = float(factors[cursor[0]])
        cursor[0] = (cursor[0] + 1) % len(factors)
        cursor[1] -= 1
        return factor

    def _index(self, kind: str, n: int, cumulative: np.ndarray | None) -> int:
        """A residual's index of `kind`, each as likely as the steps it stands for."""
        left = self._indices.get(kind)
        if not left:
            if cumulative is None:
                drawn = self._rng.integers(0, n, _DRAW_BATCH)
            else:
                drawn = np.searchsorted(cumulative, self._rng.random(_DRAW_BATCH) * cumulative[-1], side="right")
                np.minimum(drawn, n - 1, out=drawn)
            left = self._indices[kind] = drawn.tolist()
        return left.pop()

    def wire(self) -> float:
        """A transfer's factor (and a step's of a kind without residuals): lognormal(0, sigma), 1 without a
        spread."""
        if self._sigma <= 0:
            return 1.0
        if not self._lognormals:
            self._lognormals = self._rng.lognormal(0.0, self._sigma, _DRAW_BATCH).tolist()
        return self._lognormals.pop()
