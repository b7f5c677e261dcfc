"""Run `splitscope serve` as a child process and wait until it answers: for the demo, benches and tests.

    with ServerProcess(["--preset", "tiny", "--mode", "colocated"]) as server:
        ...  # server.url answers /v1/completions

`start()` blocks until GET /health answers 200 (polling with a deadline) or the child exits. `stop()`
sends SIGTERM and waits: the launcher stops its workers and flushes traces before it exits.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

STARTUP_TIMEOUT_S = 300.0  # workers import torch and build the model; a loaded 2-core box is slow
STOP_TIMEOUT_S = 60.0
_POLL_S = 0.1


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ServerProcess:
    """A reference server in a child process. `args` are `splitscope serve` flags (without --port)."""

    def __init__(
        self,
        args: list[str],
        *,
        port: int | None = None,
        log_path: Path | None = None,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = args
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen | None = None

    def start(self) -> ServerProcess:
        command = [sys.executable, "-m", "tracer.cli.main", "serve", "--port", str(self.port), *self.args]
        log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        try:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        finally:
            if not isinstance(log, int):  # the file opened above (subprocess.DEVNULL is an int)
                log.close()
        deadline = time.monotonic() + self.startup_timeout_s
        while not self._healthy():
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"server exited with status {self.process.returncode} before serving"
                    + (f"; see {self.log_path}" if self.log_path else "")
                )
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not answer /health within {self.startup_timeout_s:g} s")
            time.sleep(_POLL_S)  # poll interval of the health check
        return self

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, wait (the launcher stops its workers and flushes traces), SIGKILL past the timeout."""
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(10)

    def __enter__(self) -> ServerProcess:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
