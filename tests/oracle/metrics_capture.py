"""An oracle run's engine metrics as a stock vLLM's /metrics would show them (Prometheus text format),
written with prometheus_client, not with anything the report uses.

Per engine (`engine` label, one per worker; the report must sum label sets): every inter-token gap of the
requests it decoded (`vllm:inter_token_latency_seconds`) and the tokens of every engine step it ran, decode
tokens plus prefill tokens (`vllm:iteration_tokens_total`), with vLLM 0.32's buckets (tests/vllm_layouts.py).
Blocking file I/O.
"""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from tests.oracle.engine import Run
from tests.oracle.traces import MODEL
from tests.vllm_layouts import VLLM_ITERATION_TOKENS_BUCKETS, VLLM_ITL_BUCKETS_S


def write_vllm_metrics(path: Path, run: Run) -> None:
    """`run` must have been served with `record=True` (its iterations)."""
    assert run.iterations is not None
    registry = CollectorRegistry()
    labels = ["engine", "model_name"]
    gaps = Histogram(
        "vllm:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        labels,
        registry=registry,
        buckets=VLLM_ITL_BUCKETS_S,
    )
    steps = Histogram(
        "vllm:iteration_tokens_total",
        "Histogram of number of tokens per engine_step.",
        labels,
        registry=registry,
        buckets=VLLM_ITERATION_TOKENS_BUCKETS,
    )
    for request in run.requests:
        child = gaps.labels(engine=f"{request.decode_worker}", model_name=MODEL)
        for gap in request.gaps_s:
            child.observe(float(gap))
    for iteration in run.iterations:
        steps.labels(engine=f"{iteration.worker}", model_name=MODEL).observe(
            iteration.running + iteration.prefill_tokens
        )
    path.write_bytes(generate_latest(registry))
