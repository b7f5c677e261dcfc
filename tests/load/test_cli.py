"""`splitscope load` end to end through the real CLI group (click's CliRunner), against the fake server."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.conftest import wait_for
from tracer.cli.main import main


def _load(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["load", *args], catch_exceptions=False)
    return result.exit_code, result.output


def test_load_writes_results_and_prints_the_summary(fake_server, tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    code, output = _load(
        "--url",
        fake_server.url,
        "--model",
        "m",
        "--rate",
        "50",
        "--requests",
        "6",
        "--prompt-tokens",
        "12",
        "--output-tokens",
        "3",
        "--slo-ttft",
        "500ms",
        "--slo-itl",
        "0.2",
        "--sessions",
        "2",
        "--shared-prefix-tokens",
        "5",
        "--seed",
        "11",
        "--out",
        str(out),
    )
    assert code == 0, output
    assert "goodput" in output and "time to first token" in output
    doc = json.loads(out.read_text())
    assert doc["config"]["seed"] == 11 and doc["config"]["slo"] == {"ttft_s": 0.5, "itl_s": 0.2, "tpot_s": None}
    assert doc["summary"]["ok"] == 6 == len(doc["requests"]) == len(fake_server.received)
    assert {r["trace_id"] for r in doc["requests"]} == {
        r.headers["traceparent"].split("-")[1] for r in fake_server.received
    }
    users = {r.body["user"] for r in fake_server.received}
    assert users <= {"session-0", "session-1"}
    for got in fake_server.received:
        assert len(got.body["prompt"]) == 12
    prefixes = {got.body["user"]: set() for got in fake_server.received}
    for got in fake_server.received:
        prefixes[got.body["user"]].add(got.body["prompt"][:5])
    assert all(len(p) == 1 for p in prefixes.values())


def test_same_seed_gives_the_same_run(fake_server, tmp_path: Path) -> None:
    def run(seed: str) -> list[tuple]:
        out = tmp_path / f"run-{seed}-{len(list(tmp_path.iterdir()))}.json"
        code, output = _load(
            "--url",
            fake_server.url,
            "--model",
            "m",
            "--rate",
            "100",
            "--requests",
            "8",
            "--prompt-tokens",
            "20",
            "--prompt-sigma",
            "0.8",
            "--output-tokens",
            "2",
            "--output-sigma",
            "0.5",
            "--sessions",
            "3",
            "--seed",
            seed,
            "--no-progress",
            "--out",
            str(out),
        )
        assert code == 0, output
        return [
            (r["scheduled_s"], r["prompt_tokens"], r["requested_output_tokens"], r["session"])
            for r in json.loads(out.read_text())["requests"]
        ]

    first = run("42")
    prompts_first = sorted(r.body["prompt"] for r in fake_server.received)
    fake_server.received.clear()
    assert run("42") == first
    assert sorted(r.body["prompt"] for r in fake_server.received) == prompts_first
    assert run("43") != first


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rate", "1"], "give --duration or --requests"),
        (["--requests", "3"], "give --rate"),
        (["--rate", "1", "--requests", "3", "--burst", "1:2"], "--burst wants EVERY_S:COUNT:TOKENS"),
        (["--rate", "1", "--requests", "3", "--slo-ttft", "fast"], "is not a duration"),
        (["--rate", "1", "--requests", "3", "--tokenizer", "gpt"], "use 'bytes' or 'chars-per-token=X'"),
        (["--rate", "1", "--requests", "3", "--out", "no/such/folder/r.json"], "does not exist"),
    ],
)
def test_bad_flags_fail_with_a_usage_error(args: list[str], message: str) -> None:
    code, output = _load("--url", "http://127.0.0.1:9", "--model", "m", *args)
    assert code == 2
    assert message in output


def test_bad_replay_file_names_its_line(tmp_path: Path) -> None:
    replay = tmp_path / "bad.jsonl"
    replay.write_text('{"arrival_s": 0, "prompt_tokens": 4, "output_tokens": 2}\n{"arrival_s": 1}\n')
    code, output = _load("--url", "http://127.0.0.1:9", "--model", "m", "--replay", str(replay))
    assert code == 1
    assert f"{replay}:2: missing prompt_tokens, output_tokens" in output


def test_a_run_where_every_request_fails_exits_non_zero(port: int, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    code, output = _load(
        "--url", f"http://127.0.0.1:{port}", "--model", "m", "--rate", "inf", "--requests", "2", "--out", str(out)
    )
    assert code == 1
    assert "all 2 requests failed; first: connect" in output
    assert json.loads(out.read_text())["summary"]["errors_by_kind"]["connect"] == 2


def test_ctrl_c_stops_the_schedule_and_keeps_the_results(fake_server, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    repo_root = Path(__file__).resolve().parents[2]
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from tracer.cli.main import main; main()",
            "load",
            "--url",
            fake_server.url,
            "--model",
            "m",
            "--rate",
            "20",
            "--duration",
            "60",
            "--output-tokens",
            "2",
            "--out",
            str(out),
        ],
        cwd=repo_root,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    def three_received() -> bool:
        assert process.poll() is None, process.communicate()[0]  # it exited early: say why, not "timed out"
        return len(fake_server.received) >= 3

    try:
        wait_for(three_received, timeout_s=30, what="the load generator's first three requests")
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, output
    assert "interrupted" in output
    doc = json.loads(out.read_text())
    assert doc["stopped_early"] is True
    sent = [r for r in doc["requests"] if r["sent_s"] is not None]
    assert 3 <= len(sent) == doc["summary"]["sent"] < 1200
    assert all(r["status"] == "ok" for r in sent)  # requests in flight at the stop were finished
    assert doc["summary"]["wall_s"] < 60
