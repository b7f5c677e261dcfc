"""Test helpers every package's tests use: waiting on a condition, free ports."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

_POLL_S = 0.02


def wait_for(condition: Callable[[], Any], timeout_s: float = 10.0, what: str = "condition") -> Any:
    """Poll `condition` until it returns something truthy and return that; fail the test at the deadline.

    Tests wait on the thing itself through this, never on a fixed sleep; the short pause between polls is
    the polling interval, not a guess at how long something takes.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(_POLL_S)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def port() -> int:
    return free_port()


# Markers for the inner loop (`bash scripts/test.sh -m "not slow and not live"`); the full run is the gate.
# `slow`: whole servers, engines or soaks, tens of seconds each. `live`: a real Prometheus server.
# `serial`: the slow tests that time something (latency, throughput, a deadline) on servers or engines of
# their own; scripts/test.sh runs them one at a time after the rest, which share both cores. Slow tests that
# time nothing (UNTIMED_SLOW_PATHS) and live ones fed a synthetic exposition run with the rest.
# The reference server's tests that each start a whole `splitscope serve` (router and worker processes,
# the model loaded in each): slow, but they judge tokens, spans, status codes and cleanup, not timings
# (their deadlines are generous bounds), so they run with the rest.
SERVER_PATHS = (
    "tests/reference_server/test_metrics_exporter.py",
    "tests/reference_server/test_openai_sdk.py",
    "tests/reference_server/test_server_colocated.py",
    "tests/reference_server/test_server_disaggregated.py",
    "tests/reference_server/test_server_lifecycle.py",
    "tests/reference_server/test_server_misbehaving_clients.py",
    "tests/reference_server/test_server_slo.py",
)
SLOW_PATHS = (
    "tests/e2e/",
    "tests/faults/",
    "tests/slow_link/",
    "tests/engines/",
    "tests/packaging/",
    "tests/reference_server/test_demo.py",
    *SERVER_PATHS,
    "tests/load/test_against_reference_server.py",  # judges arrival times at a real router (50 ms)
    "tests/report/test_simulator_vs_server.py",
    "tests/explain/test_reference_server.py",
    "tests/advise/test_follow_live.py",  # a real server and the advisor as processes, a Prometheus
    "tests/advise/test_follow_synthetic.py",  # the advisor as a process, a Prometheus
)
# Slow tests that time nothing of this machine's: the wheel, and the oracle's own timings replayed into
# sidecars and Prometheus (its ratios and alerts come from the replayed data, however late it arrives).
# They run in the first phase beside the unit tests: what they assert holds however slowly they run.
# (Not the catalogue-and-panels live test: its exporter runs at nice 19, as deployed, and beside a busy core
# and the unit tests it was starved past Prometheus's scrape timeout, so the disaggregated server's series
# # went stale mid-module. Nor the real vLLM: its explain and request-interference checks need requests that
# overlap in vLLM's batch, and beside a busy core and the unit tests vLLM ran them one after another. Both
# stay serial.)
UNTIMED_SLOW_PATHS = (
    "tests/packaging/",
    "tests/e2e/test_request_interference_live.py",
    "tests/explain/test_reference_server.py",  # asserts causes and sums, whatever the stall took here
    "tests/faults/test_decode_worker_dies_mid_transfer.py",  # signals order the race; the deadline is 30 s
    "tests/reference_server/test_demo.py",  # a ratio of two step kinds of the same run, both slowed alike
    "tests/advise/test_follow_synthetic.py",  # synthetic spans carry their own times; every wait is on output
    *SERVER_PATHS,
)


# Package fixtures that start a whole reference server, by the folder whose conftest.py defines them: a test
# there that asks for one (directly or through another fixture) is slow. These judge status codes and
# bindings, not timings, so they run in the first phase; the folder's other tests stay in the inner loop.
SERVER_FIXTURES = {
    "tests/security/": ("server", "workers"),
}


def _starts_a_server_through_a_fixture(path: str, item: pytest.Item) -> bool:
    fixturenames = getattr(item, "fixturenames", ())
    return any(
        path.startswith(folder) and any(name in fixturenames for name in names)
        for folder, names in SERVER_FIXTURES.items()
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(str(item.fspath)).resolve().relative_to(REPO_ROOT).as_posix()
        if path.startswith(SLOW_PATHS):
            item.add_marker(pytest.mark.slow)
            if not path.startswith(UNTIMED_SLOW_PATHS):
                item.add_marker(pytest.mark.serial)
        elif _starts_a_server_through_a_fixture(path, item):
            item.add_marker(pytest.mark.slow)
        if hasattr(item.module, "running_prometheus"):
            item.add_marker(pytest.mark.live)
