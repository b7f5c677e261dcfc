"""Step spans sampled by the exporter's stratified rule at its default rate: the report's weighted fits
estimate the fits on every step, and its verdicts do not change (the synthetic scenarios of test_verdicts)."""

from __future__ import annotations

import numpy as np
import pytest

from tracer.report.build import build_report
from tracer.report.fit import fit_steps
from tracer.report.tables import load_traces
from tracer.step_sampling import DEFAULT_DECODE_SAMPLE_EVERY
from tracer.vocabulary import Verdict

from .conftest import quick_options
from .sampled_traces import sample_step_spans

# Stated tolerances of a fit on the sampled spans against the fit on all of them (about 1 span in 9 kept):
PREDICTION_TOLERANCE = 0.03  # each step's predicted cycle time, relative, worst step
COEFFICIENT_TOLERANCE = 0.10  # the terms that carry the cost alone: base, per prefill token
# The decode part (per decode request + per context token): both grow with the batch and trade against each
# other from one sample to the next (per request moved 10-31% on some noise draws while the sum held), so
# their sum is judged, on every decode step, against that step's predicted time.
DECODE_PART_TOLERANCE = 0.03
INTERFERENCE_TOLERANCE = 0.02  # the interference factor (mixed steps are all kept: nearly exact)


@pytest.fixture(scope="module")
def sampled(scenario_traces, tmp_path_factory):
    """name -> (Scenario, full trace path, sampled trace path); step spans sampled at the default rate."""
    folder = tmp_path_factory.mktemp("sampled")
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            sc, path, _ = scenario_traces(name)
            target = folder / f"{name}.jsonl"
            seen, kept = sample_step_spans(path, target)
            assert kept < seen / 5, (seen, kept)  # the rule really thins them
            cache[name] = (sc, path, target)
        return cache[name]

    return get


@pytest.mark.parametrize("name", ["long-prompts", "chatty", "strict-itl"])
def test_a_weighted_fit_on_sampled_steps_matches_the_fit_on_all(sampled, name):
    _, full_path, sampled_path = sampled(name)
    every, kept = load_traces([full_path]).steps, load_traces([sampled_path]).steps
    assert kept.sampled and set(np.unique(kept.weight)) == {1.0, float(DEFAULT_DECODE_SAMPLE_EVERY)}
    # The weights account for every step: each stratum's weight sum is its step count, within one N.
    assert abs(kept.weight.sum() - len(every)) <= 2 * DEFAULT_DECODE_SAMPLE_EVERY * len(set(every.worker))
    full, thin = fit_steps(every), fit_steps(kept)
    for term in ("base_s", "prefill_s_per_token"):
        assert getattr(thin.costs, term) == pytest.approx(getattr(full.costs, term), rel=COEFFICIENT_TOLERANCE), term
    decoding = every.decode_requests > 0

    def decode_part_s(costs):
        return (
            costs.decode_s_per_request * every.decode_requests[decoding]
            + costs.context_s_per_token * every.context_tokens[decoding]
        )

    step_s = full.design[decoding] @ np.array([getattr(full.costs, t) for t in full.terms])
    moved = np.abs(decode_part_s(thin.costs) - decode_part_s(full.costs)) / step_s
    assert np.max(moved) <= DECODE_PART_TOLERANCE, float(np.max(moved))
    assert thin.interference_factor == pytest.approx(full.interference_factor, rel=INTERFERENCE_TOLERANCE)
    design = full.design
    predicted_full = design @ np.array([getattr(full.costs, t) for t in full.terms])
    predicted_thin = design @ np.array([getattr(thin.costs, t) for t in thin.terms])
    assert np.max(np.abs(predicted_thin / predicted_full - 1)) <= PREDICTION_TOLERANCE


def test_weights_make_the_mean_batch_of_sampled_steps_the_mean_over_all(sampled):
    _, full_path, sampled_path = sampled("chatty")
    every, kept = load_traces([full_path]).steps, load_traces([sampled_path]).steps
    truth = every.decode_requests[every.decode_requests > 0].mean()
    decoding = kept.decode_requests > 0
    weighted = np.average(kept.decode_requests[decoding], weights=kept.weight[decoding])
    unweighted = kept.decode_requests[decoding].mean()
    # Prefill steps are all kept, so unweighted they are over-represented; weighted, they are not.
    assert abs(weighted - truth) < abs(unweighted - truth)
    assert weighted == pytest.approx(truth, rel=0.01)


@pytest.mark.parametrize(
    "name, verdict",
    [
        ("chatty", Verdict.STAY_COLOCATED),
        ("long-prompts", Verdict.ENABLE_CHUNKED_PREFILL),
        ("strict-itl", Verdict.SPLIT),
        ("wrong-split", Verdict.REBALANCE),
        ("slow-link", Verdict.MERGE),
    ],
)
def test_verdicts_do_not_change_when_step_spans_are_sampled(sampled, name, verdict):
    sc, full_path, sampled_path = sampled(name)
    full = build_report([full_path], quick_options(sc, margin=0.15))
    thin = build_report([sampled_path], quick_options(sc, margin=0.15))
    assert full.verdict == verdict, full.evidence  # the unsampled verdict test_verdicts.py checks
    assert (thin.verdict, thin.ratio, thin.from_ratio, thin.chunk_budget_tokens) == (
        full.verdict,
        full.ratio,
        full.from_ratio,
        full.chunk_budget_tokens,
    ), thin.evidence
