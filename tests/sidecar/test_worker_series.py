"""A sidecar keeps each worker's series apart, with the gauges and counters workers ship as snapshots.

Real worker processes (`start_tracing` with a sidecar socket, as `splitscope serve` starts them) talk to a
real sidecar over its Unix socket; the tests read the sidecar's exposed registry, what its /metrics serves.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from tests.conftest import wait_for
from tracer.metrics import ABORT_CLIENT_DISCONNECTED, Catalogue
from tracer.sidecar import wire
from tracer.sidecar.worker_series import WorkerSeries
from tracer.vocabulary import ATTR_WORKER, RESOURCE_SERVICE_NAMESPACE

# A worker process that sets its gauges and counters as told on stdin, one `name value` per line.
WORKER = textwrap.dedent("""
    import sys
    from prometheus_client import CollectorRegistry
    from tracer import start_tracing
    from tracer.metrics import ABORT_CLIENT_DISCONNECTED
    name, sock = sys.argv[1], sys.argv[2]
    session = start_tracing("decode", name, sidecar_socket=sock, registry=CollectorRegistry())
    metrics = session.catalogue.bind("decode", name)
    aborted = session.catalogue.requests_aborted.labels(reason=ABORT_CLIENT_DISCONNECTED)
    for line in sys.stdin:
        what, value = line.split()
        if what == "waiting":
            metrics.requests_waiting.set(float(value))
        elif what == "aborted":
            aborted.inc(float(value))
    session.shutdown(5.0)
""")


class WorkerProcess:
    def __init__(self, name: str, sock: str, namespace: str) -> None:
        env = {**os.environ, "OTEL_RESOURCE_ATTRIBUTES": f"service.namespace={namespace}"}
        self.process = subprocess.Popen(
            [sys.executable, "-c", WORKER, name, sock], stdin=subprocess.PIPE, env=env, text=True
        )

    def tell(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def end(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        assert self.process.wait(30) == 0


@pytest.fixture
def workers() -> Iterator[list[WorkerProcess]]:
    started: list[WorkerProcess] = []
    yield started
    for worker in started:
        if worker.process.poll() is None:
            worker.process.kill()
            worker.process.wait(10)


def test_each_worker_s_snapshots_land_in_its_own_series_and_its_gauges_leave_with_it(make_sidecar, tmp_path, workers):
    sock = str(tmp_path / "w.sock")
    sidecar = make_sidecar(http_port=None, grpc_port=None, unix_socket=sock)
    exposed = sidecar.exposed_registry

    def value(name: str, namespace: str, **labels: str) -> float | None:
        return exposed.get_sample_value(
            name, {"pool": "decode", "worker": "decode-0", "namespace": namespace, **labels}
        )

    def aborted(namespace: str) -> float | None:  # a family without a pool label
        labels = {"reason": ABORT_CLIENT_DISCONNECTED, "worker": "decode-0", "namespace": namespace}
        return exposed.get_sample_value("splitscope_requests_aborted_total", labels)

    # Two deployments each with a worker of the same name: their series never mix.
    team_a = WorkerProcess("decode-0", sock, "team-a")
    team_b = WorkerProcess("decode-0", sock, "team-b")
    workers += [team_a, team_b]
    team_a.tell("waiting 3")
    team_a.tell("aborted 2")
    team_b.tell("waiting 7")
    wait_for(lambda: value("splitscope_requests_waiting", "team-a") == 3 and aborted("team-a") == 2, what="team-a")
    wait_for(lambda: value("splitscope_requests_waiting", "team-b") == 7, what="team-b's gauge")
    assert aborted("team-b") == 0  # created at 0 (a counter born at 1 hides its first increase), not team-a's 2
    # The worker's span-derived series exist from its first snapshot, before any span, as in its own catalogue.
    assert value("splitscope_tokens_total", "team-a", phase="decode") == 0
    assert exposed.get_sample_value("splitscope_requests_waiting", {"pool": "decode", "worker": "decode-0"}) is None

    team_a.tell("waiting 1")
    wait_for(lambda: value("splitscope_requests_waiting", "team-a") == 1, what="the gauge to follow the worker")

    # The worker exits: its gauge goes with its connection (a queue depth nobody measures is not 0 or 1);
    # its counters stay.
    team_a.end()
    wait_for(lambda: value("splitscope_requests_waiting", "team-a") is None, what="the gauge to leave with its worker")
    assert aborted("team-a") == 2 and value("splitscope_requests_waiting", "team-b") == 7

    # A new process of the same worker starts its counters at 0; the sidecar's carry on from 2 (no reset).
    restarted = WorkerProcess("decode-0", sock, "team-a")
    workers.append(restarted)
    restarted.tell("aborted 1")
    wait_for(lambda: aborted("team-a") == 3, what="the counter to carry on across the restart")
    assert value("splitscope_requests_waiting", "team-a") == 0  # the new process's own value
    restarted.tell("aborted 2")
    wait_for(lambda: aborted("team-a") == 5, what="later growth to add up")


def _snapshot_connection(sock: str, worker: str) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(sock)
    conn.sendall(wire.encode_handshake("", {ATTR_WORKER: worker}))
    assert conn.makefile("rb").readline() == wire.encode_answer(None)
    return conn


@pytest.mark.parametrize(
    "sample",
    [
        ("splitscope_tokens", {"pool": "decode", "phase": "decode"}, 5.0),  # span-derived: not a process's own
        ("splitscope_requests_waiting", {"pool": "decode"}, 5.0),  # the family's labels are pool and worker
    ],
)
def test_a_snapshot_the_sidecar_cannot_take_closes_that_connection_and_changes_nothing(make_sidecar, tmp_path, sample):
    sock = str(tmp_path / "s.sock")
    sidecar = make_sidecar(http_port=None, grpc_port=None, unix_socket=sock)
    good = ("splitscope_requests_running", {"pool": "decode", "worker": "w1"}, 4.0)
    conn = _snapshot_connection(sock, "w1")
    try:
        conn.sendall(wire.encode_snapshot([good, sample]))
        assert conn.recv(1) == b""  # closed by the sidecar
    finally:
        conn.close()
    assert sidecar.unix is not None and sidecar.unix.bad_frames == 1
    assert (
        sidecar.exposed_registry.get_sample_value("splitscope_requests_running", {"pool": "decode", "worker": "w1"})
        is None
    )
    assert (
        sidecar.exposed_registry.get_sample_value(
            "splitscope_tracer_dropped_records_total", {"reason": "sidecar_bad_frame"}
        )
        == 1
    )


def test_a_router_of_another_deployment_keeps_its_namespace_and_the_sidecar_s_own_series_stay_unlabelled():
    own = Catalogue(CollectorRegistry())
    series = WorkerSeries(own, namespace=None)
    router = ((RESOURCE_SERVICE_NAMESPACE, "team-a"), ("service.instance.id", "r1"))
    series.apply_snapshot(router, wire.MetricsSnapshot([("splitscope_pool_workers", {"pool": "decode"}, 2.0)]))
    families = {family.name: family for family in series.collect()}
    assert [(s.labels, s.value) for s in families["splitscope_pool_workers"].samples] == [
        ({"namespace": "team-a", "pool": "decode"}, 2.0)
    ]
    # The sidecar's own catalogue got nothing: no unlabelled copy of the router's gauge.
    assert own.registry.get_sample_value("splitscope_pool_workers", {"pool": "decode"}) is None


@pytest.mark.parametrize(
    "version, accepted", [(1, True), (2, True), (3, True), (4, False), (True, False), ("2", False)]
)
def test_the_handshake_takes_clients_without_snapshots_too_and_nothing_else(version, accepted):
    line = json.dumps({"splitscope_ingest": version, "token": "t", "resource": {"service.name": "w"}}).encode()
    if accepted:
        assert wire.decode_handshake(line + b"\n") == ("t", {"service.name": "w"})
    else:
        with pytest.raises(wire.WireError, match="protocol versions"):
            wire.decode_handshake(line + b"\n")
