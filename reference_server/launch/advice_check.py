"""The demo's advice check: the colocated run's recommendation, predicted by its report, measured by serving it.

`splitscope demo` serves what the colocated run's report recommends under the same arrivals and holds the
measurement against the report's own prediction (tracer/report/predict.py) and against the colocated run:
the advice is shown to help, and the model to be right about by how much. Pure bookkeeping; no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tracer.load.stats import Summary
from tracer.report.build import Report
from tracer.report.predict import Prediction, predict_attainment
from tracer.report.simulate import Layout
from tracer.vocabulary import Mode, Verdict


def serve_argv(layout: Layout) -> list[str]:
    """`splitscope serve` flags for `layout`."""
    if layout.mode == Mode.DISAGGREGATED:
        return [
            "--mode",
            Mode.DISAGGREGATED.value,
            "--prefill-workers",
            str(layout.prefill_workers),
            "--decode-workers",
            str(layout.decode_workers),
        ]
    # Plain strings: click's Choice reads an Enum member by its name, not its value.
    argv = ["--mode", str(layout.mode), "--workers", str(layout.workers)]
    if layout.mode == Mode.CHUNKED:
        argv += ["--chunk-budget", str(layout.chunk_budget_tokens)]
    return argv


def advised_layout(report: Report) -> Layout | None:
    """What the report says to run: its recommended layout, its current one when it says to stay, None when
    it refused (insufficient-data: nothing to check)."""
    if report.verdict == Verdict.INSUFFICIENT_DATA:
        return None
    return report.recommended or report.current


@dataclass(frozen=True)
class AdviceCheck:
    """The advised layout's predicted and measured attainment, beside the run it advises on."""

    verdict: str
    run: str  # the demo run that served the advised layout
    prediction: Prediction
    measured: Summary  # the client's, on the run that served the advised layout
    baseline: Summary  # the client's, on the run the advice was given on
    stays: bool  # the advice is to keep the layout: the check is the advised-on run itself

    def line(self) -> str:
        """`advice check: LAYOUT: predicted attainment P% at R req/s, measured M%`."""
        p = self.prediction
        return (
            f"advice check: {p.layout.label}: predicted attainment {p.attainment:.0%} at {p.rate_per_s:.2g} req/s, "
            f"measured {_percent(self.measured.attainment)}"
        )

    def against_baseline(self) -> str:
        """One line: what the advice changed, as measured, against the run it was given on."""
        if self.stays:
            return "  the advice is to stay: the check is the colocated run itself"
        before, after = self.baseline, self.measured
        return (
            f"  against the colocated run: attainment {_percent(before.attainment)} -> {_percent(after.attainment)}, "
            f"goodput {_rate(before.goodput_rps)} -> {_rate(after.goodput_rps)} req/s"
        )

    def to_json(self) -> dict[str, Any]:
        p, after, before = self.prediction, self.measured, self.baseline
        return {
            "verdict": self.verdict,
            "layout": p.layout.label,
            "run": self.run,
            "stays": self.stays,
            "rate_per_s": p.rate_per_s,
            "requests": p.requests,
            "predicted_attainment": p.attainment,
            "model_corrected": p.corrected,
            "measured_attainment": after.attainment,
            "measured_goodput_rps": after.goodput_rps,
            "baseline_attainment": before.attainment,
            "baseline_goodput_rps": before.goodput_rps,
            "error_points": None if after.attainment is None else 100 * (p.attainment - after.attainment),
        }


def check_advice(report: Report, run: str, measured: Summary, baseline: Summary, verdict: str) -> AdviceCheck | None:
    """The check of `report`'s advice as served in `run` (None when it refused or fitted no model)."""
    layout = advised_layout(report)
    prediction = predict_attainment(report, layout) if layout is not None else None
    if layout is None or prediction is None:
        return None
    return AdviceCheck(verdict, run, prediction, measured, baseline, stays=layout == report.current)


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{share:.0%}"


def _rate(rps: float | None) -> str:
    return "-" if rps is None else f"{rps:.2f}"
