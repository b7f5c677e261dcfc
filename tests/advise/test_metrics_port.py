"""`advise TRACES --metrics-port` without --follow, as a real process: it decides every window, writes the
result, serves the last window's advice on /metrics (read back with prometheus_client's parser) until
SIGTERM, then exits 0. And --follow's bad input: one clear error, a non-zero exit."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request

from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import REPO_ROOT, free_port, wait_for
from tests.synthetic import SYNTHETIC_ROUTER, scenario, write_traces
from tracer.cli.main import main


def _scrape(url: str) -> dict[str, list]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return {}
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def _document(path) -> dict | None:  # type: ignore[no-untyped-def]
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None  # not written yet, or being written


def test_without_follow_it_decides_every_window_then_serves_the_last_advice(tmp_path) -> None:  # type: ignore[no-untyped-def]
    short = scenario("chatty", n_requests=160)  # about 20 s of steady short prompts: two or three 10 s windows
    traces = tmp_path / "steady.jsonl"
    write_traces(traces, short.layout, short.workload, short.costs, seed=7)
    port, out = free_port(), tmp_path / "advice.json"
    command = [sys.executable, "-m", "tracer.cli.main", "advise", str(traces), "--window", "10s", "--slo-ttft", "1",
               "--slo-itl", "0.25", "--router", SYNTHETIC_ROUTER, "--sim-requests", "100", "--namespace", "team-b",
               "--metrics-port", str(port), "--format", "json", "-o", str(out)]  # fmt: skip
    process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        document = wait_for(lambda: _document(out), 120, "the advice written")  # before the windows are published
        windows = len(document["windows"])
        assert windows >= 2 and [w["verdict"] for w in document["windows"]] == ["stay-colocated"] * windows
        decided = wait_for(
            lambda: (m := _scrape(url)) and sum(s.value for s in m["splitscope_advice_decisions"]) == windows and m,
            60, "every window published",
        )  # fmt: skip
        (info,) = decided["splitscope_advice_info"]
        assert info.labels == {
            "namespace": "team-b",
            "verdict": "stay-colocated",
            "target": "",
            "deployed": "colocated",
        }
        reasons = {
            s.labels["reason"]: s.value for s in decided["splitscope_advice_decisions"] if s.name.endswith("_total")
        }
        assert reasons == {"first": 1, "agreed": windows - 1, "held": 0, "changed": 0, "insufficient_data": 0}
        (requests,) = decided["splitscope_advice_window_requests"]
        assert requests.value == document["windows"][-1]["requests"]
        assert [s.value for s in decided["splitscope_advice_differs"]] == [0.0]
        assert process.poll() is None  # still serving
    finally:
        process.send_signal(signal.SIGTERM)
        returncode = process.wait(30)
    assert returncode == 0, process.stderr.read().decode() if process.stderr else ""


def test_follow_refuses_a_negative_grace_with_one_clear_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    result = CliRunner().invoke(
        main,
        ["advise", str(tmp_path / "later.jsonl"), "--follow", "--window", "5s", "--grace", "-1s",
         "--slo-ttft", "1", "--slo-itl", "0.1"],
    )  # fmt: skip
    assert result.exit_code != 0
    errors = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert len(errors) == 1 and ("--grace" in errors[0] or "positive duration" in errors[0]), result.output


def test_without_follow_a_missing_file_is_one_clear_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    result = CliRunner().invoke(
        main, ["advise", str(tmp_path / "nope.jsonl"), "--window", "5s", "--slo-ttft", "1", "--slo-itl", "0.1"]
    )
    assert result.exit_code == 2
    errors = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert len(errors) == 1 and "does not exist" in errors[0], result.output
