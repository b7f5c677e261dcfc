"""`Workload.resample`, the bootstrap every simulation runs on: it keeps the observed arrival process
(issue 28 point 2e). Independent draws of gaps and lengths spread a burst of long prompts over the run, and
a model fed that predicts a colocated layout more interference-free than the traffic it was traced on."""

from __future__ import annotations

import numpy as np

from tracer.report.simulate import Workload, block_length

LONG_TOKENS = 2000
BURST = 6  # long prompts arriving together, every EVERY short requests
EVERY = 20
NEAR_S = 0.05


def _bursty(n_bursts: int = 15, seed: int = 3) -> Workload:
    """Poisson short chats at 1/s; every EVERY of them a burst of BURST long prompts within 5 ms."""
    rng = np.random.default_rng(seed)
    arrivals, prompts, outputs = [], [], []
    t = 0.0
    for _ in range(n_bursts):
        for _ in range(EVERY):
            t += rng.exponential(1.0)
            arrivals.append(t), prompts.append(int(rng.integers(50, 150))), outputs.append(int(rng.integers(20, 80)))
        for _ in range(BURST):
            t += 0.001
            arrivals.append(t), prompts.append(LONG_TOKENS), outputs.append(int(rng.integers(20, 80)))
    n = len(arrivals)
    return Workload(np.array(arrivals), np.array(prompts), np.zeros(n, dtype=int), np.array(outputs))


def _long_with_a_long_neighbour(w: Workload) -> float:
    """Share of long prompts with another long prompt arriving within NEAR_S of them."""
    times = w.arrival_s[w.prompt_tokens == LONG_TOKENS]
    gaps = np.diff(times)
    near = np.zeros(len(times), dtype=bool)
    near[1:] |= gaps < NEAR_S
    near[:-1] |= gaps < NEAR_S
    return float(near.mean())


def test_bursts_of_long_prompts_arrive_together_after_resampling():
    observed = _bursty()
    assert _long_with_a_long_neighbour(observed) == 1.0
    for seed in range(3):
        sample = observed.resample(3000, seed)
        # Blocks are cut anywhere, so a burst split across two blocks can leave one long prompt alone;
        # drawn independently (the bootstrap before it), about one in six had a long neighbour this close.
        assert _long_with_a_long_neighbour(sample) >= 0.9, seed
        # ... and the share of long prompts, and the mean rate, stay as observed.
        share = float((sample.prompt_tokens == LONG_TOKENS).mean())
        assert abs(share - BURST / (BURST + EVERY)) < 0.03
        assert abs(sample.rate_per_s / observed.rate_per_s - 1) < 0.1


def test_a_resampled_request_keeps_its_own_lengths_and_the_seed_fixes_the_draw():
    observed = _bursty()
    pairs = set(zip(observed.prompt_tokens.tolist(), observed.output_tokens.tolist()))
    sample = observed.resample(1000, 7)
    assert set(zip(sample.prompt_tokens.tolist(), sample.output_tokens.tolist())) <= pairs
    again = observed.resample(1000, 7)
    assert np.array_equal(sample.arrival_s, again.arrival_s)
    assert np.array_equal(sample.prompt_tokens, again.prompt_tokens)
    assert not np.array_equal(sample.arrival_s, observed.resample(1000, 8).arrival_s)
    assert (np.diff(sample.arrival_s) >= 0).all()


def test_a_block_is_never_shorter_than_the_longest_burst():
    gaps = np.ones(999)
    assert block_length(gaps) == 10  # no burst: n^(1/3)
    gaps[100:130] = 1e-3  # 31 requests in one burst
    assert block_length(gaps) == 31
    assert block_length(np.ones(11)) == 3  # capped at a quarter of the requests
    assert block_length(np.ones(1)) == 1


def test_a_single_request_resamples_to_poisson_arrivals():
    one = Workload(np.array([5.0]), np.array([100]), np.array([0]), np.array([10]))
    sample = one.resample(50, 0)
    assert len(sample) == 50 and (sample.prompt_tokens == 100).all()
    assert sample.arrival_s[0] == 0.0 and (np.diff(sample.arrival_s) > 0).all()
