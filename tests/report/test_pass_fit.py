"""The accelerator's step fit (`fit_passes`) against the oracle's GPU physics (aiconfigurator's kernel tables
for Qwen3-32B on an H200, tests/oracle/gpu.py): fitted only on what a traced deployment shows (decode batches
of at most 8, whole prompts), it prices what the candidate layouts would run and the traces never showed (a
decode pool's batches of 64-128, chunks deep in long prompts) within 10% of the table. The model's config
supplies the two ratios the traces cannot; without them the same steps price large batches several times too
dear (bench/RESULTS.md, "The fit per pass, tried")."""

from __future__ import annotations

import numpy as np
import pytest

from tests.oracle.gpu import QWEN3_32B_CONFIG, GpuPhysics
from tracer.report.fit import fit_passes
from tracer.report.model_shape import ModelShape

PHYSICS = GpuPhysics()


def _traced_steps(rng: np.random.Generator, noise_sigma: float) -> tuple[np.ndarray, ...]:
    """Steps a small colocated deployment runs: decode-only steps of 1-8 requests at 300-4,000 tokens of
    context each, and whole prompts of 100-8,000 tokens beside 0-8 decodes; each priced by the oracle."""
    rows = []
    for _ in range(600):
        batch = int(rng.integers(1, 9))
        context = int(batch * rng.integers(300, 4001))
        rows.append((batch, context, 0, 0))
    for _ in range(200):
        batch = int(rng.integers(0, 9))
        prompt = int(np.exp(rng.uniform(np.log(100), np.log(8000))))
        rows.append((batch, int(batch * rng.integers(300, 4001)), prompt, prompt * prompt))
    decode, context, prefill, attention = (np.array(column, dtype=float) for column in zip(*rows))
    step_s = np.array([PHYSICS.iteration_s(0.0, *map(int, row)) for row in rows])
    return decode, context, prefill, attention, step_s * rng.lognormal(0.0, noise_sigma, len(rows))


@pytest.mark.parametrize("noise_sigma", [0.0, 0.03])
def test_small_batches_and_whole_prompts_price_large_batches_and_deep_chunks(noise_sigma: float) -> None:
    decode, context, prefill, attention, step_s = _traced_steps(np.random.default_rng(7), noise_sigma)
    shape = ModelShape.from_hf_config(QWEN3_32B_CONFIG)
    costs, fit, _ = fit_passes(decode, context, prefill, attention, step_s, np.ones(len(step_s)), shape)
    unseen = [
        (64, 64 * 2000, 0, 0),  # a decode pool's batches
        (128, 128 * 3000, 0, 0),
        (256, 256 * 1000, 0, 0),
        *((16, 16 * 2000, 512, (offset + 512) ** 2 - offset**2) for offset in (0, 2000, 4000, 6000)),  # chunks
        (32, 32 * 2000, 256, (4000 + 256) ** 2 - 4000**2),
    ]
    for batch, context_tokens, chunk, pairs in unseen:
        truth_s = PHYSICS.iteration_s(0.0, batch, context_tokens, chunk, pairs)
        priced_s = costs.step_s(batch, context_tokens, chunk, pairs)
        assert priced_s == pytest.approx(truth_s, rel=0.10), (batch, context_tokens, chunk, pairs, costs)
    # The knee is where reading the weights and the GEMMs' arithmetic meet (the table's: 150-250 tokens).
    assert 150 <= costs.gemm_knee_tokens <= 250
    assert costs.base_s == pytest.approx(costs.prefill_s_per_token * costs.gemm_knee_tokens, rel=0.01)
