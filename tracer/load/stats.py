"""Summary statistics of a load run, exactly recomputable from the per-request records.

Definitions (all durations in seconds):
- Percentiles use numpy's default 'linear' method (type 7, interpolating between order statistics),
  over successful requests only; an empty sample gives None.
- A request's ITL statistic is the p99 of its own inter-token gaps (None with fewer than two chunks).
- A request meets the SLO when it succeeded and each given objective holds: ttft_s <= slo.ttft_s,
  itl p99 <= slo.itl_s, tpot_s <= slo.tpot_s. An objective on a statistic the request lacks (no gaps
  for a one-token answer) holds vacuously. No objectives given: every successful request meets the SLO.
- attainment = requests meeting the SLO / requests scheduled (failed and skipped ones count against it;
  cancelled ones, ended by the run's own stop rather than by the server, are not judged).
- goodput_rps = requests meeting the SLO / wall_s, where wall_s runs from the start of the run to the
  end of the last response (and, for a --duration run, at least to the end of the duration).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from tracer.load.client import CANCELLED, ERROR, ERROR_KINDS, OK, SKIPPED, RequestMeasurement
from tracer.load.config import ClientSLO

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Distribution:
    """Percentiles, mean and max of one metric; all None for an empty sample."""

    count: int
    p50: float | None
    p90: float | None
    p99: float | None
    mean: float | None
    max: float | None

    @classmethod
    def of(cls, values: Iterable[float]) -> Distribution:
        sample = np.asarray(list(values), dtype=float)
        if sample.size == 0:
            return cls(0, None, None, None, None, None)
        p50, p90, p99 = (float(v) for v in np.percentile(sample, PERCENTILES))
        return cls(int(sample.size), p50, p90, p99, float(sample.mean()), float(sample.max()))


@dataclass(frozen=True)
class Summary:
    scheduled: int
    sent: int
    ok: int
    errors: int
    skipped_inflight_cap: int
    cancelled: int  # sent, then cancelled by the run's stop (`run_load(cancel=...)`) before the answer ended
    errors_by_kind: dict[str, int]
    slo: dict[str, float | None]
    slo_met: int
    attainment: float | None
    goodput_rps: float | None
    achieved_rate_rps: float | None  # successful requests per second of wall time
    output_tokens_per_s: float | None
    wall_s: float
    schedule_lag: Distribution  # how far behind schedule each sent request left (send - scheduled)
    latency: dict[str, Distribution]  # ttft_s, tpot_s, itl_s, itl_p99_s, e2e_s over successful requests

    def to_json_dict(self) -> dict:
        return asdict(self)


def itl_p99_s(record: RequestMeasurement) -> float | None:
    """The p99 of one request's inter-token gaps (numpy 'linear'); None with no gaps."""
    return float(np.percentile(record.itl_s, 99)) if record.itl_s else None


def meets_slo(record: RequestMeasurement, slo: ClientSLO) -> bool:
    if record.status != OK:
        return False
    checks = ((record.ttft_s, slo.ttft_s), (itl_p99_s(record), slo.itl_s), (record.tpot_s, slo.tpot_s))
    return all(limit is None or value is None or value <= limit for value, limit in checks)


def summarize(records: Sequence[RequestMeasurement], slo: ClientSLO, wall_s: float) -> Summary:
    """The run's summary; `records` holds every scheduled request (sent or skipped)."""
    ok = [r for r in records if r.status == OK]
    sent = [r for r in records if r.sent_s is not None]
    kinds = Counter(r.error_kind for r in records if r.status == ERROR)
    slo_met = sum(meets_slo(r, slo) for r in records)
    cancelled = sum(r.status == CANCELLED for r in records)
    judged = len(records) - cancelled
    latency = {
        "ttft_s": Distribution.of(r.ttft_s for r in ok if r.ttft_s is not None),
        "tpot_s": Distribution.of(r.tpot_s for r in ok if r.tpot_s is not None),
        "itl_s": Distribution.of(gap for r in ok for gap in r.itl_s),
        "itl_p99_s": Distribution.of(v for v in map(itl_p99_s, ok) if v is not None),
        "e2e_s": Distribution.of(r.e2e_s for r in ok if r.e2e_s is not None),
    }
    return Summary(
        scheduled=len(records),
        sent=len(sent),
        ok=len(ok),
        errors=sum(kinds.values()),
        skipped_inflight_cap=sum(r.status == SKIPPED for r in records),
        cancelled=cancelled,
        errors_by_kind={kind: kinds.get(kind, 0) for kind in ERROR_KINDS},
        slo=asdict(slo),
        slo_met=slo_met,
        attainment=slo_met / judged if judged else None,
        goodput_rps=_per_s(slo_met, wall_s),
        achieved_rate_rps=_per_s(len(ok), wall_s),
        output_tokens_per_s=_per_s(sum(r.output_tokens for r in ok), wall_s),
        wall_s=wall_s,
        schedule_lag=Distribution.of(r.lag_s for r in sent if r.lag_s is not None),
        latency=latency,
    )


def _per_s(count: int, wall_s: float) -> float | None:
    return count / wall_s if wall_s > 0 else None
