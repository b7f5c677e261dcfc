"""`advise` on the independent oracle's traces (tests/oracle: its own engine, its own truth table): a
deployment the truth says to split gets split, at the whole-file report's ratio, in most windows and in the
held advice; one the truth keeps colocated stays colocated in every window."""

from __future__ import annotations

import numpy as np
import pytest

from tests.oracle.observe import observe
from tests.oracle.traces import write_full
from tests.report.conftest import oracle_options
from tracer.advise.build import advise
from tracer.report.build import report_from_data
from tracer.report.tables import load_traces

WINDOWS = 3  # the traced run (200 requests) cut into three windows of 60-80 requests (at 50 the ratio is noisy)
HOLD = 2
MARGIN = 0.15


@pytest.fixture(scope="module", params=["long-fast-link", "short-chats"])
def case(request, tmp_path_factory):  # type: ignore[no-untyped-def]
    seen = observe(request.param, 1, MARGIN)
    path = tmp_path_factory.mktemp("advise-oracle") / f"{request.param}.jsonl"
    write_full(path, seen.run, 1)
    data = load_traces([path])
    options = oracle_options(seen)
    arrivals_s = (data.requests.arrival_ns - data.requests.arrival_ns.min()) / 1e9
    window_s = float(np.ceil(arrivals_s.max() / WINDOWS * 1000) / 1000) + 1e-3
    return seen, report_from_data(data, options), advise(data, options, window_s, HOLD)


def test_windows_agree_with_the_truth_and_the_whole_file_report(case) -> None:  # type: ignore[no-untyped-def]
    seen, whole, result = case
    assert len(result.windows) == WINDOWS
    assert whole.verdict == seen.expected.verdict  # the report on the whole file matches the oracle's truth
    verdicts = [(w.verdict, w.ratio) for w in result.windows]
    if seen.expected.verdict == "split":
        agreeing = [v for v in verdicts if v == ("split", whole.ratio)]
        assert len(agreeing) > WINDOWS / 2, verdicts
        assert (result.advice.verdict, result.advice.ratio) == ("split", whole.ratio)
        best = seen.expected.best  # the oracle's own best layout: the ratio is the truth's, not only the report's
        assert whole.ratio == f"{best.prefill_workers}:{best.decode_workers}"
    else:
        assert seen.expected.verdict == "stay-colocated"
        assert verdicts == [("stay-colocated", None)] * WINDOWS
        assert [h.verdict for h in result.held_after] == ["stay-colocated"] * WINDOWS
