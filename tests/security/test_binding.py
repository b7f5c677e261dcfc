"""Every listener binds 127.0.0.1 unless told otherwise; elsewhere it needs a shared-secret token.

The token guards the KV transfer and the workers' internal API (SPLITSCOPE_KV_TOKEN) and the sidecar's
ingest (SPLITSCOPE_SIDECAR_TOKEN); peers without it are refused, and the comparison is constant-time.
"""

from __future__ import annotations

import hmac
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from opentelemetry.proto.collector.trace.v1 import (
    trace_service_pb2,
)

from reference_server.kv_transfer import TOKEN_ENV_VAR
from reference_server.kv_transfer import wire as transfer_wire
from reference_server.kv_transfer.wire import read_frame, send_frame
from reference_server.launch.serve import ServeConfig, worker_command
from reference_server.serving.worker import WorkerOptions
from tests.conftest import REPO_ROOT
from tests.reference_server.server_harness import Server, http
from tests.security.listeners import descendants, listening
from tests.security.processes import SidecarProcess, clean_environment, probe_health
from tests.sidecar.conftest import assert_grpc_export_needs_token, assert_unix_handshake_refused
from tracer import auth
from tracer.sidecar.auth import TOKEN_ENV
from tracer.sidecar.server import Sidecar, SidecarConfig

EXIT_TIMEOUT_S = 120.0  # a worker imports torch before it parses its flags


def test_every_listener_of_a_default_server_and_sidecar_is_on_loopback(server: Server, sidecar: SidecarProcess) -> None:
    server_pids = descendants(server.process.pid)
    assert set(server.worker_pids) <= set(server_pids)
    server_listeners = listening(server_pids)
    sidecar_listeners = listening(descendants(sidecar.process.pid))
    # router + its --metrics-port, each worker's internal API, the decode worker's KV receiver
    assert len(server_listeners) >= 5, server_listeners
    assert {server.port, server.metrics_port} <= {listener.port for listener in server_listeners}
    # OTLP/HTTP, OTLP/gRPC, /metrics
    assert {sidecar.http_port, sidecar.grpc_port, sidecar.metrics_port} <= {
        listener.port for listener in sidecar_listeners
    }
    exposed = [listener for listener in server_listeners + sidecar_listeners if listener.host != "127.0.0.1"]
    assert exposed == [], f"listening beyond loopback: {exposed}"


def test_router_follows_host_but_workers_stay_on_loopback() -> None:
    """`serve --host 0.0.0.0` opens the public API wide (the user's explicit choice); the launcher never
    passes --host on to its workers, so their internal APIs and KV receivers stay on 127.0.0.1."""
    config = ServeConfig(mode="disaggregated", host="0.0.0.0")
    for role, name in config.roles():
        command = worker_command(config, role, name, threads=1)
        assert "--host" not in command and "0.0.0.0" not in command, command
    assert WorkerOptions(role="decode", name="d").host == "127.0.0.1"


def _run_until_exit_or_ready(command: list[str], env: dict[str, str]) -> tuple[int | None, str]:
    """(exit status, output) of a process expected to refuse to start; (None, output) if it came up instead."""
    process = subprocess.Popen(
        command,
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    assert process.stdout is not None
    lines = []
    try:
        for line in process.stdout:  # ends at EOF, i.e. when the process exits
            lines.append(line)
            if "SPLITSCOPE_WORKER_READY" in line or "sidecar listening" in line:
                return None, "".join(lines)
        return process.wait(EXIT_TIMEOUT_S), "".join(lines)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


@pytest.mark.timeout(EXIT_TIMEOUT_S * 2)
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_worker_beyond_loopback_without_token_refuses_to_start(role: str) -> None:
    command = [
        sys.executable,
        "-m",
        "reference_server.serving.worker",
        "--role",
        role,
        "--name",
        f"{role}-0",
        "--preset",
        "tiny",
        "--host",
        "0.0.0.0",
    ]
    status, output = _run_until_exit_or_ready(command, clean_environment())
    assert status is not None, f"a {role} worker served on 0.0.0.0 without a token:\n{output}"
    assert status != 0 and TOKEN_ENV_VAR in output and "0.0.0.0" in output, output
    assert "Traceback" not in output, output


def test_sidecar_beyond_loopback_without_token_refuses_to_start() -> None:
    command = [
        sys.executable,
        "-m",
        "tracer.cli.main",
        "sidecar",
        "--host",
        "0.0.0.0",
        "--http-port",
        "0",
        "--grpc-port",
        "0",
        "--no-gpu",
    ]
    status, output = _run_until_exit_or_ready(command, clean_environment())
    assert status is not None, f"the sidecar served on 0.0.0.0 without a token:\n{output}"
    assert status != 0 and TOKEN_ENV in output, output
    assert "Traceback" not in output and len(output.strip().splitlines()) == 1, output


@pytest.mark.timeout(EXIT_TIMEOUT_S * 2)
def test_worker_beyond_loopback_with_token_refuses_peers_without_it(tmp_path) -> None:
    """A decode worker on 0.0.0.0: its internal API answers 401 and its KV receiver 'unauthorized' to a
    peer without the token, and serves one that has it."""
    command = [
        sys.executable,
        "-m",
        "reference_server.serving.worker",
        "--role",
        "decode",
        "--name",
        "decode-0",
        "--preset",
        "tiny",
        "--host",
        "0.0.0.0",
    ]
    env = clean_environment(**{TOKEN_ENV_VAR: "s3cret"})
    with (
        open(tmp_path / "worker.log", "w+") as log,
        subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, text=True
        ) as worker,
    ):
        try:
            assert worker.stdout is not None
            ready = next((line for line in worker.stdout if line.startswith("SPLITSCOPE_WORKER_READY")), None)
            assert ready is not None, f"worker did not start:\n{(tmp_path / 'worker.log').read_text()}"
            listeners = listening([worker.pid])
            assert len(listeners) == 2 and all(listener.host == "0.0.0.0" for listener in listeners), listeners
            answers = {listener.port: probe_health(f"http://127.0.0.1:{listener.port}") for listener in listeners}
            (api_port,) = [port for port, answer in answers.items() if answer is not None]
            (kv_port,) = [port for port, answer in answers.items() if answer is None]  # not HTTP: the KV receiver
            base = f"http://127.0.0.1:{api_port}"
            assert answers[api_port][0] == 401
            assert http("GET", base + "/metrics", headers={"Authorization": "Bearer wrong"})[0] == 401
            assert http("POST", base + "/generate", {"request_id": "r"})[0] == 401
            assert http("GET", base + "/health", headers={"Authorization": "Bearer s3cret"})[0] == 200
            for token in (None, "wrong"):
                with socket.create_connection(("127.0.0.1", kv_port), timeout=10) as sock:
                    send_frame(sock, transfer_wire.clock_message(0, token))
                    reply = read_frame(sock, eof_ok=True)
                assert reply is not None and reply["type"] == "error" and reply["reason"] == "unauthorized", reply
            with socket.create_connection(("127.0.0.1", kv_port), timeout=10) as sock:
                send_frame(sock, transfer_wire.clock_message(0, "s3cret"))
                assert read_frame(sock)["type"] == "clock_reply"
        finally:
            worker.terminate()


def test_sidecar_beyond_loopback_with_token_refuses_peers_without_it(tmp_path) -> None:
    sidecar = Sidecar(
        SidecarConfig(
            host="0.0.0.0",
            http_port=0,
            grpc_port=0,
            unix_socket=str(tmp_path / "s.sock"),
            traces_file=str(tmp_path / "t.jsonl"),
            gpu=False,
            environ={TOKEN_ENV: "s3cret"},
        )
    )
    sidecar.start()
    try:
        hosts = {
            listener.host
            for listener in listening([os.getpid()])
            if listener.port in (sidecar.http_port, sidecar.grpc_port)
        }
        assert hosts and hosts <= {"0.0.0.0", "::"}, hosts  # gRPC makes 0.0.0.0 a dual-stack socket
        url = f"http://127.0.0.1:{sidecar.http_port}/v1/traces"
        empty = trace_service_pb2.ExportTraceServiceRequest()
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            request = urllib.request.Request(
                url, data=empty.SerializeToString(), headers={"Content-Type": "application/x-protobuf", **headers}
            )
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=10)
            assert refused.value.code == 401
        assert_grpc_export_needs_token(sidecar.grpc_port, empty, "s3cret")
        assert_unix_handshake_refused(tmp_path / "s.sock", "")
    finally:
        sidecar.stop(2.0)


def test_tokens_are_compared_in_constant_time(monkeypatch) -> None:
    """Every token check goes through hmac.compare_digest (no early exit on the first differing byte)."""
    calls = []
    real = hmac.compare_digest

    def recording(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", recording)
    assert not transfer_wire.token_matches("s3cret", {"token": "s3creX"})
    assert not auth.bearer_ok("s3cret", "Bearer s3creX")
    assert not auth.token_ok("s3cret", "s3creX")
    assert len(calls) == 3 and all(b"s3creX" in pair for pair in calls)
