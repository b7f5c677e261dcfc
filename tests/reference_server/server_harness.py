"""Helpers for the reference server's process tests: run `splitscope serve` for real, talk HTTP to it.

Nothing here sleeps to wait for something: `wait_for` polls a condition until a deadline.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import torch

from reference_server.kv_cache import BlockAllocator, KVCachePool
from reference_server.model import ModelArgs, build_model, generate
from reference_server.tokenizer import encode
from tests.conftest import REPO_ROOT, wait_for  # noqa: F401  (wait_for: the tests import it from here too)
from tracer.otlp import Span, iter_spans

STARTUP_TIMEOUT_S = 180.0  # workers import torch and build the model; a loaded 2-core box is slow


def http(
    method: str,
    url: str,
    body: Any = None,
    *,
    raw: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout_s: float = 60.0,
) -> tuple[int, bytes, dict[str, str]]:
    """(status, body, headers) of one request; never raises on an HTTP error status."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), dict(exc.headers)


def sse_events(payload: bytes) -> list[Any]:
    """The `data:` payloads of an SSE body, JSON-decoded ("[DONE]" kept as a string)."""
    events = []
    for line in payload.decode().splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def streamed_token_ids(events: list[Any]) -> list[int]:
    return [t for e in events if isinstance(e, dict) and e.get("choices") for t in e["choices"][0].get("token_ids", [])]


def reference_tokens(prompt: str, max_tokens: int, preset: str = "tiny", seed: int = 0) -> list[int]:
    """Greedy tokens of a direct, in-process `model.generate` (no EOS stop)."""
    args = ModelArgs.from_name(preset)
    model = build_model(args, seed=seed)
    pool = KVCachePool(args, 128, 16, device="cpu", dtype=torch.float32)
    return generate(model, encode(prompt), max_tokens, pool, BlockAllocator(128, 16), stop_at_eos=False)


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class Server:
    """`splitscope serve --preset PRESET ...` (default tiny) as a child process, on free ports, writing a traces file."""

    def __init__(
        self, tmp_dir: Path, *serve_args: str, env: dict[str, str] | None = None, preset: str = "tiny"
    ) -> None:
        """Start the server and wait until it answers /health; `env`: the children's environment (default ours);
        `preset`: the model (also the name it serves under)."""
        self.preset = preset
        self.traces_file = tmp_dir / "traces.jsonl"
        self.log_file = tmp_dir / "serve.log"
        command = [
            sys.executable,
            "-c",
            "from tracer.cli.main import main; main()",
            "serve",
            "--preset",
            preset,
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--traces-file",
            str(self.traces_file),
            *serve_args,
        ]
        with open(self.log_file, "wb") as log:
            self.process = subprocess.Popen(
                command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
            )
        # The launcher prints the ports the OS gave it: no race with other processes for a port.
        serving = wait_for(self._serving_line_or_dead, STARTUP_TIMEOUT_S, "the server's 'serving ... on' line")
        if self.process.poll() is not None or not isinstance(serving, re.Match):
            raise AssertionError(f"serve exited with {self.process.returncode}:\n{self.log()}")
        self.port, self.metrics_port = int(serving.group(1)), int(serving.group(2))
        wait_for(self._healthy, 30, "the server's /health")
        self.worker_pids = [w["pid"] for w in self.health()["workers"]]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_file.read_text(errors="replace")[-4000:]

    def _serving_line_or_dead(self) -> re.Match | bool:
        match = re.search(
            r"serving .* on http://127\.0\.0\.1:(\d+), metrics on :(\d+)", self.log_file.read_text(errors="replace")
        )
        return match or self.process.poll() is not None

    def _healthy(self) -> bool:
        try:
            status, _, _ = http("GET", self.url + "/health", timeout_s=2.0)
        except OSError:
            return False
        return status == 200

    def health(self) -> dict:
        status, body, _ = http("GET", self.url + "/health")
        return json.loads(body)

    def complete(self, body: dict, **kwargs: Any) -> tuple[int, bytes, dict[str, str]]:
        return http("POST", self.url + "/v1/completions", {"model": self.preset, **body}, **kwargs)

    def spans(self) -> list[Span]:
        return list(iter_spans([self.traces_file], growing=True)) if self.traces_file.exists() else []

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        if self.process.poll() is None:
            os.kill(self.process.pid, sig)
        return self.process.wait(timeout_s)

    def close(self) -> None:
        """Test teardown: stop the launcher, and never leave a worker behind even if the test failed."""
        try:
            self.stop()
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
        for pid in self.worker_pids:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
