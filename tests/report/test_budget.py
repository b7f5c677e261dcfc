"""Chunk budgets are searched around the largest one that keeps the ITL SLO for the prompts seen: late
chunks of long prompts attend over more prefix, so the same SLO allows a smaller budget for them."""

from __future__ import annotations

import numpy as np
import pytest

from tracer.report.budget import candidate_budgets_tokens, itl_bound_budget_tokens, worst_chunk_step_s
from tracer.report.simulate import StepCosts

STEP = StepCosts(
    base_s=0.01,
    context_s_per_token=2e-7,
    decode_s_per_request=2e-3,
    prefill_s_per_token=1.2e-4,
    prefill_s_per_token2=2e-8,
)


def test_the_worst_chunk_is_the_last_of_the_prompt_and_pays_for_its_prefix():
    # 16 decodes (10 + 32 ms + 0.2 ms of context) beside the last 240-token chunk of a 4000-token prompt.
    expected = 0.01 + 2e-7 * 1000 + 2e-3 * 16 + 1.2e-4 * 240 + 2e-8 * (4000**2 - 3760**2)
    assert worst_chunk_step_s(STEP, 256, 4000, 16, 1000) == pytest.approx(expected)


def test_longer_prompts_need_a_smaller_budget_under_the_same_itl_slo():
    short = itl_bound_budget_tokens(STEP, 0.08, np.full(50, 500), 16, 8000)
    long = itl_bound_budget_tokens(STEP, 0.08, np.full(50, 4000), 16, 8000)
    assert long < short
    # The bound keeps the SLO, and the next power of two would not.
    for prompts, bound in ((500, short), (4000, long)):
        assert worst_chunk_step_s(STEP, bound, prompts, 16, 8000) <= 0.08
        assert worst_chunk_step_s(STEP, bound * 2, prompts, 16, 8000) > 0.08


def test_candidates_are_powers_of_two_around_the_bound_and_above_the_decode_batch():
    budgets = candidate_budgets_tokens(STEP, 0.08, np.full(50, 4000), 16, 8000)
    bound = itl_bound_budget_tokens(STEP, 0.08, np.full(50, 4000), 16, 8000)
    assert bound in budgets and all(b & (b - 1) == 0 for b in budgets)
    assert all(b > 16 for b in budgets) and max(budgets) == 2 * bound
