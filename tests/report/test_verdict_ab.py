"""The report's predicted goodput per layout, against goodput measured on the real reference server.

The short, always-run version of bench/verdict_ab.py: one workload (short chats with bursts of long
prompts), two layouts of two workers each (colocated, and one prefill + one decode worker), a coarse rate
search (three rates around each prediction). One traced colocated run feeds the report; each layout is then served for real and its goodput
(the highest rate at which 90% of requests meet both SLOs, judged on the server's spans as the report judges) is searched with the open-loop load generator,
replaying one schedule stretched to each rate. The report must rank the two layouts as they measure, and
each prediction must fall within the stated tolerance of what was measured.
"""

from __future__ import annotations

import math

import pytest

from bench.verdict_ab import (
    SHAPES,
    base_schedule,
    candidate_rows,
    goodput_from_points,
    measure_layout,
    rate_grid_rps,
    rate_limits_rps,
    traced_report,
)

pytestmark = pytest.mark.slow


WORKERS = 2
REQUESTS = 30  # per measured rate: one miss is 3% of attainment
# Coarse search: rates prediction / 1.5, prediction, prediction x 1.5. Stated tolerance: the measured
# goodput within a factor 1.5 of the prediction either way, i.e. the layout passes at prediction / 1.5 and
# fails at prediction x 1.5. The bench aims at 25% on an idle machine; this test runs beside the rest of
# the suite on two shared cores, where every process's share of a core moves while it runs.
STEP = 1.5


# Issue 22 is open: on this server the report's predictions miss (bench/RESULTS.md, "Verdict A/B", measured
# causes: a 40-request horizon measures a transient, the step fit extrapolates from a light run's small
# batches, CPU sharing between workers). Recorded run of this test: colocated passed above 1.5x its
# prediction, the split failed at a third of its. Remove this mark when the model is fixed.
@pytest.mark.xfail(reason="issue 22: predicted goodput misses the measured one on the reference server (bench/RESULTS.md)",
                   strict=False)
def test_predicted_goodput_ranks_and_sizes_two_layouts_as_measured(tmp_path):
    shape = SHAPES["bursts"]
    schedule = base_schedule(shape, REQUESTS)
    report = traced_report(shape, schedule, WORKERS, tmp_path, confidence=0)
    rows = {row.serve_args[1]: row for row in candidate_rows(report, WORKERS)}
    layouts = [rows["colocated"], rows["disaggregated"]]
    for row in layouts:
        rates = rate_grid_rps(row.predicted_per_gpu * WORKERS, STEP, 1, 1, *rate_limits_rps(schedule))
        row.points = measure_layout(row.serve_args, shape, schedule, rates, shape.slo, tmp_path, WORKERS)
        low, high = goodput_from_points(row.points, shape.slo.attainment, "span")
        row.measured_bracket_per_gpu = (low / WORKERS, high / WORKERS)
    detail = "; ".join(
        f"{row.label}: predicted {row.predicted_per_gpu:.3f}, measured {row.measured_bracket_per_gpu[0]:.3f}"
        f"-{row.measured_bracket_per_gpu[1]:.3f} req/s/GPU" for row in layouts
    ) + f"; report on the traced run: {report.verdict} {report.unconfirmed or ''}"
    print(detail)

    colocated, split = layouts
    for row in layouts:
        low, high = row.measured_bracket_per_gpu
        assert low > 0, f"{row.label} missed the SLOs at its prediction / {STEP}: {detail}"
        assert not math.isinf(high), f"{row.label} met the SLOs at its prediction x {STEP}: {detail}"
    # The two layouts' predictions differ by more than the tolerance here, so the ranking is a real check.
    predicted_winner, predicted_loser = (split, colocated) if split.predicted_per_gpu > colocated.predicted_per_gpu else (colocated, split)
    assert predicted_winner.predicted_per_gpu > STEP * predicted_loser.predicted_per_gpu, detail
    assert predicted_winner.measured_per_gpu > predicted_loser.measured_per_gpu, detail
