"""`splitscope explain` on hand-built traces whose causes are known by construction."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from tests.conftest import REPO_ROOT
from tests.explain.traces import Traces, ns
from tracer.cli.main import main
from tracer.explain.build import explain
from tracer.explain.read import load
from tracer.explain.select import choose
from tracer.explain.stalls import STALL_FACTOR, STALL_FLOOR_S


def _explained(path, trace_id):  # type: ignore[no-untyped-def]
    data = load([path])
    (request,) = explain(data, choose(data, [trace_id], 5, "itl"), "itl")["requests"]
    return request


def _cli(*args: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(main, ["explain", *args])


@pytest.fixture
def colocated(tmp_path):
    """A victim decoding on w0 while a 2000-token prompt and a 500-token prompt prefill in one step there,
    and a 3000-token prompt prefills on w1 at the same time (not its cause)."""
    t = Traces()
    ids = {}
    ids["ahead"] = t.request(arrival_s=0.0, end_s=0.5, queue=(0.001, 0.002), prefill=(0.002, 0.040, 300))
    ids["victim"] = t.request(
        arrival_s=0.0,
        end_s=2.0,
        ttft_s=0.055,
        queue=(0.010, 0.020),
        prefill=(0.020, 0.050, 100),
        decode=(0.051, 2.0),
        itl_p50_s=0.020,
        # token time, gap, prefill tokens: a stall of 0.3 s, and a 1.5x gap that is no stall
        stalls=[(1.0, 0.300, 2500), (1.5, 1.5 * 0.020, 0)],
    )
    ids["big"] = t.request(arrival_s=0.69, end_s=1.2, queue=(0.69, 0.705), prefill=(0.705, 0.995, 2000))
    ids["small"] = t.request(arrival_s=0.69, end_s=1.2, queue=(0.69, 0.705), prefill=(0.705, 0.995, 500))
    ids["elsewhere"] = t.request(arrival_s=0.6, end_s=1.2, worker="w1", prefill=(0.7, 0.99, 3000))
    return t.write(tmp_path / "colocated.jsonl"), ids


def test_a_stall_names_the_prefills_that_filled_it_split_by_their_tokens(colocated):
    path, ids = colocated
    request = _explained(path, ids["victim"])
    (stall,) = request["stalls"]  # the 1.5x gap is under the 2x rule
    assert (stall["start_unix_ns"], stall["end_unix_ns"]) == (ns(0.7), ns(1.0))
    assert stall["duration_s"] == pytest.approx(0.3)
    causes = {c["trace_id"]: c for c in stall["causes"]}
    assert ids["elsewhere"] not in causes  # another worker's prefill is no cause
    overlap = (0.995 - 0.705) / 0.3
    assert causes[ids["big"]]["share"] == pytest.approx(overlap * 2000 / 2500, abs=1e-3)
    assert causes[ids["small"]]["share"] == pytest.approx(overlap * 500 / 2500, abs=1e-3)
    assert causes[ids["big"]]["prefill_tokens"] == 2000 and causes[ids["big"]]["kind"] == "prefill"
    assert causes[None]["kind"] == "unexplained"
    assert sum(c["share"] for c in stall["causes"]) == pytest.approx(1.0, abs=1e-3)
    assert stall["engine_prefill_tokens"] == 2500 and stall["estimated"] is False
    assert stall["causes"][0]["trace_id"] == ids["big"]  # largest share first


def test_ttft_parts_add_up_and_name_whom_it_queued_behind(colocated):
    path, ids = colocated
    request = _explained(path, ids["victim"])
    parts = request["ttft_parts_s"]
    assert parts["frontend"] == pytest.approx(0.010)
    assert parts["queue"] == pytest.approx(0.010)
    assert parts["prefill"] == pytest.approx(0.030)
    assert parts["kv_transfer"] == parts["decode_wait"] == 0.0
    assert parts["unexplained"] == pytest.approx(0.005)
    assert sum(parts.values()) == pytest.approx(request["ttft_s"], abs=1e-9)
    assert request["queued_behind"] == [{"trace_id": ids["ahead"], "state": "prefill", "prefill_tokens": 300}]


def test_the_stall_rule_needs_both_the_factor_and_the_floor(tmp_path):
    t = Traces()
    median_s = STALL_FLOOR_S / 4  # a fast decode: 3x its median is still under the floor
    victim = t.request(
        arrival_s=0.0,
        end_s=1.0,
        prefill=(0.0, 0.01, 10),
        decode=(0.01, 1.0),
        itl_p50_s=median_s,
        stalls=[(0.5, 3 * median_s, 100), (0.8, STALL_FLOOR_S * 2, 100)],
    )
    (stall,) = _explained(t.write(tmp_path / "t.jsonl"), victim)["stalls"]
    assert stall["end_unix_ns"] == ns(0.8)
    assert stall["duration_s"] > max(STALL_FACTOR * median_s, STALL_FLOOR_S)


def test_without_token_times_stalls_are_estimated_from_request_overlap(tmp_path):
    t = Traces()
    victim = t.request(arrival_s=0.0, end_s=2.0, prefill=(0.0, 0.05, 10), decode=(0.05, 2.0))
    culprit = t.request(arrival_s=0.9, end_s=1.5, prefill=(1.0, 1.4, 4000))
    (stall,) = _explained(t.write(tmp_path / "t.jsonl"), victim)["stalls"]
    assert stall["estimated"] is True and "overlap" in stall["basis"] and "w0" in stall["basis"]
    assert (stall["start_unix_ns"], stall["end_unix_ns"]) == (ns(1.0), ns(1.4))
    (cause,) = stall["causes"]
    assert (cause["trace_id"], cause["estimated"], cause["prefill_tokens"]) == (culprit, True, 4000)


def test_without_token_times_long_steps_are_estimated_stalls(tmp_path):
    t = Traces()
    victim = t.request(arrival_s=0.0, end_s=1.0, prefill=(0.0, 0.05, 10), decode=(0.05, 1.0))
    culprit = t.request(arrival_s=0.4, end_s=0.8, prefill=(0.5, 0.7, 3000))
    starts = [round(0.1 + 0.02 * k, 6) for k in range(20)] + [0.5] + [round(0.7 + 0.02 * k, 6) for k in range(12)]
    for start in starts:  # 20 ms decode steps and one 200 ms mixed step for the prompt
        t.step("w0", start, start + (0.2 if start == 0.5 else 0.02), 3000 if start == 0.5 else 0)
    (stall,) = _explained(t.write(tmp_path / "t.jsonl"), victim)["stalls"]
    assert stall["estimated"] and "step spans" in stall["basis"]
    assert (stall["start_unix_ns"], stall["end_unix_ns"]) == (ns(0.5), ns(0.7))
    assert stall["causes"][0]["trace_id"] == culprit and stall["causes"][0]["share"] == pytest.approx(1.0)
    assert stall["step_prefill_tokens"] == 3000


def test_time_no_step_ran_in_is_queueing_only_when_no_step_span_was_dropped(tmp_path):
    def run(weight: float) -> dict:
        t = Traces()
        victim = t.request(
            arrival_s=0.0,
            end_s=2.0,
            prefill=(0.0, 0.05, 10),
            decode=(0.05, 2.0),
            itl_p50_s=0.02,
            stalls=[(1.0, 0.3, 0)],
        )
        t.step("w0", 0.70, 0.72, weight=weight)
        t.step("w0", 0.75, 1.0, weight=weight)
        (stall,) = _explained(t.write(tmp_path / f"t{weight}.jsonl"), victim)["stalls"]
        return {c["kind"]: c["share"] for c in stall["causes"]}

    assert run(1) == pytest.approx({"queueing": 0.1, "unexplained": 0.9}, abs=1e-3)
    assert run(10) == pytest.approx({"unexplained": 1.0})  # sampled steps: a hole may be a dropped step


def test_disaggregated_parts_use_the_clock_offset_and_transfers_landing_are_causes(tmp_path):
    t = Traces()
    offset_ns = 5_000_000  # the decode host's clock runs 5 ms ahead of the prefill host's
    victim = t.request(
        arrival_s=0.0,
        end_s=2.0,
        ttft_s=0.100,
        worker="p0",
        decode_worker="d0",
        queue=(0.005, 0.010),
        prefill=(0.010, 0.050, 1000),
        transfer=(0.050, 0.080, offset_ns),
        decode=(0.090 + offset_ns / 1e9, 2.0),
        itl_p50_s=0.02,
        stalls=[(1.2, 0.2, 0)],
    )
    other = t.request(
        arrival_s=0.9, end_s=1.5, worker="p0", decode_worker="d0", prefill=(0.95, 1.0, 8000), transfer=(1.0, 1.2, 0)
    )
    request = _explained(t.write(tmp_path / "t.jsonl"), victim)
    parts = request["ttft_parts_s"]
    assert parts["kv_transfer"] == pytest.approx(0.030)
    assert parts["decode_wait"] == pytest.approx(0.010)  # 0.080 -> 0.090 on the sender's clock
    assert sum(parts.values()) == pytest.approx(0.100, abs=1e-9)
    (stall,) = request["stalls"]
    (cause,) = [c for c in stall["causes"] if c["trace_id"] == other]
    assert cause["kind"] == "kv_transfer" and cause["share"] == pytest.approx(1.0)
    # The other request's prefill ran on the prefill worker, not on the victim's decode worker.
    assert all(c["kind"] != "prefill" for c in stall["causes"])


def test_a_decode_in_two_pieces_is_a_preemption(tmp_path):
    t = Traces()
    victim = t.request(
        arrival_s=0.0,
        end_s=2.0,
        prefill=(0.0, 0.05, 10),
        decode=[(0.05, 0.9), (1.3, 2.0)],
        itl_p50_s=0.02,
        stalls=[(1.32, 0.42, 0)],
    )
    (stall,) = _explained(t.write(tmp_path / "t.jsonl"), victim)["stalls"]
    top = stall["causes"][0]
    assert (top["kind"], top["trace_id"]) == ("preemption", victim)
    assert top["share"] == pytest.approx(0.4 / 0.42, abs=1e-3)


def test_cli_picks_the_worst_by_the_chosen_measure(colocated, tmp_path):
    path, ids = colocated
    result = _cli(str(path), "--worst", "1", "--by", "ttft", "--format", "json")
    assert result.exit_code == 0, result.output
    (request,) = json.loads(result.output)["requests"]
    data = load([path])
    assert request["ttft_s"] == max(t.ttft_s for t in data.requests())
    result = _cli(str(path), "--worst", "1", "--format", "json")  # default: by the p99 gap
    assert json.loads(result.output)["requests"][0]["trace_id"] == ids["victim"]


def test_cli_markdown_and_out_file(colocated, tmp_path):
    path, ids = colocated
    out = tmp_path / "explain.md"
    result = _cli(str(path), "--trace-id", ids["victim"].upper(), "--out", str(out))
    assert result.exit_code == 0, result.output
    text = out.read_text()
    assert f"trace `{ids['victim']}`" in text and "| TTFT part |" in text
    assert f"prefill of `{ids['big']}` (2000 tokens)" in text
    summary = json.loads(_cli(str(path), "--trace-id", ids["victim"], "--format", "json").output)["summary"]
    assert summary["top_causes"][0]["trace_id"] == ids["big"]
    assert summary["stall_s_by_kind"]["prefill"] == pytest.approx(0.29, abs=1e-3)


def test_cli_bad_input_is_one_line_and_a_non_zero_exit(colocated, tmp_path):
    path, _ = colocated
    result = _cli(str(path), "--trace-id", "f" * 32)
    assert result.exit_code != 0 and result.output.strip().splitlines() == [
        f"Error: trace id {'f' * 32} has no request span in the traces read"
    ]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(path.read_text() + "{not json\n")
    result = _cli(str(bad))
    assert result.exit_code != 0 and len(result.output.strip().splitlines()) == 1
    assert f"{bad}:2:" in result.output


def test_explain_is_pure_computation_and_listed_in_help():
    probe = (
        "import sys, tracer.explain.cli, tracer.explain.build; "
        "print(sorted(m for m in ('torch', 'reference_server') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
    help_text = CliRunner().invoke(main, ["--help"]).output
    assert "explain" in help_text and "not installed" not in help_text.split("explain", 1)[1].splitlines()[0]
