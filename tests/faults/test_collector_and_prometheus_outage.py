"""A dead OTLP collector and a stopped Prometheus under load (architecture.md §9: a crash of the collector or of
Prometheus never stalls serving).

Two like servers export OTLP, server a over HTTP/protobuf and server b over gRPC, each to its own
collector (a `splitscope sidecar` on a fixed port), besides writing their traces file; each is scraped by
its own real Prometheus in the second test. A fault is injected on one server, and the same closed-loop
workload runs on both in short interleaved slices; then the fault moves to the other server. The
combined ratio (geometric mean of the two phases) cancels any difference between the servers themselves.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import pytest

from tests.conftest import free_port, wait_for
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
    stop_process,
)
from tests.prom import PrometheusHandle, running_prometheus
from tests.reference_server.server_harness import http

QUEUE_CAP_SPANS = 256  # small, so that these outages fill it
BYTES_PER_QUEUED_SPAN = 2048  # an SDK ReadableSpan with our attributes: ~770 B traced by tracemalloc, rounded up
PROMETHEUS_STOP_GRACE_S = 2.0


class Deployment:
    """A server exporting OTLP over `protocol` to its own collector on a fixed port."""

    def __init__(self, tmp_dir: Path, protocol: str) -> None:
        tmp_dir.mkdir()
        self.protocol = protocol
        port = free_port()
        self.collector_traces = tmp_dir / "collector-traces.jsonl"
        listen = (
            ["--http-port", str(port), "--no-grpc"]
            if protocol == "http/protobuf"
            else ["--grpc-port", str(port), "--no-http"]
        )
        self.collector = SidecarProcess(
            tmp_dir / "collector.log", *listen, "--traces-file", str(self.collector_traces)
        ).start()
        environ = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
            "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
            "OTEL_BSP_MAX_QUEUE_SIZE": str(QUEUE_CAP_SPANS),
            "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "64",
            "OTEL_BSP_SCHEDULE_DELAY": "200",
        }
        self.server = start_server(tmp_dir / "server", environ, "--mode", "colocated", "--workers", "1")

    def collector_size(self) -> int:
        return self.collector_traces.stat().st_size if self.collector_traces.exists() else 0

    def check_spans_arrive(self) -> None:
        """Load the server briefly and wait until its spans reach the collector."""
        size = self.collector_size()
        closed_loop(self.server, 0.3, "probe", clients=1)
        wait_for(lambda: self.collector_size() > size, 60, f"OTLP ({self.protocol}) spans to reach the collector")

    def revive_collector(self) -> None:
        """Start a collector again if it is dead, and wait until the server's spans reach it."""
        if self.collector.process.poll() is not None:
            self.collector.start()
            self.check_spans_arrive()

    def close(self) -> None:
        try:
            self.server.close()
        finally:
            self.collector.close()


@pytest.fixture(scope="module")
def deployments(tmp_path_factory) -> Iterator[tuple[Deployment, Deployment]]:
    tmp = tmp_path_factory.mktemp("outages")
    with ExitStack() as stack:
        with ThreadPoolExecutor(2) as pool:  # each starts a collector and a server (torch, a model): side by side
            starting = [pool.submit(Deployment, tmp / "a", "http/protobuf"), pool.submit(Deployment, tmp / "b", "grpc")]
        for started in starting:
            if started.exception() is None:
                stack.callback(started.result().close)
        a, b = (started.result() for started in starting)  # a start that failed fails here, the rest closed
        for d in (a, b):
            closed_loop(d.server, 0.5, "warm-up")
            d.check_spans_arrive()
        yield a, b


def test_serving_keeps_its_throughput_when_the_otlp_collector_is_dead(deployments):
    a, b = deployments
    rss_before = {d.protocol: server_rss_bytes(d.server) for d in deployments}
    drops_before = {d.protocol: dropped_records(d.server, "export_queue_full") for d in deployments}
    try:
        b.collector.kill()
        traces_size = b.server.traces_file.stat().st_size
        first = interleaved(a.server, b.server)
        assert b.server.traces_file.stat().st_size > traces_size, "the traces file stopped with the collector"
        rss_after = {b.protocol: server_rss_bytes(b.server)}
        b.revive_collector()  # export resumes once a collector listens again
        a.collector.kill()
        second = interleaved(b.server, a.server)
        ratio = judged_ratio(first, second, lambda: interleaved(b.server, a.server))
        rss_after[a.protocol] = server_rss_bytes(a.server)
    finally:
        for d in deployments:
            d.revive_collector()

    figures = f"grpc collector dead: {first.describe()}; http collector dead: {second.describe()}"
    print(f"throughput with the OTLP collector dead: {ratio:.1%} of healthy ({figures})")
    assert first.errors == second.errors == 0, figures
    assert ratio >= MIN_THROUGHPUT_RATIO, (
        f"with its collector dead a server ran at {ratio:.1%} of the healthy one's throughput ({figures})"
    )
    bound = QUEUE_CAP_SPANS * BYTES_PER_QUEUED_SPAN + SERVER_RSS_SLACK_BYTES
    for d in deployments:
        drops = dropped_records(d.server, "export_queue_full") - drops_before[d.protocol]
        assert drops > 0, f"spans the full {d.protocol} export queue displaced were not counted"
        for name, before in rss_before[d.protocol].items():
            growth = rss_after[d.protocol][name] - before
            assert growth < bound, (
                f"{name} grew {growth / 2**20:.1f} MiB over its outage (bound {bound / 2**20:.0f} MiB)"
            )


def scraped(stack: ExitStack, *deployments: Deployment) -> list[PrometheusHandle]:
    """A real Prometheus for each deployment, started side by side, each with one good scrape behind it."""
    contexts = [running_prometheus([f"127.0.0.1:{d.server.metrics_port}"]) for d in deployments]
    with ThreadPoolExecutor(len(contexts)) as pool:
        entered = [pool.submit(context.__enter__) for context in contexts]
    for context, future in zip(contexts, entered):
        if future.exception() is None:
            stack.push(context)  # stopped when the test ends, whatever happens
    handles = [future.result() for future in entered]

    def first_scrape(prometheus: PrometheusHandle) -> None:
        prometheus.wait_targets_up(60)
        prometheus.wait_for("splitscope_pool_workers", lambda result: len(result) > 0, 30)

    with ThreadPoolExecutor(len(handles)) as pool:
        list(pool.map(first_scrape, handles))
    return handles


def test_serving_keeps_its_throughput_when_prometheus_is_stopped(deployments):
    a, b = deployments
    with ExitStack() as stack:
        prometheus_a, prometheus_b = scraped(stack, a, b)
        stop_process(prometheus_b.process, PROMETHEUS_STOP_GRACE_S)  # SIGTERM, then SIGKILL after the grace
        first = interleaved(a.server, b.server)
        scraped(stack, b)
        prometheus_a.process.send_signal(signal.SIGTERM)
        prometheus_a.process.kill()  # and one that dies in the middle of its shutdown
        prometheus_a.process.wait(10)
        second = interleaved(b.server, a.server)
        ratio = judged_ratio(first, second, lambda: interleaved(b.server, a.server))

    figures = f"b unscraped: {first.describe()}; a unscraped: {second.describe()}"
    print(f"throughput with Prometheus stopped: {ratio:.1%} of healthy ({figures})")
    assert first.errors == second.errors == 0, figures
    assert ratio >= MIN_THROUGHPUT_RATIO, (
        f"with its Prometheus stopped a server ran at {ratio:.1%} of the scraped one's throughput ({figures})"
    )
    for d in deployments:  # whoever scrapes next still gets an answer
        status, body, _ = http("GET", f"http://127.0.0.1:{d.server.metrics_port}/metrics")
        assert status == 200 and b"splitscope_pool_workers" in body
