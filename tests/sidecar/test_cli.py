"""`splitscope sidecar` as users run it: a real process, real ports, clear errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.error

from click.testing import CliRunner

from tests.conftest import free_port
from tests.sidecar.conftest import http_get, spans_when, wait_for
from tracer.cli.main import main
from tracer.sidecar.auth import TOKEN_ENV
from tracer.sidecar.client import SidecarSink
from tracer.spans import SpanData


def test_help_lists_the_receivers():
    result = CliRunner().invoke(main, ["sidecar", "--help"])
    assert result.exit_code == 0
    for option in ("--http-port", "--grpc-port", "--socket", "--traces-file", "--scrape", "--pool", "--metrics-port"):
        assert option in result.output


def test_bad_scrape_target_and_exposed_bind_fail_with_one_line():
    runner = CliRunner()
    result = runner.invoke(main, ["sidecar", "--scrape", "tgi=http://x"])
    assert result.exit_code == 2 and "expected ENGINE=URL" in result.output
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    result = runner.invoke(main, ["sidecar", "--host", "0.0.0.0", "--no-gpu"], env={**env, TOKEN_ENV: ""})
    assert result.exit_code == 1 and f"needs a shared secret: set ${TOKEN_ENV}" in result.output


def _health(port: int) -> bool:
    try:
        return http_get(f"http://127.0.0.1:{port}/health")[0] == 200
    except (urllib.error.URLError, ConnectionError):
        return False


def test_runs_as_a_process_serves_metrics_ingests_and_stops_on_sigterm(tmp_path):
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    sock, traces = tmp_path / "s.sock", tmp_path / "t.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from tracer.cli.main import main; main()",
            "sidecar",
            "--http-port",
            str(http_port),
            "--grpc-port",
            str(grpc_port),
            "--metrics-port",
            str(metrics_port),
            "--socket",
            str(sock),
            "--traces-file",
            str(traces),
            "--no-gpu",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        wait_for(lambda: _health(http_port) or process.poll() is not None, 30, "the sidecar to answer /health")
        assert process.poll() is None, process.stderr.read()
        sink = SidecarSink(sock)
        sink.emit(
            [
                SpanData(
                    "splitscope.step", 1, 5, 6, 0, 10, 20, {"splitscope.pool": "colocated", "splitscope.worker": "w0"}
                )
            ]
        )
        sink.shutdown(5.0)
        spans_when(traces, 1)
        for port in (http_port, metrics_port):
            status, body = http_get(f"http://127.0.0.1:{port}/metrics")
            assert (
                status == 200
                and b'splitscope_step_duration_seconds_count{pool="colocated",prefill_in_step="false"} 1.0' in body
            )
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        assert "listening" in process.stderr.read()
        assert not sock.exists()  # the socket file is removed on a clean stop
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
