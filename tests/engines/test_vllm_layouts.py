"""tests/vllm_layouts.py against the installed vLLM's own defaults (vllm/v1/metrics/buckets.py), read in its venv."""

from __future__ import annotations

import json
import subprocess

from tests.engines.processes import vllm_python
from tests.vllm_layouts import VLLM_ITERATION_TOKENS_BUCKETS, VLLM_ITL_BUCKETS_S, VLLM_TTFT_BUCKETS_S

PROBE = (
    "import json; from vllm.v1.metrics import buckets as b; print(json.dumps("
    "[b.TIME_TO_FIRST_TOKEN_BUCKETS, b.INTER_TOKEN_LATENCY_BUCKETS, b.ITERATION_TOKENS_BUCKETS]))"
)


def test_the_layouts_are_the_installed_vllms_defaults() -> None:
    result = subprocess.run([vllm_python(), "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    ttft, itl, iteration_tokens = json.loads(result.stdout.strip().splitlines()[-1])
    assert tuple(ttft) == VLLM_TTFT_BUCKETS_S
    assert tuple(itl) == VLLM_ITL_BUCKETS_S
    assert tuple(iteration_tokens) == VLLM_ITERATION_TOKENS_BUCKETS
