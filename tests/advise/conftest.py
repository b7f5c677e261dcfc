"""The advisor as a real process (`advise --follow --format json --metrics-port`), for the live tests."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, free_port, wait_for
from tracer import spans as s
from tracer.otlp import SPAN_KIND_SERVER, iter_spans

HOLD = 2
DECIDE_WAIT_S = 120.0  # a window's decision is a report (about a second here; several on a busy machine)
FOR_SCALE = 0.005  # LayoutChangeAdvised 15m -> 4.5 s


@dataclass
class Advisor:
    """`python -m tracer.cli.main advise --follow --format json ...`; its stdout lines, parsed, as they come."""

    process: subprocess.Popen[bytes]
    port: int
    lines: list[dict] = field(default_factory=list)
    received_s: list[float] = field(default_factory=list)  # monotonic time each line arrived

    def read(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            self.received_s.append(time.monotonic())
            self.lines.append(json.loads(raw))

    def wait_windows(self, n: int, what: str) -> list[dict]:
        def enough() -> bool:
            if self.process.poll() is not None:
                pytest.fail(f"the advisor exited with {self.process.returncode}")
            return len(self.lines) >= n

        wait_for(enough, DECIDE_WAIT_S, what)
        return self.lines


@pytest.fixture
def start_advisor(tmp_path: Path) -> Iterator:
    started: list[Advisor] = []

    def start(traces: Path | None, *args: str, window_s: float, grace_s: float) -> Advisor:
        """The advisor tailing `traces` (None: no file; pass --otlp-port in `args`), holding over HOLD windows."""
        port = free_port()
        files = [str(traces)] if traces is not None else []
        command = [sys.executable, "-m", "tracer.cli.main", "advise", *files, "--follow", "--format", "json"]
        command += ["--window", f"{window_s:g}s", "--hold", str(HOLD), "--grace", f"{grace_s:g}s"]
        command += ["--poll-interval", "0.2s", "--metrics-port", str(port), *args]
        stderr = open(tmp_path / f"advise-{len(started)}.log", "wb")  # noqa: SIM115  (closed with the process)
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=stderr)
        stderr.close()
        advisor = Advisor(process, port)
        threading.Thread(target=advisor.read, daemon=True).start()
        started.append(advisor)
        # Serving /metrics: its signal handlers are installed (before the server starts), so SIGTERM is clean.
        wait_for(lambda: _answers(f"http://127.0.0.1:{port}/metrics"), 60, "the advisor's /metrics")
        return advisor

    yield start
    for advisor in started:
        if advisor.process.poll() is None:
            advisor.process.send_signal(signal.SIGTERM)
        assert advisor.process.wait(30) == 0  # SIGTERM ends it cleanly


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def arrivals_ns(traces: Path) -> list[int]:
    """Start of every request span in the file (the router's SERVER root spans), read without the advisor."""
    return sorted(
        span.start_ns
        for span in iter_spans([traces], growing=True)
        if span.name.startswith(s.ROOT_SPAN_PREFIXES) and span.kind == SPAN_KIND_SERVER
    )
