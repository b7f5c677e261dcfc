"""Physics the simulator shares with the reference server, each checked against the independent oracle
(tests/oracle/engine.py) and against values worked out by hand:

- a request that becomes ready while a step is in flight (an arrival, or a KV cache landing on a busy
  decode worker) waits for that step: its TTFT holds the step's residual;
- the router's placement: least outstanding (the reference router's rule), round-robin, session-sticky;
- text held back by the front end (a token's text sent with the next token's) joins the client's gaps;
- past the largest batch the step fit saw, no request costs less than the marginal cost measured at the
  largest batches, and the report says it extrapolated.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from tests.oracle.cases import CASES, traffic
from tests.oracle.engine import Deployment, Physics, serve
from tracer.report.build import build_report
from tracer.report.fit import fit_steps
from tracer.report.simulate import Costs, EngineParams, Layout, StepCosts, TransferCosts, Workload, simulate
from tracer.report.tables import StepTable, load_traces

from .conftest import quick_options

# Flat steps: 10 ms each, plus 0.1 ms per prefill token; nothing per running request or context token.
PHYSICS = Physics(
    iteration_base_s=0.010,
    per_context_token_s=0.0,
    per_running_request_s=0.0,
    per_prefill_token_s=1e-4,
    per_attention_token2_s=0.0,
    kv_bytes_per_token=1000.0,
    link_bytes_per_s=1e6,
    link_latency_s=0.0045,
)


def _costs(physics: Physics) -> Costs:
    """The oracle's physics in the report's cost form (the same forms: these are the true costs)."""
    step = StepCosts(
        physics.iteration_base_s,
        physics.per_context_token_s,
        physics.per_running_request_s,
        physics.per_prefill_token_s,
        physics.per_attention_token2_s,
    )
    return Costs(step, TransferCosts(physics.kv_bytes_per_token, physics.link_bytes_per_s, physics.link_latency_s))


def _layout(deployment: Deployment) -> Layout:
    if deployment.kind == "split":
        return Layout(
            "disaggregated", prefill_workers=deployment.prefill_workers, decode_workers=deployment.decode_workers
        )
    return Layout(deployment.kind, workers=deployment.workers, chunk_budget_tokens=deployment.budget_tokens)


def _both(deployment: Deployment, arrival, prompt, output, physics: Physics = PHYSICS):
    """(oracle run, simulated result) of the same requests on the same deployment and router."""
    arrival, prompt, output = (np.asarray(x) for x in (arrival, prompt, output))
    oracle = serve(deployment, arrival, prompt, output, physics)
    work = Workload(arrival.astype(float), prompt, np.zeros(len(prompt), dtype=np.int64), output)
    sim = simulate(
        _layout(deployment), work, _costs(physics), params=EngineParams(router=deployment.router), record=True
    )
    return oracle, sim


# ------------------------------------------------------------------------------ the step in flight


def test_an_arrival_mid_step_waits_for_the_step_in_flight():
    # A (100 tokens) prefills over [0, 20 ms) and decodes in 10 ms steps: boundaries at 20, 30, 40 ms.
    # B arrives at 35 ms, mid-step: it waits 5 ms for the step to end, then prefills with A's decode
    # token in one step of 10 + 10 ms. TTFT = 5 + 20 = 25 ms, not the 20 ms of a step started at arrival.
    oracle, sim = _both(Deployment("colocated", workers=1), [0.0, 0.035], [100, 100], [50, 3])
    assert oracle.requests[1].ttft_s == pytest.approx(0.025)
    assert sim.ttft_s[1] == pytest.approx(0.025)
    assert sim.ttft_s == pytest.approx([r.ttft_s for r in oracle.requests])
    assert sim.token_gaps[1] == pytest.approx(oracle.requests[1].gaps_s)


def test_a_kv_cache_landing_mid_step_waits_for_the_decode_step_in_flight():
    # Split 1:1. A (100 tokens): prefill [0, 20 ms), wire 100 ms, + 4.5 ms latency: ready at 124.5 ms; the
    # decode worker then steps every 10 ms from 124.5 ms. B (155 tokens) arrives at 50 ms, prefills
    # [50, 75.5 ms), waits for A's transfer to free the link at 120 ms, wires 155 ms: ready at 279.5 ms,
    # mid-step. The decode worker admits it (and sends its first token) at the next boundary, 284.5 ms:
    # TTFT = 234.5 ms, 5 ms of it the step in flight; its next token one 10 ms step later.
    oracle, sim = _both(Deployment("split", prefill_workers=1, decode_workers=1), [0.0, 0.05], [100, 155], [50, 3])
    assert oracle.requests[1].transfer_end_s == pytest.approx(0.2795)
    assert oracle.requests[1].ttft_s == pytest.approx(0.2345)
    assert sim.ttft_s[1] == pytest.approx(0.2345)
    assert sim.token_gaps[1] == pytest.approx([0.01, 0.01])
    assert sim.ttft_s == pytest.approx([r.ttft_s for r in oracle.requests])
    assert sim.itl_max_s == pytest.approx([r.itl_s("max") for r in oracle.requests])


# ------------------------------------------------------------------------------ text held back


def _held_both(share: float, seed: int = 0):
    """(oracle run, simulated result) of 120 steady requests on one colocated worker whose front end holds
    back each token's text with probability `share` (oracle and simulator each draw their own, by `seed`)."""
    n = 120
    arrival, prompt, output = np.arange(n) * 0.25, np.full(n, 200), np.full(n, 60)
    deployment = Deployment("colocated", workers=1)
    oracle = serve(deployment, arrival, prompt, output, PHYSICS, seed=seed, held_share=share)
    work = Workload(arrival, prompt, np.zeros(n, dtype=np.int64), output)
    costs = Costs(_costs(PHYSICS).step, _costs(PHYSICS).transfer, joined_token_share=share)
    return oracle, simulate(_layout(deployment), work, costs, seed=seed, record=True)


def test_a_token_held_back_until_the_last_makes_one_gap_of_the_whole_decode():
    # Every token held: the client gets the first token, then everything else in one event with the last.
    oracle, sim = _held_both(1.0)
    for stat, predicted in (("max", sim.itl_max_s), ("p99", sim.itl_p99_s), ("mean", sim.itl_mean_s)):
        assert predicted == pytest.approx([r.itl_s(stat) for r in oracle.requests], abs=1e-9), stat
    decode_s = oracle.requests[0].token_s[-1] - oracle.requests[0].first_token_s
    assert sim.itl_max_s[0] == pytest.approx(decode_s)
    assert sim.token_gaps[0] == pytest.approx(oracle.requests[0].client_gaps_s)
    assert sorted(sim.token_gaps[0])[:-1] == [0.0] * 58


def test_a_share_of_held_tokens_stretches_the_clients_gaps_as_the_oracles_front_end_does():
    # A quarter held, drawn independently by each, over four draws (the requests running together share
    # their prefill steps, so one draw's mean moves by a few percent): the per-request p99 and max of what
    # the client saw agree on average (runs of held tokens make gaps of two, three... steps), well over the
    # engine's own.
    runs = [_held_both(0.25, seed) for seed in range(4)]
    for stat in ("max", "p99"):
        truth = np.mean([[r.itl_s(stat) for r in oracle.requests] for oracle, _ in runs])
        engine = np.mean([[r.itl_s(stat, client=False) for r in oracle.requests] for oracle, _ in runs])
        predicted = np.mean([sim.itl(stat) for _, sim in runs])
        assert truth > 1.2 * engine, stat
        assert predicted == pytest.approx(truth, rel=0.06), stat
    for oracle, sim in runs:
        assert sim.itl_mean_s == pytest.approx([r.itl_s("mean") for r in oracle.requests], abs=1e-9)


# ------------------------------------------------------------------------------ the router


def test_least_outstanding_sends_an_arrival_to_the_worker_with_fewer_requests_in_flight():
    # Two colocated workers. A (50 tokens out) on worker 0, B (2 out) on worker 1; B has finished by
    # 0.5 s, A has not. The reference router counts its own requests in flight: C goes to worker 1
    # (0 in flight) where round-robin would stack it on worker 0, beside A's running decode.
    arrival, prompt, output = [0.0, 0.001, 0.5], [100, 100, 2000], [200, 2, 5]
    least = Deployment("colocated", workers=2, router="least-outstanding")
    oracle, sim = _both(least, arrival, prompt, output)
    assert [r.prefill_worker for r in oracle.requests] == [0, 1, 1]
    assert list(sim.timeline["prefill_worker"]) == [0, 1, 1]
    # Kept away from A, the long prompt's prefill does not stall A's decode.
    assert sim.itl_max_s[0] == pytest.approx(0.01)
    rr_oracle, rr_sim = _both(Deployment("colocated", workers=2, router="round-robin"), arrival, prompt, output)
    assert list(rr_sim.timeline["prefill_worker"]) == [0, 1, 0]
    assert rr_sim.itl_max_s[0] == pytest.approx(0.01 + 0.2)  # a 2000-token prefill in one of A's steps
    assert rr_sim.itl_max_s == pytest.approx([r.itl_s("max") for r in rr_oracle.requests])


def test_a_split_router_picks_the_prefill_worker_by_tokens_and_the_decode_worker_by_requests_at_arrival():
    # Split 2:2. A long prompt (4000) goes to prefill worker 0; B and C (100 each) arrive while it
    # prefills: B to worker 1 (0 tokens in flight), C to worker 1 too (100 < 4000 tokens), where
    # round-robin would queue C behind the long prompt. Decode workers by requests in flight at arrival:
    # A -> 0, B -> 1, C -> 0 (a tie of one each: the first).
    arrival, prompt, output = [0.0, 0.001, 0.002], [4000, 100, 100], [20, 20, 20]
    oracle, sim = _both(
        Deployment("split", prefill_workers=2, decode_workers=2, router="least-outstanding"), arrival, prompt, output
    )
    assert [(r.prefill_worker, r.decode_worker) for r in oracle.requests] == [(0, 0), (1, 1), (1, 0)]
    assert list(sim.timeline["prefill_worker"]) == [0, 1, 1]
    assert list(sim.timeline["decode_worker"]) == [0, 1, 0]
    assert sim.ttft_s == pytest.approx([r.ttft_s for r in oracle.requests])
    # C waits for B's 20 ms prefill and then for B's transfer on worker 1's link (100 ms), not for A's
    # 410 ms prefill.
    assert sim.ttft_s[2] < 0.41
    _, rr = _both(
        Deployment("split", prefill_workers=2, decode_workers=2, router="round-robin"), arrival, prompt, output
    )
    assert rr.ttft_s[2] > 0.41


@pytest.mark.parametrize("router", ["least-outstanding", "round-robin"])
@pytest.mark.parametrize("name", ["long-fast-link", "bursty", "chunked-deployed"])
def test_every_request_matches_the_oracle_under_each_router(name, router):
    case = CASES[name]
    sample = traffic(case, 200, 7)
    gpus = case.current.gpus
    for deployment in (
        Deployment(case.current.kind, workers=gpus, budget_tokens=case.current.budget_tokens, router=router),
        Deployment("split", prefill_workers=gpus // 2, decode_workers=gpus - gpus // 2, router=router),
    ):
        oracle, sim = _both(deployment, sample.at(3.0), sample.prompt_tokens, sample.output_tokens, case.physics)
        assert sim.ttft_s == pytest.approx([r.ttft_s for r in oracle.requests], abs=1e-9), deployment
        assert sim.itl_max_s == pytest.approx([r.itl_s("max") for r in oracle.requests], abs=1e-9), deployment
        assert list(sim.timeline["decode_worker"]) == [r.decode_worker for r in oracle.requests], deployment


def test_session_routing_keeps_a_session_on_one_worker_and_spreads_sessions():
    n = 400
    session = np.arange(n) % 40
    work = Workload(np.arange(n) * 0.05, np.full(n, 100), np.zeros(n, dtype=np.int64), np.full(n, 5), session)
    result = simulate(
        Layout("colocated", workers=4), work, _costs(PHYSICS), params=EngineParams(router="session"), record=True
    )
    placed = result.timeline["prefill_worker"]
    for s in range(40):
        assert len(set(placed[session == s])) == 1
    assert len(set(placed)) == 4
    assert max(np.bincount(placed)) < 0.5 * n


def test_an_unknown_router_is_refused():
    with pytest.raises(ValueError, match="router"):
        EngineParams(router="random")


# ------------------------------------------------------------------------------ past the largest batch seen


def _knee_steps(batches: np.ndarray, repeats: int = 10) -> StepTable:
    """Decode-only steps of a memory-bound-then-compute-bound accelerator: 10 ms + 0.1 ms per request up
    to a knee at 4 requests, then 1 ms per further request. No context, no prefill, no noise."""
    batch = np.repeat(batches, repeats).astype(np.int64)
    duration = 0.010 + 1e-4 * np.minimum(batch, 4) + 1e-3 * np.maximum(batch - 4, 0)
    start = np.cumsum(np.concatenate(([0.0], duration[:-1] + 0.1)))  # 100 ms idle between: no back-to-back
    n = len(batch)
    return StepTable(
        (start * 1e9).astype(np.int64),
        duration,
        np.array(["decode"] * n, dtype=object),
        np.array(["d0"] * n, dtype=object),
        batch,
        np.zeros(n, dtype=np.int64),
        np.zeros(n, dtype=np.int64),
        np.full(n, np.nan),
        np.ones(n),
    )


def test_a_fit_on_small_batches_prices_larger_ones_at_the_largest_batches_marginal_cost():
    fit = fit_steps(_knee_steps(np.arange(1, 9)))
    costs = fit.costs
    assert fit.max_batch_seen == 8
    # One straight line through batches 1-8 is too flat for the top: the marginal cost measured at the
    # largest batches (4-8) is 1 ms a request, and past 8 no request may cost less.
    assert costs.decode_s_per_request < 0.9e-3
    assert costs.decode_s_per_request_beyond == pytest.approx(1e-3, rel=1e-6)
    per_request_past_8 = (costs.step_s(40, 0, 0) - costs.step_s(8, 0, 0)) / 32
    assert per_request_past_8 >= 1e-3 * (1 - 1e-6)
    # The true batch-40 step: 10 + 0.4 + 36 ms.
    assert costs.step_s(40, 0, 0) == pytest.approx(0.0464, rel=0.05)
    # Within the batches it saw, the fit is unchanged.
    assert costs.step_s(8, 0, 0) == pytest.approx(costs.base_s + 8 * costs.decode_s_per_request)


def test_the_simulator_prices_a_batch_past_the_fit_by_the_beyond_slope():
    step = StepCosts(0.01, 0.0, 1e-4, 1e-4, max_batch_seen=8, decode_s_per_request_beyond=1e-3)
    n = 40
    work = Workload(np.zeros(n), np.full(n, 10), np.zeros(n, dtype=np.int64), np.full(n, 3))
    result = simulate(Layout("colocated", workers=1), work, Costs(step, TransferCosts(1.0, 1e9)), record=True)
    assert result.max_batch == 40
    # The decode steps of all 40: 10 ms + 8 x 0.1 ms + 32 x 1 ms.
    decode_steps = [
        d for d, b in zip(result.steps["colocated"].duration_s, result.steps["colocated"].decode_requests) if b == 40
    ]
    assert decode_steps == pytest.approx([0.01 + 8e-4 + 32e-3] * len(decode_steps))


def test_the_bootstrap_re_measures_the_slope_past_the_largest_batch():
    steps = _knee_steps(np.arange(1, 9))
    noisy = np.random.default_rng(0).lognormal(0.0, 0.05, len(steps))
    steps.duration_s = steps.duration_s * noisy
    fit = fit_steps(steps)
    drawn = {round(fit.resampled(np.random.default_rng(k)).decode_s_per_request_beyond, 9) for k in range(5)}
    assert len(drawn) > 1  # the extrapolated slope varies between re-runs: confidence sees its spread


def test_the_report_states_the_largest_batch_it_fitted_and_what_it_extrapolated(scenario_traces):
    sc, path, _ = scenario_traces("wrong-split")
    report = build_report([path], quick_options(sc))
    data = load_traces([path])
    step = report.fits["step"]
    assert step["max_batch_seen"] == int(data.steps.decode_requests.max())
    assert step["max_context_seen"] == int(data.steps.context_tokens.max())
    assert step["decode_s_per_request_beyond"] >= step["decode_s_per_request"]
    past = [line for line in report.assumptions if "past the largest fitted" in line]
    for line in past:
        simulated, fitted = (int(x) for x in re.findall(r"up to (\d+) .*?fitted \((\d+)\)", line)[0])
        assert simulated > fitted
    assert any("decode batches up to" in line and "EXTRAPOLATED" in line for line in past), report.assumptions


def test_the_report_refuses_an_unknown_router_and_states_the_one_it_used(scenario_traces):
    sc, path, _ = scenario_traces("chatty")
    with pytest.raises(ValueError, match="--router"):
        quick_options(sc, router="random")
    report = build_report([path], quick_options(sc, router="least-outstanding", sim_max_requests=500))
    assert any("fewest requests in flight" in line and "--router" in line for line in report.assumptions)
