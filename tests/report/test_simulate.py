"""The discrete-event model: hand-checkable cases and its vectorised gap statistics."""

from __future__ import annotations

import numpy as np
import pytest

from tests.synthetic import scenario
from tracer.report.simulate import SLO, Costs, Layout, StepCosts, TransferCosts, Workload, simulate

STEP = StepCosts(base_s=0.01, context_s_per_token=0.0, decode_s_per_request=0.0, prefill_s_per_token=1e-4)
COSTS = Costs(STEP, TransferCosts(kv_bytes_per_token=1000.0, link_bytes_per_s=1e6, constant_s=0.005))


def _one(prompt: int, output: int, arrival: float = 0.0) -> Workload:
    return Workload(np.array([arrival]), np.array([prompt]), np.array([0]), np.array([output]))


def test_a_lone_colocated_request_takes_one_prefill_step_then_one_step_per_token():
    result = simulate(Layout("colocated", workers=1), _one(1000, 5), COSTS)
    assert result.ttft_s[0] == pytest.approx(0.01 + 0.1)
    assert result.itl_max_s[0] == pytest.approx(0.01)  # decode-only steps after the prefill
    assert result.e2e_s[0] == pytest.approx(0.11 + 4 * 0.01)


def test_chunked_prefill_splits_the_prompt_by_the_budget():
    result = simulate(Layout("chunked", workers=1, chunk_budget_tokens=256), _one(1000, 2), COSTS, record=True)
    assert result.timeline["prefill_chunks"][0] == 4  # 256 + 256 + 256 + 232
    assert result.ttft_s[0] == pytest.approx(4 * 0.01 + 1000 * 1e-4)


QUADRATIC = StepCosts(
    base_s=0.01, context_s_per_token=0.0, decode_s_per_request=0.0, prefill_s_per_token=1e-4, prefill_s_per_token2=1e-7
)


def test_a_prompts_chunks_add_up_to_its_whole_prefill_and_late_chunks_cost_more():
    costs = Costs(QUADRATIC, COSTS.transfer)
    whole = simulate(Layout("colocated", workers=1), _one(1000, 2), costs)
    chunked = simulate(Layout("chunked", workers=1, chunk_budget_tokens=250), _one(1000, 2), costs, record=True)
    # Four chunks of 250: each pays the base once, and together exactly a + b*1000 + c*1000^2 of prefill.
    assert whole.ttft_s[0] == pytest.approx(0.01 + 0.1 + 0.1)
    assert chunked.ttft_s[0] == pytest.approx(4 * 0.01 + 0.1 + 0.1)
    durations = chunked.steps["colocated"].duration_s[:4]
    # Chunk k attends over the 250*k tokens before it: (250(k+1))^2 - (250k)^2 = 62500 (2k + 1) tokens^2.
    expected = [0.01 + 250e-4 + 1e-7 * 62500 * (2 * k + 1) for k in range(4)]
    assert durations == pytest.approx(expected)
    assert chunked.steps["colocated"].prefill_attention_tokens2[:4] == [62500 * (2 * k + 1) for k in range(4)]


def test_whole_prompts_batched_in_one_step_pay_attention_each_over_their_own_tokens():
    costs = Costs(QUADRATIC, COSTS.transfer)
    work = Workload(np.array([0.0, 0.0]), np.array([1000, 1000]), np.array([0, 0]), np.array([2, 2]))
    result = simulate(Layout("colocated", workers=1), work, costs)
    assert result.ttft_s[0] == pytest.approx(0.01 + 2 * 0.1 + 2 * 0.1)  # 2 x 1000^2, not 2000^2


def test_a_split_ttft_includes_the_exposed_transfer():
    result = simulate(Layout("disaggregated", prefill_workers=1, decode_workers=1), _one(1000, 3), COSTS)
    transfer_s = 0.005 + 1000 * 1000 / 1e6
    assert result.ttft_s[0] == pytest.approx(0.11 + transfer_s)


def test_transfers_queue_on_a_slow_link():
    work = Workload(np.array([0.0, 0.0]), np.array([1000, 1000]), np.array([0, 0]), np.array([2, 2]))
    result = simulate(Layout("disaggregated", prefill_workers=1, decode_workers=1), work, COSTS)
    # Both prompts prefill in one step; the second transfer waits for the first on the one link.
    assert sorted(result.ttft_s) == pytest.approx([0.01 + 0.2 + 1.0 + 0.005, 0.01 + 0.2 + 2.0 + 0.005])


def test_a_whole_prefill_stalls_running_decodes_but_a_chunk_does_not_as_much():
    work = Workload(np.array([0.0, 0.05]), np.array([100, 2000]), np.array([0, 0]), np.array([50, 2]))
    whole = simulate(Layout("colocated", workers=1), work, COSTS)
    chunked = simulate(Layout("chunked", workers=1, chunk_budget_tokens=256), work, COSTS)
    assert whole.itl_max_s[0] == pytest.approx(0.01 + 0.2)
    assert chunked.itl_max_s[0] == pytest.approx(0.01 + 255 * 1e-4)  # budget minus the one decode token


@pytest.mark.parametrize("name", ["long-prompts", "wrong-split"])
def test_vectorised_gap_statistics_equal_numpy_on_every_request(name):
    sc = scenario(name, n_requests=150)
    result = simulate(sc.layout, sc.workload, sc.costs, noise_sigma=0.2, seed=3, record=True)
    for request, gaps in enumerate(result.token_gaps):
        if len(gaps):
            assert result.itl_p99_s[request] == pytest.approx(np.percentile(gaps, 99), abs=1e-12)
            assert result.itl_max_s[request] == pytest.approx(gaps.max(), abs=1e-12)
            assert result.itl_mean_s[request] == pytest.approx(gaps.mean(), abs=1e-12)


def test_attainment_counts_requests_meeting_both_slos():
    result = simulate(Layout("colocated", workers=1), _one(1000, 5), COSTS, SLO(ttft_s=0.2, itl_s=0.02))
    assert result.attainment == 1.0
    assert result.attainment_for(SLO(ttft_s=0.05, itl_s=0.02)) == 0.0


def test_bad_layouts_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="prefill"):
        Layout("disaggregated", prefill_workers=0, decode_workers=2)
    with pytest.raises(ValueError, match="chunk_budget_tokens"):
        Layout("chunked", workers=2)
