"""The sidecar killed under load (architecture.md §9: a crash of the sidecar never stalls serving).

Two like servers ship their spans (router and worker) each to its own `splitscope sidecar` over a Unix
socket. One sidecar is SIGKILLed, and the same closed-loop workload runs on both servers in short
interleaved slices; then the roles swap. Serving must not stall (at least MIN_THROUGHPUT_RATIO of its healthy
throughput; the 95% target is measured by bench/fault_throughput.py), the
spans lost with the dead sidecar are counted, memory stays put, and a new sidecar on the same socket gets
spans again.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.conftest import wait_for
from tests.faults.fault_harness import (
    MIN_THROUGHPUT_RATIO,
    SERVER_RSS_SLACK_BYTES,
    SidecarProcess,
    closed_loop,
    dropped_records,
    interleaved,
    judged_ratio,
    server_rss_bytes,
    start_server,
)
from tracer.sidecar.client import SidecarSink

# The sink holds at most this many encoded spans per process. These outages produce far fewer (the flood
# test in test_flood_memory.py reaches the cap); growth above the cap plus allocator slack means a leak.
SINK_CAP_SPANS = SidecarSink.__init__.__kwdefaults__["max_buffered_spans"]
ENCODED_BYTES_PER_SPAN = 300  # ~250 measured for a step span through wire.encode_frame; rounded up


class Deployment:
    """A server whose telemetry goes to its own sidecar."""

    def __init__(self, tmp_dir: Path) -> None:
        tmp_dir.mkdir()
        self.socket_path = tmp_dir / "sidecar.sock"
        self.sidecar_traces = tmp_dir / "sidecar-traces.jsonl"
        self.sidecar = SidecarProcess(
            tmp_dir / "sidecar.log",
            "--socket",
            str(self.socket_path),
            "--no-http",
            "--no-grpc",
            "--traces-file",
            str(self.sidecar_traces),
        ).start()
        self.server = start_server(
            tmp_dir / "server", {}, "--mode", "colocated", "--workers", "1", "--sidecar-socket", str(self.socket_path)
        )

    def traces_size(self) -> int:
        return self.sidecar_traces.stat().st_size if self.sidecar_traces.exists() else 0

    def check_spans_arrive(self) -> None:
        """Load the server briefly and wait until its spans reach the sidecar's traces file."""
        size = self.traces_size()
        closed_loop(self.server, 0.3, "probe", clients=1)
        wait_for(lambda: self.traces_size() > size, 30, "spans to reach the sidecar's traces file")

    def close(self) -> None:
        try:
            self.server.close()
        finally:
            self.sidecar.close()


def test_serving_keeps_its_throughput_when_the_sidecar_is_killed(tmp_path):
    deployments: list[Deployment] = []
    try:
        with ThreadPoolExecutor(2) as pool:  # each starts a sidecar and a server (torch, a model): side by side
            starting = [pool.submit(Deployment, tmp_path / name) for name in ("a", "b")]
        deployments += [started.result() for started in starting if started.exception() is None]
        for started in starting:
            started.result()  # a start that failed fails the test; the one that started is closed below
        a, b = deployments
        for d in deployments:
            closed_loop(d.server, 0.5, "warm-up")
            d.check_spans_arrive()
        rss_before = {id(d): server_rss_bytes(d.server) for d in deployments}
        drops_before = {id(d): dropped_records(d.server, "sidecar_unreachable") for d in deployments}

        b.sidecar.kill()
        first = interleaved(a.server, b.server)
        b.sidecar.start()
        b.check_spans_arrive()  # b's sinks reconnected to the new sidecar and deliver again
        a.sidecar.kill()
        second = interleaved(b.server, a.server)
        ratio = judged_ratio(first, second, lambda: interleaved(b.server, a.server))

        figures = f"b's sidecar dead: {first.describe()}; a's sidecar dead: {second.describe()}"
        print(f"throughput with the sidecar dead: {ratio:.1%} of healthy ({figures})")
        assert first.errors == second.errors == 0, figures
        assert ratio >= MIN_THROUGHPUT_RATIO, (
            f"with its sidecar dead a server ran at {ratio:.1%} of the healthy one's throughput ({figures})"
        )
        for d in deployments:
            # The kill broke the connections of the router and the worker: the spans caught mid-send count.
            drops = dropped_records(d.server, "sidecar_unreachable") - drops_before[id(d)]
            assert drops > 0, "spans lost with the dead sidecar were not counted"
            bound = SINK_CAP_SPANS * ENCODED_BYTES_PER_SPAN + SERVER_RSS_SLACK_BYTES
            for name, before in rss_before[id(d)].items():
                growth = server_rss_bytes(d.server)[name] - before
                assert growth < bound, (
                    f"{name} grew {growth / 2**20:.1f} MiB over the outage (bound {bound / 2**20:.0f} MiB)"
                )
    finally:
        for d in deployments:
            d.close()
