"""The stratified step-span rule: prefill steps kept up to a budget per window, 1 in N of the rest."""

from __future__ import annotations

import pytest

from tracer.step_sampling import StepSampler

S = 1_000_000_000


def test_every_prefill_step_is_kept_with_weight_one_up_to_the_budget_then_one_in_n():
    sampler = StepSampler(decode_sample_every=4, prefill_budget_per_window=3, window_ns=10 * S)
    weights = [sampler.keep(i, 100) for i in range(11)]
    assert weights == [1, 1, 1, 4, 0, 0, 0, 4, 0, 0, 0]
    assert sum(weights) == 11  # the kept spans stand for every step of the stratum


def test_the_prefill_budget_renews_each_window():
    sampler = StepSampler(decode_sample_every=5, prefill_budget_per_window=2, window_ns=10 * S)
    first = [sampler.keep(i, 64) for i in range(3)]
    second = [sampler.keep(10 * S + i, 64) for i in range(2)]
    assert first == [1, 1, 5] and second == [1, 1]


def test_decode_only_steps_are_kept_one_in_n_with_weight_n():
    sampler = StepSampler(decode_sample_every=10)
    weights = [sampler.keep(i, 0) for i in range(1000)]
    assert weights.count(10) == 100 and weights.count(0) == 900


def test_one_in_one_keeps_every_step():
    sampler = StepSampler(decode_sample_every=1, prefill_budget_per_window=0)
    assert [sampler.keep(i, i % 2) for i in range(6)] == [1] * 6


@pytest.mark.parametrize("options", [{"decode_sample_every": 0}, {"prefill_budget_per_window": -1}])
def test_bad_settings_are_refused(options):
    with pytest.raises(ValueError):
        StepSampler(**options)
