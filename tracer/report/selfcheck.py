"""The report checks itself before it recommends anything (architecture.md §7), and asks whether a miss matters.

Three tests, all stated in the report: the fitted model, replayed on the observed layout and requests,
must land within a tolerance of what was measured (TTFT p50 and p90, and p50 and p90 of the per-request
inter-token statistic the SLO uses; with an engine's gap histogram, every gap's p50/p90/p99), it must
predict the SLO attainment at the observed rate within ATTAINMENT_TOLERANCE, and the step fit must explain
the step times (R^2 at least a floor, or a typical step priced within MAX_STEP_TYPICAL_MISS).

Not every miss can change the answer. `judge` sorts them:

- a quantile miss matters when the span from its predicted to its measured value reaches within
  NEAR_SLO_SHARE..1/NEAR_SLO_SHARE of its SLO (at least half the objective, at most twice it, or straddling
  it); a miss far below the objective (or far above it) moves no request across it. Nor does one that
  straddles the objective while the model's share of requests over it lies inside what the run's requests
  resolve of the measured share (the 95% Wilson interval): when prefills stall some requests' decodes and
  not others, the per-request ITL is two-humped, and a quantile between the humps jumps from one to the
  other as a request or two cross (bursts of long prompts on the reference server: p90 predicted 0.027 s vs
  measured 0.155 s under a 0.1 s objective, with 7.0% vs 11.3% of 71 requests over it). A miss near the
  objective on one side of it still matters: it is the headroom the goodput search spends at higher rates;
- an attainment miss (predicted vs measured share of requests meeting both SLOs, by more than
  ATTAINMENT_TOLERANCE and outside what the number of requests resolves) always matters;
- a step fit under the R^2 floor that also misses a typical step by more than MAX_STEP_TYPICAL_MISS always
  matters and refuses the answer outright: its costs explain too little of the data for any correction to
  stand on. Under the floor but close to every step, it is stated and does not matter (steady traffic has
  little variance to explain).

A miss that matters is corrected the way Dynamo's planner corrects its profile: per quantity, observed over
predicted (`Correction`), and the decision is taken again against the objective the model must meet for the
deployment to meet the real one (`Correction.slo`). The caller (build.py) answers only when that corrected
decision agrees. Pure computation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import StrEnum

from tracer.report.simulate import SLO

# A prediction within this share of the measurement (or within the absolute floor, below which a
# difference is timer jitter and a frontend's rounding rather than a model miss) passes.
TOLERANCE = 0.35  # the error the simulator is held to on a real reference-server run (test_simulator_vs_server)
TOLERANCE_FLOOR_S = 0.005
# The step fit must explain at least this share of the variance of observed (or estimated) step times...
MIN_STEP_R2 = 0.8
# ...unless it misses a typical step by less than this (the fit's `typical_miss`, the mean |log(observed /
# predicted)|). R^2 is a share of the variance there is: steady traffic runs batches of one size or two, its
# step times vary by the machine's noise alone, and R^2 says nothing of the costs. Measured here (busy 2-core
# CPU, reference server, every step span): steady short chats R^2 0.12 with a typical miss of 0.25; bursts of
# long prompts R^2 0.86, typical miss 0.30; the oracle's GPU throttled to a third every other 5 s R^2 0.66,
# typical miss 0.50 (the case the floor is for: costs that cannot price the steps).
MAX_STEP_TYPICAL_MISS = 0.4
# The same for step costs estimated from request spans (stock vLLM, SGLang): each of their targets is one
# request's mean step over its decode window, tens to hundreds of steps, so a fit that prices the steps
# misses those means by far less than it misses single steps. Measured on the oracle's spans through real
# sidecars: an H200's flat, memory-bound decode steps (R^2 0.01-0.41, the means barely vary) typical miss
# 0.004-0.006; short chats 0.007 and bursts 0.016 (R^2 0.96-1.0); the GPU throttled to a third every other
# 5 s (R^2 0.00-0.07) 0.34-0.36, which must refuse.
MAX_ESTIMATED_TYPICAL_MISS = 0.1
# A quantile miss can move requests across the objective only when it comes within this factor of it.
NEAR_SLO_SHARE = 0.5
# Predicted and measured attainment at the observed rate may differ by this much (a share of requests):
# about what 200 requests' sampling noise allows at a 90% target.
ATTAINMENT_TOLERANCE = 0.10
# Fewer requests resolve less: a predicted attainment inside the 95% Wilson score interval of the measured
# share (over `attainment_requests` requests) is no miss, whatever the points. Six requests meeting the
# objective four times cannot tell 67% from 85% (a slow-link phase of a test run here was refused so).
WILSON_Z = 1.96
# A miss beyond this factor is not a model that is a little off but one that is wrong: a mattering miss
# past it refuses (no correction is tried), and a correction's factors stay within it.
MAX_CORRECTION = 4.0

CHECKED = (("TTFT p50", "ttft_p50_s"), ("TTFT p90", "ttft_p90_s"), ("ITL p50", "itl_p50_s"), ("ITL p90", "itl_p90_s"))
# With an engine's gap histogram (--metrics-file): quantiles of every gap, each against the bucket that holds
# the measured one, widened by the same tolerance (a bucket is as precise as the histogram gets).
GAP_QUANTILES = (50, 90, 99)


class Outcome(StrEnum):
    """How the self-check ended; `self_check.outcome` in the report."""

    PASSED = "passed"  # no miss
    MISSES_DO_NOT_MATTER = "misses-do-not-matter"  # misses, none able to change the verdict
    CORRECTED_SAME_VERDICT = "corrected-same-verdict"  # corrected, and the corrected decision agrees
    REFUSED_FLIPS = "refused-flips"  # the corrected decision is another one
    REFUSED_MARGIN = "refused-margin"  # the corrected decision keeps the layout: the change's win is under the margin
    # the step fit explains too little, a miss that matters is off by more than MAX_CORRECTION, or there is
    # nothing to correct a miss that matters by
    REFUSED_FIT = "refused-fit"


@dataclass(frozen=True)
class Correction:
    """Observed over predicted, per quantity (1.0: no correction): 1.5 means the model underpredicts by 1.5x."""

    ttft_factor: float = 1.0
    itl_factor: float = 1.0

    def slo(self, slo: SLO) -> SLO:
        """The objective the model must meet for the deployment to meet `slo`: each threshold divided by its
        factor (a model 1.5x too quick on ITL is judged against itl_s / 1.5). Attainment and statistic stay."""
        return replace(slo, ttft_s=slo.ttft_s / self.ttft_factor, itl_s=slo.itl_s / self.itl_factor)

    def describe(self) -> str:
        return f"TTFT x{self.ttft_factor:.3g}, ITL x{self.itl_factor:.3g} (observed over predicted)"


@dataclass(frozen=True)
class Judgement:
    """What the self-check found. `misses`: every miss, as stated in the report; `mattering`: those that can
    change the verdict; `refusals`: those that stop the answer outright (no correction is tried);
    `harmless`: one line per miss that does not matter, saying why; `correction`: observed over predicted
    from the mattering misses, None when none matters, a refusal stands, or nothing corrects them."""

    misses: list[str] = field(default_factory=list)
    mattering: list[str] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)
    harmless: list[str] = field(default_factory=list)
    correction: Correction | None = None


@dataclass(frozen=True)
class _Miss:
    """One quantile the model misses: its words, the quantity it measures, the predicted value, the measured
    one (for a histogram bucket, the edge nearest the prediction) and the SLO threshold of its quantity."""

    text: str
    quantity: str  # "ttft" | "itl"
    predicted_s: float
    measured_s: float
    slo_s: float
    per_request: bool = True  # a quantile over requests' statistics; False: over every gap (a histogram's)

    @property
    def matters(self) -> bool:
        low, high = sorted((self.predicted_s, self.measured_s))
        return high >= NEAR_SLO_SHARE * self.slo_s and low <= self.slo_s / NEAR_SLO_SHARE

    @property
    def straddles(self) -> bool:
        """One of predicted and measured is over the objective and the other is not."""
        return (self.predicted_s > self.slo_s) != (self.measured_s > self.slo_s)

    @property
    def factor(self) -> float:
        if self.predicted_s <= 0:
            return MAX_CORRECTION
        return min(max(self.measured_s / self.predicted_s, 1 / MAX_CORRECTION), MAX_CORRECTION)

    @property
    def beyond_correction(self) -> bool:
        """Off by more than MAX_CORRECTION either way: no factor can stand for this model."""
        if self.predicted_s <= 0 or self.measured_s <= 0:
            return True
        return not 1 / MAX_CORRECTION <= self.measured_s / self.predicted_s <= MAX_CORRECTION

    @property
    def distance(self) -> float:
        """How far the measurement sits from the objective, in log terms (0: on it)."""
        return abs(math.log(max(self.measured_s, 1e-12) / self.slo_s))


def describe_tolerance() -> str:
    return (
        f"within {TOLERANCE:.0%} (or {TOLERANCE_FLOOR_S * 1e3:g} ms) of the measured, attainment within "
        f"{ATTAINMENT_TOLERANCE * 100:g} points, step fit R^2 >= {MIN_STEP_R2:g}"
    )


def judge(
    check: dict[str, float],
    step_r2: float | None,
    slo: SLO,
    step_typical_miss: float | None = None,
    typical_miss_limit: float = MAX_STEP_TYPICAL_MISS,
) -> Judgement:
    """Sort the model check's misses (build.model_check's keys) into those that matter and those that do
    not, and the correction the mattering ones call for (module docstring). `step_typical_miss`: the step
    fit's `typical_miss` (None: unknown, R^2 alone decides); `typical_miss_limit`: the most it may be for a
    fit under the R^2 floor to stand (MAX_STEP_TYPICAL_MISS, or MAX_ESTIMATED_TYPICAL_MISS for an estimate)."""
    quantiles = _quantile_misses(check, slo) + _gap_misses(check, slo)
    attainment = _attainment_miss(check)
    fit = _fit_miss(step_r2, step_typical_miss, typical_miss_limit)
    # Why each straddling per-request quantile moves no request across its objective (None: it may).
    crossing = [_shares_over_slo(check, m.quantity) if m.straddles and m.per_request else None for m in quantiles]
    matters = [m.matters and why is None for m, why in zip(quantiles, crossing)]
    misses = [m.text for m in quantiles] + [r for r in (attainment, fit) if r]
    mattering = [m.text for m, yes in zip(quantiles, matters) if yes] + [r for r in (attainment, fit) if r]
    refusals = [fit] if fit else []
    refusals += [
        f"{m.text}: off by more than {MAX_CORRECTION:g}x, a model that is wrong here, not a little off"
        for m, yes in zip(quantiles, matters)
        if yes and m.beyond_correction
    ]
    harmless = [
        f"{m.text}: does not matter, " + (why or _why_harmless(m, check if attainment is None else {}))
        for m, yes, why in zip(quantiles, matters, crossing)
        if not yes
    ]
    low_r2 = _low_r2_with_small_residuals(step_r2, step_typical_miss, typical_miss_limit)
    if low_r2:
        harmless.append(low_r2)
    correction = None
    if mattering and not refusals:
        correction = _correction(quantiles, [m for m, yes in zip(quantiles, matters) if yes], attainment is not None)
    return Judgement(misses, mattering, refusals, harmless, correction)


def _quantile_misses(check: dict[str, float], slo: SLO) -> list[_Miss]:
    out = []
    for label, key in CHECKED:
        predicted, measured = check.get(f"predicted_{key}"), check.get(f"measured_{key}")
        if predicted is None or measured is None or not (math.isfinite(predicted) and math.isfinite(measured)):
            continue
        if abs(predicted - measured) <= max(TOLERANCE * measured, TOLERANCE_FLOOR_S):
            continue
        label = label.replace("ITL", f"ITL {slo.itl_stat}")
        quantity = "ttft" if key.startswith("ttft") else "itl"
        text = (
            f"model check misses on the current layout: predicted {label} {predicted:.3g} s vs measured {measured:.3g} s "
            f"(tolerance {TOLERANCE:.0%} or {TOLERANCE_FLOOR_S * 1e3:g} ms)"
        )
        out.append(_Miss(text, quantity, predicted, measured, slo.ttft_s if quantity == "ttft" else slo.itl_s))
    return out


def _gap_misses(check: dict[str, float], slo: SLO) -> list[_Miss]:
    out = []
    for q in GAP_QUANTILES:
        predicted = check.get(f"predicted_gap_p{q}_s")
        low, high = check.get(f"measured_gap_p{q}_low_s"), check.get(f"measured_gap_p{q}_high_s")
        if predicted is None or low is None or high is None:
            continue
        if low * (1 - TOLERANCE) - TOLERANCE_FLOOR_S <= predicted <= high * (1 + TOLERANCE) + TOLERANCE_FLOOR_S:
            continue
        text = (
            f"model check misses the engine's own gaps (--metrics-file): predicted p{q} of every inter-token gap "
            f"{predicted:.3g} s vs the measured one in {low:.3g}-{high:.3g} s (tolerance {TOLERANCE:.0%} or "
            f"{TOLERANCE_FLOOR_S * 1e3:g} ms outside that bucket)"
        )
        # The bucket's edge nearest the prediction: the smallest correction the measurement supports.
        nearest = high if predicted > high else low
        if not math.isfinite(nearest):
            nearest = low
        out.append(_Miss(text, "itl", predicted, nearest, slo.itl_s, per_request=False))
    return out


def _attainment_miss(check: dict[str, float]) -> str | None:
    predicted, measured = check.get("predicted_attainment"), check.get("measured_attainment")
    if predicted is None or measured is None or not (math.isfinite(predicted) and math.isfinite(measured)):
        return None
    if abs(predicted - measured) <= ATTAINMENT_TOLERANCE:
        return None
    requests = check.get("attainment_requests")
    if requests is not None and requests >= 1:
        low, high = wilson_interval(measured, int(requests))
        if low <= predicted <= high:
            return None
        resolution = f", outside {low:.0%}-{high:.0%}, what {int(requests)} requests resolve"
    else:
        resolution = ""
    return (
        f"model check misses SLO attainment at the observed rate: predicted {predicted:.1%} vs measured {measured:.1%} "
        f"of requests within both SLOs (tolerance {ATTAINMENT_TOLERANCE * 100:g} points{resolution})"
    )


def wilson_interval(share: float, count: int, z: float = WILSON_Z) -> tuple[float, float]:
    """The Wilson score interval of a share observed over `count` trials (two-sided, `z` standard errors):
    unlike share +- z*SE it keeps its width at 0% and 100% and stays inside [0, 1]."""
    denominator = 1.0 + z * z / count
    centre = (share + z * z / (2 * count)) / denominator
    half = z / denominator * math.sqrt(share * (1.0 - share) / count + z * z / (4 * count * count))
    return max(0.0, centre - half), min(1.0, centre + half)


def _fit_miss(step_r2: float | None, step_typical_miss: float | None, limit: float) -> str | None:
    if step_r2 is None or step_r2 >= MIN_STEP_R2:
        return None
    if step_typical_miss is not None and step_typical_miss <= limit:
        return None
    spread = (
        "" if step_typical_miss is None else f", and it misses a typical step by {math.expm1(step_typical_miss):.0%}"
    )
    return f"the step fit explains too little of the step times: R^2 {step_r2:.3f} < {MIN_STEP_R2:g}{spread}"


def _low_r2_with_small_residuals(step_r2: float | None, step_typical_miss: float | None, limit: float) -> str | None:
    """The line that says why a step fit under the R^2 floor still stands (None when none is owed)."""
    if step_r2 is None or step_r2 >= MIN_STEP_R2 or step_typical_miss is None:
        return None
    if step_typical_miss > limit:
        return None
    return (
        f"the step fit's R^2 {step_r2:.3f} is under {MIN_STEP_R2:g}: does not matter, it misses a typical step by "
        f"{math.expm1(step_typical_miss):.0%} (at most {math.expm1(limit):.0%}); the step times vary "
        "little here, so there is little variance to explain"
    )


def _why_harmless(miss: _Miss, check: dict[str, float]) -> str:
    """Why `miss` cannot change the verdict; `check` empty when the attainment check has no word to add."""
    high = max(miss.predicted_s, miss.measured_s)
    where = "under half" if high < NEAR_SLO_SHARE * miss.slo_s else "over twice"
    said = f"both values are {where} the {miss.slo_s:.3g} s objective, so it moves no request across it"
    if "predicted_attainment" in check and "measured_attainment" in check:
        said += (
            f"; attainment at the observed rate agrees (predicted {check['predicted_attainment']:.1%} vs measured "
            f"{check['measured_attainment']:.1%})"
        )
    return said


def _shares_over_slo(check: dict[str, float], quantity: str) -> str | None:
    """Why a quantile miss near `quantity`'s objective moves no request across it, or None when it may:
    the model's share of requests over the objective lies inside the Wilson interval of the measured share
    (over the check's requests). None too when the check has no shares."""
    predicted, measured = check.get(f"predicted_{quantity}_over_slo"), check.get(f"measured_{quantity}_over_slo")
    requests = check.get("attainment_requests")
    if predicted is None or measured is None or requests is None or requests < 1:
        return None
    if not (math.isfinite(predicted) and math.isfinite(measured)):
        return None
    low, high = wilson_interval(measured, int(requests))
    if not low <= predicted <= high:
        return None
    return (
        f"the model puts {predicted:.1%} of requests over the {'TTFT' if quantity == 'ttft' else 'ITL'} objective "
        f"and the run measured {measured:.1%} ({low:.0%}-{high:.0%} is what {int(requests)} requests resolve): "
        "the quantile sits where a request or two crossing moves it far"
    )


def _correction(quantiles: list[_Miss], mattering: list[_Miss], use_any: bool) -> Correction | None:
    """Per quantity, the factor of its mattering miss nearest the objective (where a request's pass turns to
    fail); with an attainment miss, a quantity without one takes its miss nearest the objective, mattering
    or not. None when no miss gives a factor: there is nothing to correct by."""
    factors = {}
    for quantity in ("ttft", "itl"):
        own = [m for m in quantiles if m.quantity == quantity]
        candidates = [m for m in mattering if m.quantity == quantity] or (own if use_any else [])
        if candidates:
            factors[quantity] = min(candidates, key=lambda m: m.distance).factor
    if not factors or all(f == 1.0 for f in factors.values()):
        return None
    return Correction(factors.get("ttft", 1.0), factors.get("itl", 1.0))
