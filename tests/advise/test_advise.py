"""`splitscope advise` on synthetic traces whose change of traffic is known by construction.

Steady short-prompt traffic (tests.synthetic's "chatty": short prompts, interference harmless,
stay-colocated), then, from CHANGE_S on, long prompts ("long-prompts": prompts stall decodes, chunked
prefill wins) on the same four colocated workers, at the long-prompts scenario's SLO.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from click.testing import CliRunner

from tests.synthetic import EPOCH_NS, SYNTHETIC_ROUTER, scenario, write_traces
from tracer.advise import hold as hysteresis
from tracer.advise.build import CARRIED_FITS, DECIDED, advise_files, hold_advice
from tracer.advise.render import ADVICE_FIELDS, WINDOW_FIELDS, render, to_json
from tracer.cli.main import main
from tracer.report.build import ReportOptions
from tracer.report.simulate import SLO

WINDOW_S = 10.0
HOLD = 3
CHANGE_S = 40.0  # the long prompts start here; the short traffic ends before it
SLO_TTFT_S, SLO_ITL_S = 1.0, 0.1
MIN_REQUESTS = ReportOptions(slo=SLO(1.0, 1.0)).min_requests


def _options() -> ReportOptions:
    """Short simulations and no bootstrap: every window stays quick on two cores."""
    return ReportOptions(
        slo=SLO(SLO_TTFT_S, SLO_ITL_S),
        router=SYNTHETIC_ROUTER,
        sim_requests=100,
        sim_max_requests=1000,
        sim_duration_s=10.0,
        confidence_resamples=0,
    )


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    folder = tmp_path_factory.mktemp("advise")
    short = scenario("chatty", n_requests=320)  # 8/s: ends before CHANGE_S
    assert short.workload.arrival_s.max() < CHANGE_S
    long = scenario("long-prompts", n_requests=200)  # 4/s, shifted to start at CHANGE_S
    shifted = replace(long.workload, arrival_s=long.workload.arrival_s + CHANGE_S)
    steady, changed = folder / "steady.jsonl", folder / "long.jsonl"
    write_traces(steady, short.layout, short.workload, short.costs, seed=7)
    write_traces(changed, long.layout, shifted, long.costs, seed=8)
    return steady, changed, np.concatenate([short.workload.arrival_s, shifted.arrival_s])


@pytest.fixture(scope="module")
def change(traces):
    steady, changed, _ = traces
    return advise_files([steady, changed], _options(), WINDOW_S, HOLD)


def test_windows_before_the_change_stay_colocated_and_after_it_do_not(change):
    change_ns = EPOCH_NS + int(CHANGE_S * 1e9)
    before = [w for w in change.windows if w.end_unix_ns <= change_ns]
    after = [w for w in change.windows if w.start_unix_ns >= change_ns]
    assert len(before) == 4 and len(after) == 6  # 40 s of short traffic, 50-odd s of long prompts
    assert all(w.verdict == "stay-colocated" for w in before)
    assert all(w.verdict == "enable-chunked-prefill" for w in after)
    # Consecutive windows from the first arrival (the chatty file's first request, at the epoch).
    assert change.windows[0].start_unix_ns == EPOCH_NS
    assert all(a.end_unix_ns == b.start_unix_ns for a, b in zip(change.windows, change.windows[1:], strict=False))


def test_the_held_advice_changes_only_after_hold_windows_of_the_new_verdict(change):
    change_ns = EPOCH_NS + int(CHANGE_S * 1e9)
    first_new = next(i for i, w in enumerate(change.windows) if w.start_unix_ns >= change_ns)
    verdicts = [held.verdict for held in change.held_after]
    # Set by the first window, held through the first HOLD-1 windows of long prompts, changed at the HOLD-th.
    assert verdicts[: first_new + HOLD - 1] == ["stay-colocated"] * (first_new + HOLD - 1)
    assert verdicts[first_new + HOLD - 1 :] == ["enable-chunked-prefill"] * (len(verdicts) - first_new - HOLD + 1)
    assert change.held_after[0].reason == "decided"
    assert change.held_after[first_new].reason == "held"
    advice = change.advice
    assert advice.verdict == "enable-chunked-prefill" and advice.reason == "changed"
    assert advice.chunk_budget_tokens == change.windows[-1].chunk_budget_tokens
    assert advice.since_unix_ns == change.windows[first_new].start_unix_ns >= change_ns


def test_a_thin_window_is_decided_with_the_fits_of_the_window_before(traces, change):
    arrivals_ns = EPOCH_NS + (traces[2] * 1e9).astype(np.int64)  # as written by the synthetic writer
    for i, window in enumerate(change.windows):
        own = int(((arrivals_ns >= window.start_unix_ns) & (arrivals_ns < window.end_unix_ns)).sum())
        assert abs(window.requests - own) <= 1  # the writer rounds arrivals to the ns
        if own >= MIN_REQUESTS + 1:
            assert window.reason == DECIDED and window.decided_from_unix_ns == window.start_unix_ns
        elif own < MIN_REQUESTS - 1:
            assert window.reason == CARRIED_FITS, window
            assert window.decided_from_unix_ns == change.windows[i - 1].start_unix_ns
    assert change.windows[-1].reason == CARRIED_FITS  # the long prompts' last 2 s


def test_steady_traffic_stays_colocated_in_every_window(traces):
    result = advise_files([traces[0]], _options(), WINDOW_S, HOLD)
    assert [w.verdict for w in result.windows] == ["stay-colocated"] * 4
    assert [h.verdict for h in result.held_after] == ["stay-colocated"] * 4
    assert result.advice.reason == "decided" and result.advice.since_unix_ns == EPOCH_NS
    assert "| stay-colocated |" in render(result, "md")


def _cli(*args: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(main, ["advise", *args])


def test_the_cli_writes_the_json_contract(traces, tmp_path):
    out = tmp_path / "advice.json"
    args = ["--slo-ttft", str(SLO_TTFT_S), "--slo-itl", str(SLO_ITL_S), "--router", SYNTHETIC_ROUTER]
    result = _cli(str(traces[0]), "--window", "20s", *args, "--sim-requests", "50", "--format", "json", "-o", str(out))
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    assert set(document) == {"windows", "advice"}
    assert len(document["windows"]) == 2
    for window in document["windows"]:
        assert list(window) == list(WINDOW_FIELDS)
        assert window["verdict"] == "stay-colocated" and window["ratio"] is None and window["confidence"] is None
        assert window["reason"] == "decided" and window["requests"] >= MIN_REQUESTS
    assert list(document["advice"]) == list(ADVICE_FIELDS)
    assert document["advice"]["verdict"] == "stay-colocated"
    assert document["advice"]["since_unix_ns"] == EPOCH_NS


def test_the_json_of_a_change_names_the_budget_and_no_ratio(change):
    document = to_json(change)
    assert document["advice"]["ratio"] is None and document["advice"]["chunk_budget_tokens"] > 0
    assert all(isinstance(w["gain"], float) for w in document["windows"] if w["verdict"] != "stay-colocated")
    json.dumps(document)  # plain JSON types throughout


@pytest.mark.parametrize(
    "args, words",
    [
        (["--window", "soon", "--slo-ttft", "1", "--slo-itl", "0.1"], "'soon' is not a positive duration"),
        (["--window", "0s", "--slo-ttft", "1", "--slo-itl", "0.1"], "not a positive duration"),
        (["--window", "5m", "--slo-ttft", "1", "--slo-itl", "0.1"], "give TRACES (trace files) or"),
        (["--window", "5m", "--slo-ttft", "1", "--slo-itl", "0.1", "--otlp-port", "0"], "it needs --follow"),
        (["--window", "5m", "--slo-ttft", "1", "--slo-itl", "0.1", "--hold", "0"], "--hold"),
    ],
)
def test_bad_input_is_one_clear_error_and_a_non_zero_exit(traces, args, words):
    if "give TRACES" not in words and "--otlp-port" not in args:
        args = [str(traces[0]), *args]
    result = _cli(*args)
    assert result.exit_code != 0
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and words in errors[0], result.output


def test_traces_without_requests_are_one_clear_error(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    result = _cli(str(empty), "--window", "5m", "--slo-ttft", "1", "--slo-itl", "0.1")
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == ["Error: no requests in the traces (no root `text_completion` span)"]


@pytest.mark.parametrize(
    "votes, n, expected",
    [
        ([], 3, (None, None, "insufficient_data")),
        ([(None, 0), (None, 1)], 3, (None, None, "insufficient_data")),
        ([(None, 0), ("a", 1), ("a", 2)], 3, ("a", 1, "decided")),
        ([("a", 0), ("b", 1), ("b", 2)], 3, ("a", 0, "held")),
        ([("a", 0), ("b", 1), ("b", 2), ("b", 3)], 3, ("b", 1, "changed")),
        # A window back on the held advice breaks the challenger's run; one with no decision does not.
        ([("a", 0), ("b", 1), ("b", 2), ("a", 3), ("b", 4)], 3, ("a", 0, "held")),
        ([("a", 0), ("b", 1), (None, 2), ("b", 3), ("b", 4)], 3, ("b", 1, "changed")),
        # Two challengers alternating never win three in a row.
        ([("a", 0), ("b", 1), ("c", 2), ("b", 3), ("c", 4)], 3, ("a", 0, "held")),
        ([("a", 0), ("b", 1)], 1, ("b", 1, "changed")),
    ],
)
def test_hysteresis(votes, n, expected):
    held = hysteresis.hold(votes, n)
    assert (held.key, held.since_ns, held.reason) == expected


STAY, CHUNK_64, CHUNK_128 = ("stay-colocated", None, None), ("chunk", None, 64), ("chunk", None, 128)
SPLIT_1_1, SPLIT_2_1 = ("split", "1:1", None), ("split", "2:1", None)


@pytest.mark.parametrize(
    "votes, expected",
    [
        # A layout change whose windows disagree on the budget still wins, with the last window's budget.
        ([STAY, CHUNK_64, CHUNK_128], (CHUNK_128, 1, "changed")),
        ([STAY, CHUNK_64, None, CHUNK_128], (CHUNK_128, 1, "changed")),
        ([STAY, CHUNK_64, STAY, CHUNK_128], (STAY, 0, "held")),
        # Another budget for the held layout is a change of its own: it needs the hold at that budget.
        ([CHUNK_64, CHUNK_128], (CHUNK_64, 0, "held")),
        ([CHUNK_64, CHUNK_128, CHUNK_128], (CHUNK_128, 1, "changed")),
        ([STAY, CHUNK_64, CHUNK_64, CHUNK_128, CHUNK_64], (CHUNK_64, 1, "held")),
        # A split ratio is the layout itself, not a tuning.
        ([STAY, SPLIT_1_1, SPLIT_2_1], (STAY, 0, "held")),
    ],
)
def test_hysteresis_takes_a_chunk_budget_as_a_tuning_of_its_layout(votes, expected):
    held = hold_advice([(vote, i) for i, vote in enumerate(votes)], 2)
    assert (held.key, held.since_ns, held.reason) == expected
