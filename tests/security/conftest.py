"""One reference server (1 prefill + 1 decode worker, tiny preset) and one sidecar for every security test.

Both run as processes with default bindings; starting them once keeps this package's wall time short.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.reference_server.server_harness import Server
from tests.security.processes import ServedWorker, SidecarProcess, served_workers


@pytest.fixture(scope="package")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    started = Server(tmp_path_factory.mktemp("server"), "--mode", "disaggregated")
    try:
        yield started
    finally:
        started.close()


@pytest.fixture(scope="package")
def workers(server: Server) -> dict[str, ServedWorker]:
    """The server's workers by pool (prefill, decode)."""
    return {w.pool: w for w in served_workers(server)}


@pytest.fixture(scope="package")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarProcess]:
    started = SidecarProcess(tmp_path_factory.mktemp("sidecar"))
    try:
        yield started
    finally:
        started.close()
