"""Summary statistics against hand-worked records."""

from __future__ import annotations

import numpy as np
import pytest

from tracer.load.client import BAD_EVENT, INFLIGHT_CAP, TIMEOUT, RequestMeasurement
from tracer.load.config import ClientSLO
from tracer.load.stats import Distribution, itl_p99_s, meets_slo, summarize


def _record(index: int, *, ttft_s: float, itl_s: list[float], tokens: int | None = None) -> RequestMeasurement:
    record = RequestMeasurement(
        index=index,
        source="replay",
        session=None,
        scheduled_s=float(index),
        prompt_tokens=10,
        requested_output_tokens=len(itl_s) + 1,
    )
    record.sent_s = index + 0.001 * index
    record.lag_s = record.sent_s - record.scheduled_s
    record.ttft_s = ttft_s
    record.itl_s = itl_s
    record.e2e_s = ttft_s + sum(itl_s)
    record.output_tokens = tokens if tokens is not None else len(itl_s) + 1
    if record.output_tokens > 1:
        record.tpot_s = (record.e2e_s - ttft_s) / (record.output_tokens - 1)
    return record


def test_distribution_uses_linear_percentiles() -> None:
    d = Distribution.of([1.0, 2.0, 3.0, 4.0])
    # numpy 'linear': position (n-1)q -> p50 between 2 and 3, p90 at 3.7, p99 at 3.97.
    assert (d.count, d.p50, d.p90, d.p99, d.mean, d.max) == (4, 2.5, pytest.approx(3.7), pytest.approx(3.97), 2.5, 4.0)
    assert Distribution.of([]) == Distribution(0, None, None, None, None, None)


def test_slo_checks_ttft_itl_p99_and_tpot() -> None:
    fast = _record(0, ttft_s=0.1, itl_s=[0.01] * 10)
    spiky = _record(1, ttft_s=0.1, itl_s=[0.01] * 9 + [0.5])
    one_token = _record(2, ttft_s=0.1, itl_s=[])
    slo = ClientSLO(ttft_s=0.2, itl_s=0.1)
    assert itl_p99_s(spiky) == pytest.approx(float(np.percentile([0.01] * 9 + [0.5], 99)))
    assert meets_slo(fast, slo) and not meets_slo(spiky, slo)
    assert meets_slo(one_token, slo)  # no gaps: the ITL objective holds vacuously
    assert not meets_slo(fast, ClientSLO(ttft_s=0.05))
    assert not meets_slo(fast, ClientSLO(tpot_s=0.005)) and meets_slo(fast, ClientSLO(tpot_s=0.02))
    fast.fail(TIMEOUT, "late")
    assert not meets_slo(fast, ClientSLO())


def test_summary_counts_attainment_and_goodput() -> None:
    records = [_record(i, ttft_s=0.05 * (i + 1), itl_s=[0.01, 0.02 * i]) for i in range(6)]
    records[4].fail(BAD_EVENT, "junk")
    records[5] = RequestMeasurement(
        index=5, source="replay", session=None, scheduled_s=5.0, prompt_tokens=1, requested_output_tokens=1
    )
    records[5].fail(INFLIGHT_CAP, "cap")
    slo = ClientSLO(ttft_s=0.125, itl_s=0.03)
    summary = summarize(records, slo, wall_s=8.0)

    assert (summary.scheduled, summary.sent, summary.ok, summary.errors, summary.skipped_inflight_cap) == (
        6,
        5,
        4,
        1,
        1,
    )
    assert summary.errors_by_kind["bad_event"] == 1 and sum(summary.errors_by_kind.values()) == 1
    # Meeting both: ttft <= 0.125 -> records 0,1; their p99 gaps 0.0199..., 0.02 <= 0.03.
    assert summary.slo_met == 2
    assert summary.attainment == pytest.approx(2 / 6)
    assert summary.goodput_rps == pytest.approx(2 / 8.0)
    assert summary.achieved_rate_rps == pytest.approx(4 / 8.0)
    ok = records[:4]
    assert summary.latency["ttft_s"] == Distribution.of([r.ttft_s for r in ok])
    assert summary.latency["itl_s"] == Distribution.of([g for r in ok for g in r.itl_s])
    assert summary.latency["itl_p99_s"] == Distribution.of([itl_p99_s(r) for r in ok])
    assert summary.schedule_lag.max == pytest.approx(records[4].lag_s)
    assert summarize([], ClientSLO(), wall_s=0.0).goodput_rps is None
