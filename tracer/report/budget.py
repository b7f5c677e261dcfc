"""Chunk budgets worth simulating: around the largest budget whose worst step still keeps the ITL SLO.

A chunked step's prefill part grows with the chunk's offset in its prompt (its attention over the tokens
already prefilled), so the step that decides whether a budget keeps the inter-token SLO is the last chunk
of a long prompt. The budget bound therefore depends on the prompt length distribution, not on the
budget alone. Pure computation.
"""

from __future__ import annotations

import numpy as np

from tracer.report.simulate import StepCosts

SMALLEST_BUDGET_TOKENS = 32
LARGEST_BUDGET_TOKENS = 32768
# Budgets simulated: the ITL bound and its neighbours in powers of two (the goodput search picks among them).
BUDGET_NEIGHBOURS = (-2, -1, 0, 1)


def worst_chunk_step_s(
    step: StepCosts, budget_tokens: int, prompt_tokens: int, decode_requests: int, context_tokens: int
) -> float:
    """Seconds of the slowest step a prompt of `prompt_tokens` puts into a chunked schedule at this budget:
    its last chunk (the one attending over the most prefix) beside `decode_requests` running decodes."""
    chunk = max(1, min(budget_tokens - decode_requests, prompt_tokens))
    offset = max(0, prompt_tokens - chunk)
    return step.step_s(decode_requests, context_tokens, chunk, (offset + chunk) ** 2 - offset**2)


def itl_bound_budget_tokens(
    step: StepCosts, itl_s: float, prompt_tokens: np.ndarray, decode_requests: int, context_tokens: int
) -> int:
    """The largest power-of-two budget whose worst step for the p99 prompt stays within `itl_s` seconds
    (the smallest budget when none does)."""
    long_prompt = int(np.percentile(prompt_tokens, 99)) if len(prompt_tokens) else 1
    best = SMALLEST_BUDGET_TOKENS
    budget = SMALLEST_BUDGET_TOKENS
    while budget <= LARGEST_BUDGET_TOKENS:
        if worst_chunk_step_s(step, budget, long_prompt, decode_requests, context_tokens) <= itl_s:
            best = budget
        budget *= 2
    return best


def candidate_budgets_tokens(
    step: StepCosts, itl_s: float, prompt_tokens: np.ndarray, decode_requests: int, context_tokens: int
) -> tuple[int, ...]:
    """Power-of-two budgets around the ITL bound, each above the decode batch it must also carry."""
    bound = itl_bound_budget_tokens(step, itl_s, prompt_tokens, decode_requests, context_tokens)
    budgets = {bound * 2**k if k >= 0 else bound // 2**-k for k in BUDGET_NEIGHBOURS}
    floor = max(SMALLEST_BUDGET_TOKENS, 2 * decode_requests)
    return tuple(sorted({min(max(b, floor), LARGEST_BUDGET_TOKENS) for b in budgets}))
