"""tests/vllm_layouts.py against a real vLLM 0.32 worker's /metrics (tests/sidecar/fixtures), which we did not write."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.vllm_layouts import VLLM_ITERATION_TOKENS_BUCKETS, VLLM_ITL_BUCKETS_S, VLLM_TTFT_BUCKETS_S

CAPTURE = Path(__file__).parent / "sidecar" / "fixtures" / "vllm-worker-metrics.txt"
LAYOUTS = {
    "vllm:time_to_first_token_seconds": VLLM_TTFT_BUCKETS_S,
    "vllm:inter_token_latency_seconds": VLLM_ITL_BUCKETS_S,
    "vllm:iteration_tokens_total": VLLM_ITERATION_TOKENS_BUCKETS,
}


@pytest.mark.parametrize("family_name", LAYOUTS)
def test_the_layouts_are_those_a_real_vllm_exposes(family_name: str) -> None:
    families = {f.name: f for f in text_string_to_metric_families(CAPTURE.read_text(encoding="utf-8"))}
    edges = [float(x.labels["le"]) for x in families[family_name].samples if x.name.endswith("_bucket")]
    # The capture's one series per family (one engine, one model): its finite edges, in order.
    assert [e for e in edges if e != float("inf")] == [float(edge) for edge in LAYOUTS[family_name]]
