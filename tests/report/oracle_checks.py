"""What every oracle test judges a report by (tests/report/test_oracle_verdicts.py, test_oracle_gpu_verdicts.py)."""

from __future__ import annotations

import math

from tests.oracle.observe import Observed
from tracer.report.build import Report
from tracer.vocabulary import Verdict

MARGIN = 0.15
SEEDS = (1, 2, 3)
# The oracle's winner must clear (or miss) the margin by this much for a case to be a fair test; a case
# that drifts into a near-tie fails here, loudly, rather than making the verdict a coin toss.
CLEAR_OF_MARGIN = 0.05


def table(seen: Observed, report: Report) -> str:
    rows = {name: f"{goodput:.3g}" for name, (_, goodput) in seen.table.items()}
    return f"oracle {rows}; report {{{', '.join(f'{o.label}: {o.goodput_per_gpu:.3g}' for o in report.goodput)}}}"


def assert_matches_the_truth(seen: Observed, report: Report) -> None:
    truth = seen.expected
    assert abs(truth.gain - MARGIN) >= CLEAR_OF_MARGIN, f"case is a near-tie under the oracle: {truth}"
    assert report.verdict == truth.verdict, (table(seen, report), report.evidence)
    if truth.verdict in (Verdict.SPLIT, Verdict.REBALANCE):
        assert abs(int(report.ratio.split(":")[0]) - truth.best.prefill_workers) <= 1, table(seen, report)
    if truth.verdict == Verdict.ENABLE_CHUNKED_PREFILL:
        assert abs(math.log2(report.chunk_budget_tokens / truth.best.budget_tokens)) <= 1, table(seen, report)
