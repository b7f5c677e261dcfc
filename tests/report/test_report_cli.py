"""`splitscope report` end to end: formats, one-line errors with line numbers, --skip-bad, Prometheus."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading

import pytest
from aiohttp import web
from click.testing import CliRunner

from tracer.cli.options import parse_duration_s
from tracer.report.cli import report_command


def _args(sc, path, *extra: str) -> list[str]:
    # No bootstrap: these tests judge the command line, not the confidence (test_confidence.py does), and
    # twenty re-runs made each of them 20-35 s on a busy machine.
    return [
        str(path),
        "--slo-ttft",
        str(sc.slo_ttft_s),
        "--slo-itl",
        str(sc.slo_itl_s),
        "--sim-requests",
        "100",
        "--confidence-resamples",
        "0",
        *extra,
    ]


def test_json_output_has_the_contract_fields(scenario_traces, tmp_path):
    sc, path, _ = scenario_traces("wrong-split")
    out = tmp_path / "r.json"
    result = CliRunner().invoke(report_command, _args(sc, path, "--format", "json", "-o", str(out)))
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert {"verdict", "ratio", "chunk_budget_tokens", "goodput", "slo", "fits", "evidence", "assumptions"} <= set(
        report
    )
    assert report["verdict"] == "rebalance" and report["from_ratio"] == "3:1"
    assert {o["option"] for o in report["goodput"]} >= {"colocated x4", "split 1:3", "split 2:2", "split 3:1"}
    assert report["slo"] == {"ttft_s": sc.slo_ttft_s, "itl_s": sc.slo_itl_s, "itl_stat": "p99", "attainment": 0.9}


def test_markdown_to_stdout_states_verdict_and_assumptions(scenario_traces):
    sc, path, _ = scenario_traces("wrong-split")
    result = CliRunner().invoke(report_command, _args(sc, path, "--itl-stat", "max", "--gpus", "4"))
    assert result.exit_code == 0, result.output
    assert "**Verdict: rebalance 3:1 -> " in result.output
    assert "## Assumptions" in result.output and "max inter-token gap" in result.output


def _splitscope(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "from tracer.cli.main import main; main()", "report", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_truncated_line_fails_with_one_line_naming_file_and_line(scenario_traces, tmp_path):
    sc, path, _ = scenario_traces("chatty")
    lines = path.read_text().splitlines(keepends=True)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(lines[:3]) + lines[3][: len(lines[3]) // 2] + "\n" + "".join(lines[4:]))
    done = _splitscope(*_args(sc, bad))
    assert done.returncode != 0
    message = done.stderr.strip().splitlines()
    assert len(message) == 1 and f"{bad}:4:" in message[0] and "not valid JSON" in message[0]


def test_a_span_missing_an_attribute_names_it_and_skip_bad_counts_it(scenario_traces, tmp_path):
    sc, path, _ = scenario_traces("chatty")
    lines = path.read_text().splitlines(keepends=True)
    record = json.loads(lines[-1])  # a line of step spans
    record["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["attributes"] = [
        a
        for a in record["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["attributes"]
        if a["key"] != "splitscope.step.prefill_tokens"
    ]
    bad = tmp_path / "missing.jsonl"
    bad.write_text("".join(lines[:-1]) + json.dumps(record) + "\n")
    result = CliRunner().invoke(report_command, _args(sc, bad))
    assert result.exit_code == 1
    assert f"{bad}:{len(lines)}:" in result.output and "splitscope.step.prefill_tokens" in result.output

    out = tmp_path / "r.json"
    result = CliRunner().invoke(report_command, _args(sc, bad, "--skip-bad", "--format", "json", "-o", str(out)))
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["read"]["skipped_spans"] == 1
    assert any("skipped 0 bad lines and 1 bad spans" in line for line in report["assumptions"])


def test_bad_flags_are_usage_errors():
    result = CliRunner().invoke(report_command, ["/nonexistent.jsonl", "--slo-ttft", "1", "--slo-itl", "0.1"])
    assert result.exit_code == 2 and "does not exist" in result.output
    assert parse_duration_s("15m") == 900 and parse_duration_s("2h") == 7200
    with pytest.raises(ValueError):
        parse_duration_s("soon")


@pytest.fixture
def prometheus_api(port):
    """A minimal Prometheus HTTP API (instant vector queries) on a real socket."""
    queries: list[str] = []

    async def query(request: web.Request) -> web.Response:
        promql = request.query["query"]
        queries.append(promql)
        result = [
            {"metric": {"pool": pool}, "value": [0, value]} for pool, value in (("decode", "0.93"), ("prefill", "0.21"))
        ]
        return web.json_response({"status": "success", "data": {"resultType": "vector", "result": result}})

    app = web.Application()
    app.router.add_get("/api/v1/query", query)
    runner = web.AppRunner(app)
    ready = threading.Event()
    loop = asyncio.new_event_loop()

    async def start() -> None:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        ready.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(start()), loop.run_forever()), daemon=True)
    thread.start()
    assert ready.wait(10)
    yield f"http://127.0.0.1:{port}", queries
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_prometheus_adds_per_pool_evidence(scenario_traces, tmp_path, prometheus_api):
    url, queries = prometheus_api
    sc, path, _ = scenario_traces("wrong-split")
    out = tmp_path / "r.json"
    result = CliRunner().invoke(
        report_command, _args(sc, path, "--prometheus", url, "--since", "5m", "--format", "json", "-o", str(out))
    )
    assert result.exit_code == 0, result.output
    evidence = json.loads(out.read_text())["evidence"]
    assert "Prometheus busy ratio over 300s: decode 0.93, prefill 0.21" in evidence
    assert any("[300s]" in q and "splitscope_worker_busy_seconds_total" in q for q in queries)


def test_an_unreachable_prometheus_is_one_clear_error(scenario_traces, port):
    sc, path, _ = scenario_traces("chatty")
    result = CliRunner().invoke(report_command, _args(sc, path, "--prometheus", f"http://127.0.0.1:{port}"))
    assert result.exit_code == 1 and "could not be queried" in result.output


def test_a_max_batch_below_one_is_a_usage_error(scenario_traces):
    sc, path, _ = scenario_traces("chatty")
    result = CliRunner().invoke(report_command, _args(sc, path, "--max-batch", "0"))
    assert result.exit_code == 2 and "--max-batch" in result.output
