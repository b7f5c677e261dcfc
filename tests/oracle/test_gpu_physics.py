"""The oracle's GPU-shaped iteration costs price aiconfigurator's table as the table says (read here from the
JSON directly, not through tests/oracle/gpu.py), and have the accelerator's shape the report must learn."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.oracle.gpu import TABLE_PATH, GpuPhysics

RAW = json.loads(TABLE_PATH.read_text(encoding="utf-8"))
MS = 1e-3


@pytest.mark.parametrize("i", range(len(RAW["tokens"])))
def test_a_whole_prompt_alone_costs_the_tables_gemms_and_attention(i: int) -> None:
    n = RAW["tokens"][i]
    expected_s = (RAW["linear_ms"][i] + RAW["prefill_attention_ms"][i]) * MS
    assert GpuPhysics().iteration_s(0.0, 0, 0, n, n * n) == pytest.approx(expected_s, rel=1e-9)


@pytest.mark.parametrize("b", range(len(RAW["batch"])))
@pytest.mark.parametrize("k", range(len(RAW["kv_tokens"])))
def test_a_decode_only_iteration_costs_the_tables_gemms_and_kv_read(b: int, k: int) -> None:
    batch, kv = RAW["batch"][b], RAW["kv_tokens"][k]
    linear_ms = float(np.interp(batch, RAW["tokens"], RAW["linear_ms"]))  # between the table's token counts
    expected_s = (linear_ms + RAW["decode_attention_ms"][b][k]) * MS
    assert GpuPhysics().iteration_s(0.0, batch, batch * kv, 0, 0) == pytest.approx(expected_s, rel=1e-9)


def test_the_gemms_are_flat_below_the_knee_and_linear_past_it() -> None:
    physics = GpuPhysics()

    def gemm_s(tokens: int) -> float:  # a decode-only step at a short context: almost all GEMM
        return physics.iteration_s(0.0, tokens, tokens * 128, 0, 0)

    below = (gemm_s(128) - gemm_s(16)) / 112
    past = (gemm_s(256 + 64) - gemm_s(256)) / 64
    assert below < 0.5 * past  # memory-bound: a token costs little until the knee
    # Past the knee a decode token costs about what a prefill token's GEMMs cost (compute-bound alike).
    prefill_per_token_s = (physics.iteration_s(0.0, 0, 0, 8192, 0) - physics.iteration_s(0.0, 0, 0, 4096, 0)) / 4096
    assert past == pytest.approx(prefill_per_token_s, rel=0.5)


def test_a_chunk_costs_the_attention_pairs_it_adds() -> None:
    physics = GpuPhysics()
    first = physics.iteration_s(0.0, 0, 0, 2048, 2048**2)
    second = physics.iteration_s(0.0, 0, 0, 2048, 4096**2 - 2048**2)  # the same tokens, over the first half
    pairs = [n * n for n in RAW["tokens"]]
    attention_ms = np.interp([2048**2, 4096**2 - 2048**2], pairs, RAW["prefill_attention_ms"])
    assert second - first == pytest.approx((attention_ms[1] - attention_ms[0]) * MS, rel=1e-9)
    assert second > first
