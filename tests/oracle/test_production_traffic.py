"""The oracle's production traffic is the public trace as it was: the rows the load generator's replay reader
(tracer.load.replay_formats, a parser the oracle does not share) reads from the same file, in order, with the
trace's bursts and lulls kept when its arrivals are scaled to one request per second."""

from __future__ import annotations

import numpy as np
import pytest

from tests.oracle.cases import TRACES, Case, colocated, trace_rows, traffic
from tests.oracle.engine import Physics
from tests.oracle.goodput import Slo
from tracer.load.replay_formats import read_replay

N = 200


@pytest.mark.parametrize("name", sorted(TRACES))
def test_the_oracle_reads_every_row_as_the_replay_reader_does(name: str) -> None:
    arrivals_s, prompts, outputs = trace_rows(name)
    entries = read_replay(TRACES[name])
    assert len(entries) == len(arrivals_s) == 1000
    assert np.array_equal(prompts, [e.prompt_tokens for e in entries])
    assert np.array_equal(outputs, [e.output_tokens for e in entries])
    # The replay reader keeps all seven fractional digits; the oracle microseconds.
    assert np.allclose(arrivals_s, [e.arrival_s for e in entries], atol=1e-6)


@pytest.mark.parametrize("name", sorted(TRACES))
def test_a_seeds_window_keeps_the_traces_order_bursts_and_lengths(name: str) -> None:
    case = Case("t", colocated(2), Physics(), Slo(1.0, 0.1, "p99"), (1, 10**6), (1, 10**6), trace=name)
    arrivals_s, prompts, outputs = trace_rows(name)
    for seed in (1, 2):
        sample = traffic(case, N, seed)
        # Consecutive rows from one offset (a prompt length repeats in the trace: find the window that matches).
        starts = [
            s
            for s in np.flatnonzero(prompts == sample.prompt_tokens[0])
            if np.array_equal(prompts[s : s + N], sample.prompt_tokens)
        ]
        assert starts, seed
        start = int(starts[0])
        assert np.array_equal(outputs[start : start + N], sample.output_tokens)
        gaps, trace_gaps = np.diff(sample.arrival_s), np.diff(arrivals_s[start : start + N])
        assert sample.arrival_s[0] == 0 and np.mean(gaps) == pytest.approx(1.0)
        # Scaled, not reshuffled: the same gaps in the same order, so the same burstiness.
        assert np.allclose(gaps, trace_gaps * (N - 1) / trace_gaps.sum())
    assert not np.array_equal(traffic(case, N, 1).prompt_tokens, traffic(case, N, 2).prompt_tokens)


def test_lengths_are_kept_within_the_cases_bounds() -> None:
    case = Case("t", colocated(2), Physics(), Slo(1.0, 0.1, "p99"), (64, 2048), (2, 256), trace="azure-code")
    sample = traffic(case, N, 1)
    assert sample.prompt_tokens.min() >= 64 and sample.prompt_tokens.max() <= 2048
    assert sample.output_tokens.min() >= 2 and sample.output_tokens.max() <= 256
