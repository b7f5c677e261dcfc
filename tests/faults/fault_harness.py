"""Helpers for the fault tests: memory of a process, a closed-loop workload in interleaved slices on two
servers, the merged /metrics, a `splitscope sidecar` child process, and what /proc/net/tcp says about a
connection.

Nothing here sleeps to wait for something: every wait polls a condition with a deadline (`wait_for`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import REPO_ROOT, wait_for
from tests.reference_server.server_harness import Server, http

SIDECAR_START_TIMEOUT_S = 60.0
# What every outage test holds a server to: throughput with its telemetry backend down, as a fraction of a
# healthy twin's on the same interleaved workload; and the allocator slack allowed on top of the bytes the
# outage may legitimately buffer before RSS growth counts as a leak.
#
# Two bounds. The product's target is 95% (TARGET_THROUGHPUT_RATIO), measured by bench/fault_throughput.py
# with long phases on a quiet machine and recorded in bench/RESULTS.md. A test on a shared 2-core machine
# cannot judge 5%: two like servers with healthy telemetry (an A/A run, no fault at all) measured 0.91-1.01
# over these slices beside four other busy processes, and a full-suite run beside a busy core once printed
# 0.87. So the test asserts what a test can: no stall. A telemetry fault that blocks the hot path (a send
# or connect waiting on a dead peer) costs serving far more than 20%; one that merely adds work shows in
# the bench.
TARGET_THROUGHPUT_RATIO = 0.95
MIN_THROUGHPUT_RATIO = 0.80
SERVER_RSS_SLACK_BYTES = 48 << 20
TCP_ESTABLISHED = 0x01
TCP_LISTEN = 0x0A


# ----------------------------------------------------------------------------------------- processes


def rss_bytes(pid: int) -> int:
    """Resident set size of `pid` (VmRSS of /proc/PID/status), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def server_rss_bytes(server: Server) -> dict[str, int]:
    """RSS of the router (the launcher process) and of every worker, by name."""
    names = {w["pid"]: w["name"] for w in server.health()["workers"]}
    out = {"router": rss_bytes(server.process.pid)}
    out.update({names.get(pid, str(pid)): rss_bytes(pid) for pid in server.worker_pids})
    return out


def stop_process(process: subprocess.Popen, grace_s: float = 5.0) -> int:
    """SIGTERM, then SIGKILL if it has not exited within `grace_s`; returns the exit status."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            return process.wait(grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
    return process.wait(10)


def kill_process(process: subprocess.Popen) -> None:
    """SIGKILL and reap: the crash of a telemetry component, with no chance to clean up."""
    if process.poll() is None:
        process.kill()
    process.wait(10)


class SidecarProcess:
    """`splitscope sidecar ARGS...` as a child process; `start()` returns once it says it is listening."""

    def __init__(self, log_path: Path, *args: str) -> None:
        self.log_path = log_path
        self.args = args
        self.process: subprocess.Popen | None = None

    def start(self) -> SidecarProcess:
        command = [sys.executable, "-c", "from tracer.cli.main import main; main()", "sidecar", "--no-gpu", *self.args]
        start_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )

        def listening_or_dead() -> bool:
            text = self.log_path.read_text(errors="replace")[start_offset:]
            return "splitscope sidecar listening" in text or self.process.poll() is not None

        wait_for(listening_or_dead, SIDECAR_START_TIMEOUT_S, "the sidecar's 'listening' line")
        if self.process.poll() is not None:
            raise AssertionError(f"sidecar exited with {self.process.returncode}:\n{self.log()}")
        return self

    def kill(self) -> None:
        assert self.process is not None
        kill_process(self.process)

    def close(self) -> None:
        if self.process is not None:
            kill_process(self.process)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


def start_server(tmp_dir: Path, environ: dict[str, str], *serve_args: str) -> Server:
    """A `Server` (tests.reference_server.server_harness) whose processes see `environ` on top of ours.

    Our own environment is left alone, so several servers may start at once on different threads.
    """
    tmp_dir.mkdir(parents=True, exist_ok=True)
    return Server(tmp_dir, *serve_args, env={**os.environ, **environ})


# ------------------------------------------------------------------------------------------ metrics


def metric_samples(server: Server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The router's merged /metrics (its own families plus every live worker's), as
    {(sample name, sorted labels): value}."""
    status, body, _ = http("GET", server.url + "/metrics", timeout_s=30.0)
    assert status == 200, body[:300]
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def metric_value(server: Server, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels` (0.0 when there are none)."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in metric_samples(server).items() if n == name and wanted <= set(ls))


def dropped_records(server: Server, reason: str) -> float:
    return metric_value(server, "splitscope_tracer_dropped_records_total", reason=reason)


# ----------------------------------------------------------------------------------------- workload

COMPLETION = {"prompt": "fault injection keeps serving " * 2, "max_tokens": 24, "ignore_eos": True}


@dataclass
class RoundResult:
    label: str
    output_tokens: int
    requests: int
    errors: int
    wall_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s


def closed_loop(server: Server, duration_s: float, label: str, clients: int = 3) -> RoundResult:
    """`clients` threads send COMPLETION back to back for `duration_s`; counts answered output tokens.

    The round's wall time runs until the last answer, so requests in flight at the deadline count in
    full and no round is cut short of its work.
    """
    tokens = [0] * clients
    requests = [0] * clients
    errors = [0] * clients
    deadline = time.monotonic() + duration_s

    def client(i: int) -> None:
        while time.monotonic() < deadline:
            status, body, _ = server.complete(COMPLETION, timeout_s=60.0)
            if status == 200:
                tokens[i] += json.loads(body)["usage"]["completion_tokens"]
                requests[i] += 1
            else:
                errors[i] += 1

    started = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(duration_s + 120)
    return RoundResult(label, sum(tokens), sum(requests), sum(errors), time.monotonic() - started)


@dataclass
class Phase:
    """Interleaved slices of one workload on two like servers, one with healthy telemetry, one faulted."""

    healthy: list[RoundResult] = field(default_factory=list)
    faulted: list[RoundResult] = field(default_factory=list)

    @property
    def pair_ratios(self) -> list[float]:
        """Faulted over healthy output tokens per second, slice pair by slice pair: their spread is the noise."""
        return [f.tokens_per_s / h.tokens_per_s for h, f in zip(self.healthy, self.faulted)]

    @property
    def ratio(self) -> float:
        """Faulted over healthy output tokens per second, each side's slices summarised by their midmean."""
        return midmean_tokens_per_s(self.faulted) / midmean_tokens_per_s(self.healthy)

    def extend(self, more: Phase) -> None:
        self.healthy += more.healthy
        self.faulted += more.faulted

    @property
    def errors(self) -> int:
        return sum(r.errors for r in self.healthy + self.faulted)

    def describe(self) -> str:
        return (
            f"healthy {midmean_tokens_per_s(self.healthy):.0f} tok/s, faulted {midmean_tokens_per_s(self.faulted):.0f}"
            f" tok/s (midmeans) over {len(self.healthy)} slices each"
            f" (pair ratios {', '.join(f'{r:.2f}' for r in self.pair_ratios)})"
        )


def midmean_tokens_per_s(results: list[RoundResult]) -> float:
    """Mean tokens per second of the middle half of the slices (the interquartile mean).

    Why not the pooled mean: now and then a slice loses half a second to something outside both servers.
    CI once printed pair ratios of 0.34-0.40 in five of 24 pairs and 1.8-2.0 in two, that is in both
    directions; a stopped Prometheus, which costs a server nothing, showed the same here. One such stall
    empties a 0.75 s slice and moves a 12-slice pooled mean by 5%, the whole bound. The midmean ignores
    the quarter of slices at either end on both sides alike, so it stays unbiased between like servers and
    keeps most of the mean's precision; a fault that slows serving throughout still moves it in full. What
    it cannot see, and neither can a test on a shared machine, is a fault that stalls only a few slices.
    """
    rates = sorted(r.tokens_per_s for r in results)
    quarter = len(rates) // 4
    middle = rates[quarter : len(rates) - quarter]
    return sum(middle) / len(middle)


def interleaved(healthy: Server, faulted: Server, *, slices: int = 8, slice_s: float = 0.75) -> Phase:
    """Load one server, then the other, in short alternating slices (ABBA), so that the shared machine's
    changing load falls on both alike; a slow drift cancels, and a fault that costs serving time shows.
    Eight slices for the tests' no-stall bound (MIN_THROUGHPUT_RATIO); bench/fault_throughput.py takes
    many more against the 95% target (with six, one full-suite run on an otherwise idle machine measured
    91.5% in both directions for a server that holds 95%+ run alone)."""
    phase = Phase()
    for i in range(slices):
        order = (
            (("healthy", healthy), ("faulted", faulted)) if i % 2 == 0 else (("faulted", faulted), ("healthy", healthy))
        )
        for label, server in order:
            getattr(phase, label).append(closed_loop(server, slice_s, label))
    return phase


def combined_ratio(first: Phase, second: Phase) -> float:
    """Throughput ratio with the fault on one server, then the other: the geometric mean of the two
    phases cancels any difference between the two servers themselves."""
    return (first.ratio * second.ratio) ** 0.5


def judged_ratio(first: Phase, second: Phase, more_of_second: Callable[[], Phase]) -> float:
    """The combined ratio, with a second look when the first falls under MIN_THROUGHPUT_RATIO: as many
    slices again in the second phase's state (still faulted), added to its first ones.

    Slice pairs scatter by 0.7-1.3x on this shared 2-core machine, so the combined ratio of two 12-slice
    phases has a standard error near 2.6%: a server whose telemetry is merely dead measured 94.5% once in
    CI (95% bound). The second look narrows that error where the first was inconclusive; a fault that
    costs serving time stays under the bound on both looks.
    """
    ratio = combined_ratio(first, second)
    if ratio < MIN_THROUGHPUT_RATIO:
        second.extend(more_of_second())
        ratio = combined_ratio(first, second)
    return ratio


# ------------------------------------------------------------------------------------------ sockets


@dataclass(frozen=True)
class TcpRow:
    local_port: int
    remote_port: int
    state: int
    rx_queue_bytes: int
    inode: int


def tcp_rows() -> list[TcpRow]:
    """IPv4 TCP sockets of this network namespace (/proc/net/tcp)."""
    rows = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        rows.append(
            TcpRow(
                local_port=int(fields[1].split(":")[1], 16),
                remote_port=int(fields[2].split(":")[1], 16),
                state=int(fields[3], 16),
                rx_queue_bytes=int(fields[4].split(":")[1], 16),
                inode=int(fields[9]),
            )
        )
    return rows


def socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:[") : -1]))
    return inodes


def unread_bytes_sent_by(sender_pid: int, receiver_pid: int) -> int:
    """Bytes that `sender_pid` sent over TCP to a port `receiver_pid` listens on and that the receiver has
    not read yet (its side's receive queue, accepted or still in the accept queue)."""
    rows = tcp_rows()
    receiver, sender = socket_inodes(receiver_pid), socket_inodes(sender_pid)
    listening = {r.local_port for r in rows if r.state == TCP_LISTEN and r.inode in receiver}
    sender_ports = {
        r.local_port for r in rows if r.state == TCP_ESTABLISHED and r.inode in sender and r.remote_port in listening
    }
    return sum(
        r.rx_queue_bytes
        for r in rows
        if r.state == TCP_ESTABLISHED and r.local_port in listening and r.remote_port in sender_ports
    )
