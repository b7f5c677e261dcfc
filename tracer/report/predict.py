"""A layout's SLO attainment predicted from a Report: the report's fitted costs replaying the observed arrivals.

The report's goodput table asks "how fast can each layout go?"; this asks "how would that layout have done
under the requests the traces saw?", the number a user can check by serving the layout under the same
arrivals (`splitscope demo` does). It runs the same simulator, costs, scheduler limits and step noise as the
report's model check on the current layout (build.py `model_check`), so the prediction for the current
layout is that check's, and one for the recommended layout is the report's own claim at the observed rate.
Pure computation; blocking, CPU only; a few hundred requests take well under a second.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tracer.report.build import Report
from tracer.report.selfcheck import Correction
from tracer.report.simulate import SLO, Layout, Workload, simulate
from tracer.report.tables import RequestTable


@dataclass(frozen=True)
class Prediction:
    """What the report's model says `layout` would have attained under the observed arrivals."""

    layout: Layout
    attainment: float  # share of the observed requests predicted to meet both SLOs, 0..1
    rate_per_s: float  # the observed arrival rate replayed (requests per second)
    requests: int  # observed requests replayed
    # The report's self-check corrected its model (observed over predicted, selfcheck.py): the prediction
    # is then judged against the corrected objective, as the report's own answer was.
    corrected: bool


def observed_workload(requests: RequestTable) -> Workload:
    """The traced requests as a simulator workload: arrivals in seconds from the first, lengths as served."""
    arrival_s = (requests.arrival_ns - requests.arrival_ns.min()) / 1e9
    return Workload(arrival_s, requests.input_tokens, requests.cached_tokens, np.maximum(requests.output_tokens, 1))


def model_slo(report: Report) -> tuple[SLO, bool]:
    """The objective the report's model is judged against: the report's SLO divided by the self-check's
    correction factors when it applied one, else the SLO itself; and whether it was corrected."""
    correction = (report.self_check or {}).get("correction")
    if not correction:
        return report.slo, False
    return Correction(correction["ttft_factor"], correction["itl_factor"]).slo(report.slo), True


def predict_attainment(report: Report, layout: Layout | None = None) -> Prediction | None:
    """`layout`'s predicted SLO attainment at the observed arrival process (default: what the report
    recommends, else its current layout, i.e. the advice to stay). Every observed request is replayed at
    its observed arrival time, failed ones too (they were offered load); the step noise and seed are the
    model check's. None when the report fitted no model (too few requests or steps, layout unknown)."""
    target = layout or report.recommended or report.current
    if target is None or report.costs is None or report.engine_params is None or report.data is None:
        return None
    requests = report.data.requests
    if len(requests) < 2:
        return None
    workload = observed_workload(requests)
    slo, corrected = model_slo(report)
    fit = report.step_fit
    result = simulate(
        target,
        workload,
        report.costs,
        slo,
        params=report.engine_params,
        noise_sigma=fit.noise_sigma if fit is not None else 0.0,
        step_noise=fit.noise if fit is not None else None,
        seed=0,
    )
    return Prediction(target, result.attainment_for(slo), workload.rate_per_s, len(workload), corrected)
