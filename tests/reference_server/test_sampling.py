"""Nucleus (top_p) sampling in the engine (reference_server.engine.sample_top_p_no_sync).

Checked against the definition: the draws stay inside the smallest set of most probable tokens whose
probability reaches top_p, and their frequencies follow the renormalised probabilities.
"""

from __future__ import annotations

import torch

from reference_server.engine import sample_top_p_no_sync


def _draws(logits: torch.Tensor, top_p: float, n: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    rows = logits.expand(n, -1)
    return sample_top_p_no_sync(rows, 1.0, top_p, generator)


def test_top_p_keeps_only_the_nucleus_and_renormalises():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None, :]
    draws = _draws(logits, 0.75, 20000)
    counts = torch.bincount(draws, minlength=4).double() / len(draws)
    assert counts[2] == 0 and counts[3] == 0  # outside the nucleus {0, 1} (0.5 + 0.3 reaches 0.75)
    assert abs(counts[0] - 0.5 / 0.8) < 0.02 and abs(counts[1] - 0.3 / 0.8) < 0.02


def test_a_tiny_top_p_is_greedy_and_top_p_one_is_plain_sampling():
    logits = torch.randn(1, 258, generator=torch.Generator().manual_seed(3))
    assert set(_draws(logits, 1e-6, 500).tolist()) == {int(logits.argmax())}
    assert len(set(_draws(logits * 0.1, 1.0, 500).tolist())) > 50  # a flat distribution: many tokens drawn


def test_top_p_sampling_never_reads_device_values_on_the_host():
    """On the meta device any host read (.item(), .tolist(), a data-dependent branch) raises."""
    drawn = sample_top_p_no_sync(torch.empty(3, 258, device="meta"), 0.7, 0.9, None)
    assert drawn.shape == (3,) and drawn.device.type == "meta"
