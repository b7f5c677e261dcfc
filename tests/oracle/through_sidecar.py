"""Send an oracle run's vLLM-shaped spans through real sidecars, one per engine, as a stock vLLM
deployment would (`splitscope sidecar --pool colocated --worker vllm-N`; for a split deployment
`--pool prefill --worker vllm-pN` and `--pool decode --worker vllm-dN`), into one traces file."""

from __future__ import annotations

import urllib.request
from pathlib import Path

from tests.conftest import wait_for
from tests.oracle.engine import Run
from tests.oracle.traces import vllm_pd_lines, vllm_request_lines
from tracer.otlp import iter_spans
from tracer.sidecar.server import Sidecar, SidecarConfig
from tracer.vocabulary import Mode, Pool

STAGE_SPANS_PER_REQUEST = 3  # queue, prefill, decode under each llm_request
# A P/D pair: queue and prefill under the prefill instance's llm_request, kv_transfer and decode under
# the decode instance's.
PD_SPANS_PER_REQUEST = 2 * (1 + 2)


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


def _engines(run: Run, seed: int, mode: str | None) -> list[tuple[str, str, str, list[str]]]:
    """(pool, worker name, mode, lines) per engine instance; `mode` overrides a single pool's `--mode`."""
    if run.deployment.kind == "split":
        prefix = {Pool.PREFILL: "vllm-p", Pool.DECODE: "vllm-d"}
        return [
            (pool, f"{prefix[pool]}{worker}", Mode.DISAGGREGATED, lines)
            for (pool, worker), lines in vllm_pd_lines(run, seed).items()
        ]
    mode = mode or (Mode.CHUNKED if run.deployment.kind == "chunked" else Mode.COLOCATED)
    return [
        (Pool.COLOCATED, f"vllm-{worker}", mode, vllm_request_lines(run, worker, seed))
        for worker in range(run.deployment.workers)
    ]


def write_via_sidecars(path: Path, run: Run, seed: int, mode: str | None = None) -> None:
    """Blocks until every request's span and stage spans are in `path`. `mode`: the sidecars' `--mode`
    for a single pool (default: the deployment's own, as its operator would pass it)."""
    sidecars = []
    try:
        for pool, worker, engine_mode, lines in _engines(run, seed, mode):
            config = SidecarConfig(
                http_port=0,
                grpc_port=None,
                traces_file=str(path),
                pool=pool,
                worker=worker,
                mode=engine_mode,
                gpu=False,
                environ={},
            )
            sidecar = Sidecar(config).start()
            sidecars.append(sidecar)
            for line in lines:
                _post(sidecar.http_port, line)
        per_request = PD_SPANS_PER_REQUEST if run.deployment.kind == "split" else 1 + STAGE_SPANS_PER_REQUEST
        # A decode span leaves a sidecar once its stall links are known (tracer/sidecar/overlap.py: the hold);
        # everything else as it comes. Stopping a sidecar sends its held decodes, every prefill being in.
        decodes = sum(1 for r in run.requests if r.output_tokens > 1)
        expected = len(run.requests) * per_request
        wait_for(lambda: _span_count(path) >= expected - decodes, 30.0, f"{expected - decodes} spans in {path.name}")
    finally:
        for sidecar in sidecars:
            sidecar.stop(2.0)
    assert _span_count(path) == expected
