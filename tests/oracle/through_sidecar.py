"""Send an oracle run's vLLM-shaped spans through real sidecars, one per engine, as a stock vLLM
deployment would (`splitscope sidecar --pool colocated --worker vllm-N`), into one traces file."""

from __future__ import annotations

import urllib.request
from pathlib import Path

from tests.conftest import wait_for
from tests.oracle.engine import Run
from tests.oracle.traces import vllm_request_lines
from tracer.sidecar.server import Sidecar, SidecarConfig
from tracer.traces import iter_spans
from tracer.vocabulary import Pool

STAGE_SPANS_PER_REQUEST = 3  # queue, prefill, decode under each llm_request


def _post(port: int, line: str) -> None:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/traces",
        data=line.encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200, response.read()


def _span_count(path: Path) -> int:
    return sum(1 for _ in iter_spans([path], skip_bad=True)) if path.exists() else 0


def write_via_sidecars(path: Path, run: Run, seed: int) -> None:
    """Blocks until every request's span and stage spans are in `path`."""
    sidecars = []
    try:
        for worker in range(run.deployment.workers):
            config = SidecarConfig(
                http_port=0,
                grpc_port=None,
                traces_file=str(path),
                pool=Pool.COLOCATED,
                worker=f"vllm-{worker}",
                gpu=False,
                environ={},
            )
            sidecar = Sidecar(config).start()
            sidecars.append(sidecar)
            for line in vllm_request_lines(run, worker, seed):
                _post(sidecar.http_port, line)
        expected = len(run.requests) * (1 + STAGE_SPANS_PER_REQUEST)
        wait_for(lambda: _span_count(path) >= expected, 30.0, f"{expected} spans in {path.name}")
    finally:
        for sidecar in sidecars:
            sidecar.stop(2.0)
