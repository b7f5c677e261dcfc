"""The report checks itself before it recommends anything (DESIGN section 7).

Two tests, both stated in the report: the fitted model, replayed on the observed layout and requests,
must land within a tolerance of what was measured (TTFT p50 and p90, and p50 and p90 of the per-request
inter-token statistic the SLO uses), and the step fit must explain the step times (R^2 at least a floor).
A report that fails either says `insufficient-data` with the reasons, and shows its best guess as
unconfirmed. Pure computation.
"""

from __future__ import annotations

import math

# A prediction within this share of the measurement (or within the absolute floor, below which a
# difference is timer jitter and a frontend's rounding rather than a model miss) passes.
TOLERANCE = 0.35  # the error the simulator is held to on a real reference-server run (test_simulator_vs_server)
TOLERANCE_FLOOR_S = 0.005
# The step fit must explain at least this share of the variance of observed (or estimated) step times.
MIN_STEP_R2 = 0.8

CHECKED = (("TTFT p50", "ttft_p50_s"), ("TTFT p90", "ttft_p90_s"), ("ITL p50", "itl_p50_s"), ("ITL p90", "itl_p90_s"))
# With an engine's gap histogram (--metrics-file): quantiles of every gap, each against the bucket that holds
# the measured one, widened by the same tolerance (a bucket is as precise as the histogram gets).
GAP_QUANTILES = (50, 90, 99)


def describe_tolerance() -> str:
    return (
        f"within {TOLERANCE:.0%} (or {TOLERANCE_FLOOR_S * 1e3:g} ms) of the measured, step fit R^2 >= {MIN_STEP_R2:g}"
    )


def misses(check: dict[str, float], step_r2: float | None, itl_stat: str) -> list[str]:
    """Reasons the model cannot be trusted on this data; empty when it passes."""
    reasons = []
    for label, key in CHECKED:
        predicted, measured = check.get(f"predicted_{key}"), check.get(f"measured_{key}")
        if predicted is None or measured is None or not (math.isfinite(predicted) and math.isfinite(measured)):
            continue
        if abs(predicted - measured) > max(TOLERANCE * measured, TOLERANCE_FLOOR_S):
            label = label.replace("ITL", f"ITL {itl_stat}")
            reasons.append(
                f"model check misses on the current layout: predicted {label} {predicted:.3g} s vs measured {measured:.3g} s "
                f"(tolerance {TOLERANCE:.0%} or {TOLERANCE_FLOOR_S * 1e3:g} ms)"
            )
    reasons += _gap_misses(check)
    if step_r2 is not None and step_r2 < MIN_STEP_R2:
        reasons.append(f"the step fit explains too little of the step times: R^2 {step_r2:.3f} < {MIN_STEP_R2:g}")
    return reasons


def _gap_misses(check: dict[str, float]) -> list[str]:
    reasons = []
    for q in GAP_QUANTILES:
        predicted = check.get(f"predicted_gap_p{q}_s")
        low, high = check.get(f"measured_gap_p{q}_low_s"), check.get(f"measured_gap_p{q}_high_s")
        if predicted is None or low is None or high is None:
            continue
        if low * (1 - TOLERANCE) - TOLERANCE_FLOOR_S <= predicted <= high * (1 + TOLERANCE) + TOLERANCE_FLOOR_S:
            continue
        reasons.append(
            f"model check misses the engine's own gaps (--metrics-file): predicted p{q} of every inter-token gap "
            f"{predicted:.3g} s vs the measured one in {low:.3g}-{high:.3g} s (tolerance {TOLERANCE:.0%} or "
            f"{TOLERANCE_FLOOR_S * 1e3:g} ms outside that bucket)"
        )
    return reasons
