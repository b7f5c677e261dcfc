"""vLLM 0.32's default histogram bucket layouts, for tests that write a vLLM-shaped /metrics exposition.

Copied from vLLM's source, vllm/v1/metrics/buckets.py (`TIME_TO_FIRST_TOKEN_BUCKETS`,
`INTER_TOKEN_LATENCY_BUCKETS`, `ITERATION_TOKENS_BUCKETS`, which the v1 `PrometheusStatLogger` in
vllm/v1/metrics/loggers.py hands to `vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds` and
`vllm:iteration_tokens_total`). Deliberately not taken from our own catalogue (tracer.metrics): these are
another engine's layouts, the ones our rules and report must cope with. tests/test_vllm_layouts.py checks
them against a real vLLM capture.
"""

from __future__ import annotations

# No 2 s edge (our default TTFT SLO): the burn rules fall back to judging TTFT at 1 s.
VLLM_TTFT_BUCKETS_S = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
VLLM_ITL_BUCKETS_S = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
# Tokens per engine step (decode plus prefill tokens).
VLLM_ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
