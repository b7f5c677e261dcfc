"""The listeners under test, as users run them: `splitscope serve` and `splitscope sidecar` as processes.

`ServedWorker` finds a running server's worker endpoints from /proc (the router does not publish them):
each worker listens on its internal HTTP API and, for a decode worker, on its KV receiver.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from http.client import HTTPException
from pathlib import Path

from tests.conftest import REPO_ROOT
from tests.reference_server.server_harness import Server, http, wait_for
from tests.security.listeners import listening

SIDECAR_MAX_BODY_BYTES = 64 * 1024
STARTUP_TIMEOUT_S = 120.0
_LISTENING = re.compile(
    r"listening: otlp/http 127\.0\.0\.1:(\d+), otlp/grpc 127\.0\.0\.1:(\d+), unix (\S+), metrics 127\.0\.0\.1:(\d+)"
)


def clean_environment(**extra: str) -> dict[str, str]:
    """This process's environment without tokens or OTLP endpoints (so defaults are what is tested)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_EXPORTER_OTLP", "SPLITSCOPE_"))}
    env["PYTHONPATH"] = str(REPO_ROOT)
    return env | extra


class SidecarProcess:
    """`splitscope sidecar` with OTLP/HTTP, OTLP/gRPC, a Unix socket and /metrics, all on defaults but ports."""

    def __init__(self, tmp_dir: Path) -> None:
        self.socket_path = tmp_dir / "sidecar.sock"
        self.traces_file = tmp_dir / "sidecar-traces.jsonl"
        self.log_file = tmp_dir / "sidecar.log"
        command = [
            sys.executable,
            "-m",
            "tracer.cli.main",
            "sidecar",
            "--http-port",
            "0",
            "--grpc-port",
            "0",
            "--metrics-port",
            "0",
            "--socket",
            str(self.socket_path),
            "--traces-file",
            str(self.traces_file),
            "--no-gpu",
            "--max-body-bytes",
            str(SIDECAR_MAX_BODY_BYTES),
        ]
        with open(self.log_file, "wb") as log:
            self.process = subprocess.Popen(
                command,
                cwd=REPO_ROOT,
                env=clean_environment(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        found = wait_for(self._listening_or_dead, STARTUP_TIMEOUT_S, "the sidecar's 'listening' line")
        if not isinstance(found, re.Match):
            raise AssertionError(f"sidecar exited with {self.process.returncode}:\n{self.log()}")
        self.http_port, self.grpc_port, self.metrics_port = int(found[1]), int(found[2]), int(found[4])

    def _listening_or_dead(self) -> re.Match | bool:
        return _LISTENING.search(self.log_file.read_text(errors="replace")) or self.process.poll() is not None

    def log(self) -> str:
        return self.log_file.read_text(errors="replace")[-4000:]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def healthy(self) -> bool:
        return self.process.poll() is None and http("GET", self.url + "/health", timeout_s=10)[0] == 200

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def probe_health(base_url: str) -> tuple[int, bytes] | None:
    """(status, body) of GET /health, or None when the listener does not speak HTTP (a KV receiver)."""
    try:
        status, body, _ = http("GET", base_url + "/health", timeout_s=5)
    except (OSError, HTTPException):
        return None
    return status, body


@dataclass(frozen=True)
class ServedWorker:
    pid: int
    pool: str
    url: str  # its internal HTTP API
    kv_address: tuple[str, int] | None  # decode workers: the KV receiver


def served_workers(server: Server) -> list[ServedWorker]:
    """Each worker of `server`: which of its listeners answers GET /health is its API, the other its KV receiver."""
    out = []
    for pid in server.worker_pids:
        api, kv = None, None
        for listener in listening([pid]):
            address = f"http://{listener.host}:{listener.port}"
            answer = probe_health(address)
            if answer is not None and answer[0] == 200:
                api = (address, json.loads(answer[1])["pool"])
            else:
                kv = (listener.host, listener.port)
        assert api is not None, f"worker {pid} has no internal API listening"
        out.append(ServedWorker(pid, api[1], api[0], kv))
    return out
