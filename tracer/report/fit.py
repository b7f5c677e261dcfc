"""Cost fits from traces: step time, prefill time, interference, KV transfer (numpy least squares).

Forms (DistServe): prefill = a + b*L + c*L^2 over uncached prompt tokens L; decode step =
a + b*sum(context) + c*batch; a mixed step adds the prefill part of its prefill tokens, so the
interference factor (mixed step over the decode-only step at equal batch and context) falls out.
Coefficients are kept non-negative by refitting without any term that comes out negative.

Without step spans (the sidecar's vLLM adapter) the step model is ESTIMATED from request overlap
(`tracer.report.estimate`); `StepFit.source` says which, and the report prints it as an assumption.
Pure computation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np

from tracer.report.model_shape import ModelShape
from tracer.report.noise import StepNoise, measure_step_noise, step_kinds
from tracer.report.simulate import StepCosts
from tracer.report.tables import RequestTable, StepTable, TransferTable

_STEP_TERMS = ("base_s", "context_s_per_token", "decode_s_per_request", "prefill_s_per_token", "prefill_s_per_token2")


@dataclass(frozen=True)
class LinearFit:
    coefficients: np.ndarray
    r2: float
    samples: int


def fit_nonnegative(features: np.ndarray, target: np.ndarray, weights: np.ndarray | None = None) -> LinearFit:
    """Least squares of `target` on the columns of `features`, dropping columns whose coefficient is negative
    (refit until none is). Columns never seen non-zero are dropped up front (their coefficient is 0).

    `weights` (one per row, e.g. how many steps a sampled span stands for) makes it weighted least squares,
    which on a weighted sample estimates the unweighted fit on the whole population; `r2` is weighted too."""
    n, k = features.shape
    w = np.ones(n) if weights is None else np.asarray(weights, dtype=float)
    root_w = np.sqrt(w)
    active = [j for j in range(k) if np.any(features[:, j] != 0)]
    coefficients = _dropping_negatives(
        active,
        k,
        lambda columns: np.linalg.lstsq(features[:, columns] * root_w[:, None], target * root_w, rcond=None)[0],
    )
    predicted = features @ coefficients
    residual = float(np.sum(w * (target - predicted) ** 2))
    total = float(np.sum(w * (target - np.average(target, weights=w)) ** 2)) if n else 0.0
    return LinearFit(coefficients, 1.0 - residual / total if total > 0 else 1.0, n)


def _dropping_negatives(active: list[int], k: int, solve: Callable[[list[int]], np.ndarray]) -> np.ndarray:
    """The k coefficients `solve` gives on the `active` columns, the column with the most negative one dropped
    and the rest solved again until none is negative (the dropped ones stay 0). Mutates `active`."""
    coefficients = np.zeros(k)
    while active:
        solution = solve(active)
        if not np.any(solution < 0):
            coefficients[active] = solution
            break
        active.remove(active[int(np.argmin(solution))])
    return coefficients


class NormalEquations:
    """`fit_nonnegative` of many targets on one design, each in O(rows x columns): the design's Gram matrix is
    formed once (columns scaled to unit weighted norm, so context tokens and tokens^2 sit beside a constant
    without losing precision), and each target costs one product with the design. The bootstrap refits a
    million step spans twenty times; through `lstsq` each refit took 0.2 s."""

    def __init__(self, design: np.ndarray, weights: np.ndarray | None) -> None:
        w = np.ones(len(design)) if weights is None else np.asarray(weights, dtype=float)
        self._active = [j for j in range(design.shape[1]) if np.any(design[:, j] != 0)]
        norms = np.sqrt(w @ (design * design))
        self._scale = np.where(norms > 0, norms, 1.0)
        scaled = design / self._scale
        self._weighted_t = (scaled * w[:, None]).T  # columns x rows
        self._gram = self._weighted_t @ scaled

    def solve(self, target: np.ndarray) -> np.ndarray:
        """Coefficients of `target` (one per design column): non-negative, a column dropped while its
        coefficient comes out negative, as `fit_nonnegative` does."""
        moment = self._weighted_t @ target
        coefficients = _dropping_negatives(
            list(self._active),
            len(self._scale),
            # lstsq, not solve: collinear columns (every prompt one length: tokens and tokens^2 are one
            # column) make the Gram matrix singular, and least squares then takes the least-norm solution.
            lambda columns: np.linalg.lstsq(self._gram[np.ix_(columns, columns)], moment[columns], rcond=None)[0],
        )
        return coefficients / self._scale


@dataclass(frozen=True)
class StepFit:
    costs: StepCosts
    source: str  # "step spans" | "estimated from request spans"
    r2: float
    samples: int
    interference_factor: float | None  # observed mean (mixed step / decode-only step at equal batch, context)
    interference_samples: int
    mixed_steps: int
    # Spread of observed step times around the fit: the sigma of log(observed / predicted). The simulator
    # multiplies each step by a lognormal factor of this sigma, so per-request tails (an ITL p99 is nearly
    # the worst of a request's gaps) are not predicted from the mean alone.
    noise_sigma: float = 0.0
    # The regression behind `costs`, for the residual bootstrap (`resampled`): its design matrix, target,
    # and which StepCosts field each column prices (the other fields stay as fitted).
    design: np.ndarray | None = field(default=None, repr=False)
    target: np.ndarray | None = field(default=None, repr=False)
    terms: tuple[str, ...] = ()
    weights: np.ndarray | None = field(default=None, repr=False)  # steps each row stands for; None: 1 each
    # The largest decode batch (requests) and context (tokens sum over the batch) of any fitted step: past
    # them the simulation extrapolates (the report says so). 0: not known (estimated fits).
    max_batch_seen: int = 0
    max_context_seen: int = 0
    # How far the fit misses a typical step: the mean of |log(observed / predicted)| (0.25: by about 28%).
    # Unlike `noise_sigma` (a median-based spread, blind to a minority of far-off steps) it grows with every
    # step the costs cannot price; the self-check reads it beside R^2. None: not known (estimated fits).
    typical_miss: float | None = None
    # Each step kind's residuals and whether they run in streaks (noise.py): what the model check and
    # `predict_attainment` multiply simulated steps by. None: not measured (estimated fits: lognormal).
    noise: StepNoise | None = field(default=None, repr=False)

    @cached_property
    def _normal_equations(self) -> NormalEquations:
        assert self.design is not None  # only `resampled` asks, after checking
        return NormalEquations(self.design, self.weights)

    def resampled(self, rng: np.random.Generator) -> StepCosts:
        """Costs refitted on fitted values plus residuals drawn with replacement (a residual bootstrap),
        the slope past the largest batch seen re-measured on the same draw (so the bootstrap's spread
        covers the extrapolation too)."""
        if self.design is None or self.target is None or not self.terms:
            return self.costs
        fitted = self.design @ np.array([getattr(self.costs, term) for term in self.terms])
        residuals = self.target - fitted
        # A residual stands for as many steps as its row: draw it that much more often.
        p = None if self.weights is None else self.weights / self.weights.sum()
        target = fitted + rng.choice(residuals, len(residuals), p=p)
        refit = self._normal_equations.solve(target)
        costs = replace(self.costs, **dict(zip(self.terms, (float(c) for c in refit))))
        if costs.gemm_knee_tokens > 0:  # the pass fit's tied costs follow theirs; the knee stays where it was
            fitted_costs = self.costs
            return replace(
                costs,
                context_s_per_token=costs.base_s * _ratio(fitted_costs.context_s_per_token, fitted_costs.base_s),
                prefill_s_per_token2=costs.prefill_s_per_token
                * _ratio(fitted_costs.prefill_s_per_token2, fitted_costs.prefill_s_per_token),
            )
        if costs.max_batch_seen <= 0:
            return costs
        if costs.roofline_knee_tokens > 0:
            return replace(costs, roofline_knee_tokens=roofline_knee_tokens(costs))
        return replace(costs, decode_s_per_request_beyond=beyond_slope_s(self.design, target, self.weights, costs))


def _ratio(part: float, whole: float) -> float:
    return part / whole if whole > 0 else 0.0


# The slope past the largest batch seen is measured on steps in the top part of the batch range: at least
# this many of them, over at least two distinct batch sizes, else the fitted slope is all there is.
_MIN_TOP_STEPS = 8
_TOP_SHARE = 0.5  # steps whose batch is at least this share of the largest


def beyond_slope_s(design: np.ndarray, target: np.ndarray, weights: np.ndarray | None, costs: StepCosts) -> float:
    """Seconds per extra request at the largest observed batches, never below the fitted slope.

    `design` has `fit_steps`' columns (1, context, batch, prefill tokens, attention) and `target` the step
    cycle times (seconds). What the other terms leave of each step is regressed on its batch (with an
    intercept) over the steps in the top half of the batch range: the marginal cost where the batch was
    largest, which is where a compute-bound knee would show."""
    batch = design[:, 2]
    largest = float(batch.max()) if len(batch) else 0.0
    top = batch >= max(1.0, np.ceil(_TOP_SHARE * largest))
    if top.sum() < _MIN_TOP_STEPS or len(np.unique(batch[top])) < 2:
        return costs.decode_s_per_request
    others = costs.context_s_per_token * design[:, 1] + costs.prefill_s_per_token * design[:, 3]
    left = target - others - costs.prefill_s_per_token2 * design[:, 4]
    root_w = np.ones(int(top.sum())) if weights is None else np.sqrt(weights[top])
    local = np.column_stack([np.ones(int(top.sum())), batch[top]]) * root_w[:, None]
    (_, slope), *_ = np.linalg.lstsq(local, left[top] * root_w, rcond=None)
    return max(costs.decode_s_per_request, float(slope))


# A step that starts within this long after its predecessor ended follows it back to back (the worker
# was busy): the time between them is the engine's own per-iteration overhead, part of the cycle.
BACK_TO_BACK_GAP_S = 0.005


def cycle_times_s(steps: StepTable) -> np.ndarray:
    """Each step's iteration time as the engine lived it: start to the next step's start on the same
    worker when the next one followed back to back, else the step's own duration. Scheduling, sampling
    and streaming between GPU (here CPU) steps cost the worker time the step spans do not cover."""
    cycle = steps.duration_s.astype(float).copy()
    for worker in set(steps.worker):
        index = np.flatnonzero(steps.worker == worker)
        index = index[np.argsort(steps.start_ns[index], kind="stable")]
        start_s = steps.start_ns[index] / 1e9
        until_next_s = np.diff(start_s)
        idle_s = until_next_s - steps.duration_s[index[:-1]]
        busy = (idle_s >= 0) & (idle_s <= BACK_TO_BACK_GAP_S)
        cycle[index[:-1][busy]] = until_next_s[busy]
        if steps.sampled and busy.any():
            # Sampled spans: most kept steps' successors were not exported, so their overhead is unseen.
            # Charge them the median overhead of the back-to-back pairs that were both kept (consecutive
            # prefill steps, a kept decode step next to one).
            overhead_s = float(np.median(idle_s[busy]))
            alone = np.ones(len(index), dtype=bool)
            alone[:-1] = ~busy
            alone[-1] = False  # the worker's last step: nothing followed it in the window either way
            cycle[index[alone]] += overhead_s
    return cycle


def _weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    if np.all(weights == 1):
        return float(np.median(values))
    order = np.argsort(values, kind="stable")
    cumulative = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cumulative, cumulative[-1] / 2)])


def _robust_sigma(values: np.ndarray, weights: np.ndarray) -> float:
    """Standard deviation from the (weighted) median absolute deviation: a few outlier steps (a collector
    pause, a first-call warm-up) would otherwise widen the noise every simulated step gets."""
    return 1.4826 * _weighted_median(np.abs(values - _weighted_median(values, weights)), weights)


STEP_MODELS = ("auto", "linear", "roofline")  # auto: chosen from the traces (build._step_model)
ROOFLINE_MAX_KNEE_TOKENS = 65536.0  # a prefill token priced at nothing would put the knee at infinity


def roofline_knee_tokens(costs: StepCosts) -> float:
    """Tokens at which a step's GEMMs turn compute-bound: the fixed cost of a step (the weights' read) over
    what one prefill token adds (a token's arithmetic), at least 1."""
    if costs.prefill_s_per_token <= 0:
        return ROOFLINE_MAX_KNEE_TOKENS
    return float(min(ROOFLINE_MAX_KNEE_TOKENS, max(1.0, costs.base_s / costs.prefill_s_per_token)))


def with_roofline(step_fit: StepFit) -> StepFit:
    """`step_fit` with a batch past the largest it saw priced as an accelerator runs it (StepCosts). The
    largest batch: the fitted steps' (step spans), else the largest time-averaged batch a request decoded
    with (estimated fits; their design's batch column, as fit_steps' third), rounded up."""
    largest = step_fit.max_batch_seen
    if largest <= 0 and step_fit.design is not None and len(step_fit.design):
        largest = int(np.ceil(np.nanmax(step_fit.design[:, 2])))
    if largest <= 0:
        return step_fit
    costs = replace(step_fit.costs, max_batch_seen=largest, roofline_knee_tokens=roofline_knee_tokens(step_fit.costs))
    return replace(step_fit, costs=costs, max_batch_seen=largest)


PASS_TERMS = ("base_s", "prefill_s_per_token", "prefill_floor_s")  # the columns `fit_passes` solves for
_KNEE_BOUNDS_TOKENS = (8.0, 32768.0)
_KNEE_ROUNDS = 30  # the knee settles within a few rounds on every trace tried; the bound only stops a cycle


def _pass_features(
    decode: np.ndarray, context: np.ndarray, prefill: np.ndarray, attention: np.ndarray, knee: float, shape: ModelShape
) -> np.ndarray:
    """`fit_passes`' columns at one knee: the weights' read with the KV read it implies (1 + context x the
    model's KV-to-weights ratio), the GEMM tokens past the knee with the attention they imply (pairs x the
    model's attention-to-GEMM arithmetic), and whether the step ran any prefill (its attention's floor)."""
    return np.column_stack(
        [
            1.0 + shape.kv_read_per_weight_read * context,
            np.maximum(0.0, decode + prefill - knee) + shape.attention_per_gemm_token * attention,
            (prefill > 0).astype(float),
        ]
    )


def fit_passes(
    decode: np.ndarray,
    context: np.ndarray,
    prefill: np.ndarray,
    attention: np.ndarray,
    cycle_s: np.ndarray,
    weights: np.ndarray,
    shape: ModelShape,
) -> tuple[StepCosts, LinearFit, np.ndarray]:
    """An accelerator's step, pass by pass, as its roofline runs it: (costs, fit, design). One row per step:
    its decode requests, their context tokens (summed), its prefill tokens and their attention (tokens^2),
    its time and how many steps it stands for.

    A step's GEMMs take the longer of reading the weights (`base_s`) and their arithmetic (a token's worth,
    `prefill_s_per_token`, per token the step runs: one per decode plus its prefill tokens), so the knee is
    where the two meet: base over per-token. Decodes read their KV cache at the weights' bandwidth, a
    prompt's attention runs at the GEMMs' FLOP rate (both ratios from the model's config), and a step with
    any prefill pays its attention kernels' floor. Three costs are fitted; the knee is found by fitting at
    a knee, moving it to where the fitted costs meet, and fitting again until it stays. Each step weighs by
    its relative miss (`weights` over its time squared), so a 20 ms decode step counts as much as a 2 s
    prefill: what the SLOs judge is small steps."""
    decode, context, prefill = (np.asarray(a, dtype=float) for a in (decode, context, prefill))
    relative = weights / np.maximum(cycle_s, 1e-6) ** 2
    knee = 256.0
    for _ in range(_KNEE_ROUNDS):
        design = _pass_features(decode, context, prefill, attention, knee, shape)
        fit = fit_nonnegative(design, cycle_s, relative)
        base, per_token = float(fit.coefficients[0]), float(fit.coefficients[1])
        moved = float(np.clip(base / per_token, *_KNEE_BOUNDS_TOKENS)) if per_token > 0 else _KNEE_BOUNDS_TOKENS[1]
        if abs(np.log(moved / knee)) < 0.005:
            break
        knee = moved
    base, per_token, floor = (float(c) for c in fit.coefficients)
    costs = StepCosts(
        base_s=base,
        context_s_per_token=base * shape.kv_read_per_weight_read,
        decode_s_per_request=0.0,  # a decode costs its token's GEMMs and its KV read: both priced above
        prefill_s_per_token=per_token,
        prefill_s_per_token2=per_token * shape.attention_per_gemm_token,
        gemm_knee_tokens=knee,
        prefill_floor_s=floor,
    )
    return costs, fit, design


def fit_steps(steps: StepTable, step_model: str = "linear", shape: ModelShape | None = None) -> StepFit:
    """Fit `StepCosts` to observed iteration cycle times (every pool together: they share the hardware).
    `step_model`: how a batch past the largest seen is priced (StepCosts: "linear" or "roofline"); a
    roofline with the model's `shape` known is fitted pass by pass (`fit_passes`).

    Each span weighs as many steps as it stands for (`StepTable.weight`): on sampled step spans the fit,
    the interference factor and the noise estimate what every step would give."""
    p = steps.prefill_tokens.astype(float)
    # The quadratic term is the chunks' attention over their prompts (tokens^2); a step span without it
    # is taken to hold one whole prompt, whose attention is P^2.
    attention = np.where(np.isnan(steps.prefill_attention_tokens2), p * p, steps.prefill_attention_tokens2)
    cycle_s = cycle_times_s(steps)
    weights = steps.weight.astype(float)
    max_batch = int(steps.decode_requests.max()) if len(steps) else 0
    terms: tuple[str, ...] = _STEP_TERMS
    if step_model == "roofline" and shape is not None and len(steps):
        costs, fit, features = fit_passes(
            steps.decode_requests, steps.context_tokens, p, attention, cycle_s, weights, shape
        )
        costs = replace(costs, max_batch_seen=max_batch)
        terms = PASS_TERMS
    else:
        features = np.column_stack(
            [np.ones(len(steps)), steps.context_tokens.astype(float), steps.decode_requests.astype(float), p, attention]
        )
        fit = fit_nonnegative(features, cycle_s, weights)
        costs = StepCosts(**dict(zip(_STEP_TERMS, (float(c) for c in fit.coefficients))))
        if max_batch > 0:
            row_weights = weights if steps.sampled else None
            beyond = beyond_slope_s(features, cycle_s, row_weights, costs)
            costs = replace(costs, max_batch_seen=max_batch, decode_s_per_request_beyond=beyond)
    mixed = (steps.prefill_tokens > 0) & (steps.decode_requests > 0)
    factor = None
    if mixed.any():
        batch = steps.decode_requests[mixed].astype(float)
        decode_part = (
            costs.base_s
            + costs.context_s_per_token * steps.context_tokens[mixed]
            + costs.decode_s_per_request * batch
            + costs.prefill_s_per_token * np.maximum(0.0, batch - costs.gemm_knee_tokens) * (costs.gemm_knee_tokens > 0)
        )
        factor = float(np.average(cycle_s[mixed] / np.maximum(decode_part, 1e-9), weights=weights[mixed]))
    predicted = features @ np.asarray(fit.coefficients, dtype=float)
    usable = (predicted > 0) & (cycle_s > 0)
    log_residuals = np.log(cycle_s[usable] / predicted[usable])
    noise_sigma = _robust_sigma(log_residuals, weights[usable]) if usable.sum() > 2 else 0.0
    kinds = step_kinds(steps.prefill_tokens[usable], steps.decode_requests[usable])
    noise = measure_step_noise(
        steps.worker[usable], steps.start_ns[usable], kinds, log_residuals, weights[usable] if steps.sampled else None
    )
    typical_miss = float(np.average(np.abs(log_residuals), weights=weights[usable])) if usable.sum() > 2 else None
    fitted = StepFit(
        costs,
        "step spans",
        fit.r2,
        fit.samples,
        factor,
        int(mixed.sum()),
        int(mixed.sum()),
        noise_sigma,
        features,
        cycle_s,
        terms,
        weights if steps.sampled else None,
        max_batch,
        int(steps.context_tokens.max()) if len(steps) else 0,
        typical_miss,
        noise,
    )
    return with_roofline(fitted) if step_model == "roofline" and shape is None else fitted


@dataclass(frozen=True)
class PrefillFit:
    """prefill_s = a_s + b_s_per_token * L + c_s_per_token2 * L^2 over uncached tokens (DistServe's form)."""

    a_s: float
    b_s_per_token: float
    c_s_per_token2: float
    r2: float
    samples: int


def fit_prefill(requests: RequestTable) -> PrefillFit | None:
    ok = ~np.isnan(requests.prefill_s) & ~requests.failed
    if ok.sum() < 3:
        return None
    tokens = np.maximum(requests.input_tokens[ok] - requests.cached_tokens[ok], 1).astype(float)
    fit = fit_nonnegative(np.column_stack([np.ones(len(tokens)), tokens, tokens * tokens]), requests.prefill_s[ok])
    a, b, c = (float(x) for x in fit.coefficients)
    return PrefillFit(a, b, c, fit.r2, fit.samples)


@dataclass(frozen=True)
class TransferFit:
    """Observed KV transfers: wire_s = constant_s + bytes / bandwidth_bytes_per_s."""

    bandwidth_bytes_per_s: float
    constant_s: float
    kv_bytes_per_token: float
    mean_exposed_s: float
    samples: int


def fit_transfers(transfers: TransferTable) -> TransferFit | None:
    if len(transfers) == 0:
        return None
    per_token = float(np.median(transfers.kv_bytes / np.maximum(transfers.prompt_tokens, 1)))
    bandwidth = float(transfers.kv_bytes.sum() / max(transfers.wire_s.sum(), 1e-12))
    constant = 0.0
    if len(transfers) >= 3 and np.ptp(transfers.kv_bytes) > 0:
        fit = fit_nonnegative(np.column_stack([np.ones(len(transfers)), transfers.kv_bytes]), transfers.wire_s)
        if fit.coefficients[1] > 0:
            constant, bandwidth = float(fit.coefficients[0]), 1.0 / float(fit.coefficients[1])
    return TransferFit(bandwidth, constant, per_token, float(transfers.exposed_s.mean()), len(transfers))
