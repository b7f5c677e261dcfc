"""`splitscope explain` against the oracle's ground truth (tests/oracle: it shares no code with explain).

The oracle serves a mix of short and long prompts token by token and records which prompts (and how
many of their tokens) each iteration ran (`Iteration.prefills`). Its traces carry our stall events
(`write_full(stall_events=True)`), not the truth. For the N worst requests by p99 inter-token gap:

- every stall explain finds is a true stall (an oracle gap over the rules), and none is missed;
- each stall's top cause is a prefill that truly ran in the iteration that ended the gap, and every
  prefill cause's share is the true one: its tokens in that iteration over all prefill tokens there
  (whole prompts: exact; chunked: explain has only whole-prompt tokens, so a share can be off where two
  prompts' chunks share an iteration: the per-chunk truth is what the links at the source carry,
  `write_full(stall_links=True)`, which explain reports as `stall_links`);
- the TTFT parts add up to the TTFT and each equals the oracle's own queue, prefill, KV transfer and
  decode-side admission times (a split deployment: "each side looks fine, the client waits").
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from tests.oracle.engine import Deployment, Physics, Run, serve
from tests.oracle.traces import EPOCH_NS, write_full
from tracer.explain.build import explain
from tracer.explain.read import load
from tracer.explain.select import choose

WORST = 8
REQUESTS = 160


def _workload(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Poisson arrivals at 6 req/s; one prompt in five is long (2-6k tokens), the rest short chats."""
    rng = np.random.default_rng(seed)
    arrival_s = np.cumsum(rng.exponential(1 / 6.0, REQUESTS))
    long = rng.random(REQUESTS) < 0.2
    prompt = np.where(long, rng.integers(2000, 6000, REQUESTS), rng.integers(50, 300, REQUESTS))
    output = rng.integers(40, 120, REQUESTS)
    return arrival_s, prompt, output


def _ns(seconds: float) -> int:
    return EPOCH_NS + int(round(seconds * 1e9))


def _explained(tmp_path: Path, run: Run, **shape: bool) -> tuple[dict, dict[str, int]]:
    path = tmp_path / "oracle.jsonl"
    trace_ids = write_full(path, run, seed=3, **shape)
    data = load([path])
    return explain(data, choose(data, (), WORST, "itl"), "itl"), {t: i for i, t in trace_ids.items()}


def _truth_by_window_end(run: Run) -> dict[tuple[str, int], tuple[float, dict[int, float]]]:
    """(worker, iteration end ns) -> (the iteration's seconds, request index -> its true share of it)."""
    assert run.iterations is not None
    out = {}
    for it in run.iterations:
        shares = {index: tokens / it.prefill_tokens for index, tokens in it.prefills} if it.prefill_tokens else {}
        out[(f"{it.pool}-{it.worker}", _ns(it.end_s))] = (it.end_s - it.start_s, shares)
    return out


def _true_stalls(run: Run, index: int) -> int:
    """The gaps of request `index` over both rules: the tracer's event rule (3x the median) and
    explain's (2x the median, over 10 ms)."""
    gaps = run.requests[index].gaps_s
    median = float(np.median(gaps)) if len(gaps) else 0.0
    return int(np.sum((gaps > 3 * median) & (gaps > 0.010))) if median > 0 else 0


def _check_stalls(result: dict, index_of: dict[str, int], run: Run, share_tolerance: float) -> int:
    truth = _truth_by_window_end(run)
    checked = 0
    for request in result["requests"]:
        index = index_of[request["trace_id"]]
        assert len(request["stalls"]) == _true_stalls(run, index), request["trace_id"]
        for stall in request["stalls"]:
            seconds, shares = truth[(stall["worker"], stall["end_unix_ns"])]
            assert stall["duration_s"] == pytest.approx(seconds, abs=2e-9)
            top = stall["causes"][0]
            assert top["kind"] == "prefill"
            assert index_of[top["trace_id"]] in shares, "the top cause did not run in that iteration"
            for cause in stall["causes"]:
                assert cause["kind"] == "prefill"  # every true stall here is a prefill in the batch
                true_share = shares[index_of[cause["trace_id"]]]
                assert cause["share"] == pytest.approx(true_share, abs=share_tolerance)
            assert sum(c["share"] for c in stall["causes"]) == pytest.approx(1.0, abs=0.02)
            checked += 1
    return checked


def _check_ttft_parts(result: dict, index_of: dict[str, int], run: Run) -> None:
    for request in result["requests"]:
        r = run.requests[index_of[request["trace_id"]]]
        parts = request["ttft_parts_s"]
        assert sum(parts.values()) == pytest.approx(request["ttft_s"], abs=1e-9)
        assert request["ttft_s"] == pytest.approx(r.ttft_s, abs=1e-6)
        assert parts["queue"] == pytest.approx(r.prefill_start_s - r.arrival_s, abs=1e-6)
        assert parts["prefill"] == pytest.approx(r.prefill_end_s - r.prefill_start_s, abs=1e-6)
        if r.transfer_end_s >= 0:
            assert parts["kv_transfer"] == pytest.approx(r.transfer_end_s - r.prefill_end_s, abs=1e-6)
            assert parts["decode_wait"] == pytest.approx(r.first_token_s - r.transfer_end_s, abs=1e-6)
        assert abs(parts["unexplained"]) < 1e-6
        assert parts["frontend"] == pytest.approx(0.0, abs=1e-6)


def test_colocated_stalls_are_the_true_prefills(tmp_path):
    run = serve(Deployment("colocated", workers=2), *_workload(1), Physics())
    result, index_of = _explained(tmp_path, run, stall_events=True)
    # Whole prompts: a prefill span is exactly the iteration(s) that ran it, so the shares are exact.
    assert _check_stalls(result, index_of, run, share_tolerance=0.001) >= WORST
    _check_ttft_parts(result, index_of, run)


def _true_link_stall_s(run: Run, index: int) -> dict[int, float]:
    """Request index -> the stall time (s) its prefill tokens took from request `index`: over every gap
    of the tracer's event rule (3x the median), that prefill's tokens' share of the gap's iteration."""
    assert run.iterations is not None
    r = run.requests[index]
    iteration = {(str(it.pool), it.worker, it.end_s): it for it in run.iterations}
    gaps = r.gaps_s
    median = float(np.median(gaps))
    out: dict[int, float] = {}
    for end_s, gap in zip(r.token_s, gaps):
        if gap > 3 * median:
            it = iteration[("colocated", r.decode_worker, end_s)]
            for other, tokens in it.prefills:
                out[other] = out.get(other, 0.0) + float(gap) * tokens / it.prefill_tokens
    return out


def test_chunked_stall_links_name_the_prefills_explain_computes(tmp_path):
    """With stall links on the decode spans (what our pipeline writes), explain reports them, they hold
    the true per-prefill stall time, and every prefill explain computed for a stall is among them."""
    run = serve(Deployment("chunked", workers=2, budget_tokens=512), *_workload(2), Physics())
    result, index_of = _explained(tmp_path, run, stall_links=True)
    # Chunks keep most gaps short: a few stalls remain, where long chunks' attention adds up.
    assert _check_stalls(result, index_of, run, share_tolerance=0.001) >= 3
    _check_ttft_parts(result, index_of, run)
    linked_requests = 0
    for request in result["requests"]:
        truth = _true_link_stall_s(run, index_of[request["trace_id"]])
        links = {index_of[link["trace_id"]]: link["stalled_s"] for link in request["stall_links"]}
        assert links == pytest.approx(truth, abs=2e-9)
        computed = {index_of[c["trace_id"]] for stall in request["stalls"] for c in stall["causes"]}
        assert computed <= set(links)
        linked_requests += bool(links)
    assert linked_requests >= 3


def test_chunked_stalls_without_links_name_the_true_prefills(tmp_path):
    """Without links explain splits an iteration by the prompts' whole uncached tokens: the names are
    right, a share can be off where a prompt's last chunk shares the iteration with the next one's first."""
    run = serve(Deployment("chunked", workers=2, budget_tokens=512), *_workload(2), Physics())
    result, index_of = _explained(tmp_path, run, stall_events=True)
    assert _check_stalls(result, index_of, run, share_tolerance=1.0) >= 3


def test_split_ttft_parts_are_the_true_ones(tmp_path):
    """A split deployment's TTFT: queue and prefill on the prefill side, the transfer, then the decode
    side's admission (`decode_wait`), each the oracle's own time."""
    run = serve(Deployment("split", prefill_workers=1, decode_workers=1), *_workload(4), Physics())
    path = tmp_path / "split.jsonl"
    index_of = {t: i for i, t in write_full(path, run, seed=5).items()}
    data = load([path])
    result = explain(data, choose(data, (), WORST, "ttft"), "ttft")
    _check_ttft_parts(result, index_of, run)
    waits = [request["ttft_parts_s"]["decode_wait"] for request in result["requests"]]
    assert all(not math.isnan(w) for w in waits)


def test_a_vllm_pd_pairs_ttft_is_the_clients_and_its_parts_the_oracles(tmp_path):
    """Stock vLLM behind a P/D proxy through real sidecars (one per instance): each instance's own TTFT
    looks fine (the prefill instance's is its prefill), the client waits for the decode instance's first
    token. explain's TTFT is the client's, split into the prefill side's queue and prefill and the decode
    side's wait for the KV (transfer and admission: vLLM's queue there)."""
    from tests.oracle.through_sidecar import write_via_sidecars

    physics = Physics(link_bytes_per_s=0.125e9)  # 1 Gb/s: the transfer is a visible part
    run = serve(Deployment("split", prefill_workers=1, decode_workers=1), *_workload(6), physics)
    path = tmp_path / "vllm-pd.jsonl"
    write_via_sidecars(path, run, seed=6)
    data = load([path])
    result = explain(data, choose(data, (), WORST, "ttft"), "ttft")
    by_request_id = {f"req-{r.index}": r for r in run.requests}
    for request in result["requests"]:
        r = by_request_id[request["request_id"]]
        parts = request["ttft_parts_s"]
        assert request["ttft_s"] == pytest.approx(r.ttft_s, abs=1e-6)
        assert request["ttft_s"] > (r.prefill_end_s - r.arrival_s) + 1e-3  # more than the prefill side saw
        assert sum(parts.values()) == pytest.approx(request["ttft_s"], abs=1e-9)
        assert parts["queue"] == pytest.approx(r.prefill_start_s - r.arrival_s, abs=1e-6)
        assert parts["prefill"] == pytest.approx(r.prefill_end_s - r.prefill_start_s, abs=1e-6)
        assert parts["kv_transfer"] == pytest.approx(r.first_token_s - r.prefill_end_s, abs=1e-6)
        assert abs(parts["decode_wait"]) < 1e-6 and abs(parts["unexplained"]) < 1e-6


def test_stock_vllm_through_sidecars_stalls_and_links_are_estimated_and_name_the_overlapping_prompts(tmp_path):
    """Stock vLLM (request spans only) through a real sidecar: explain has no token times, so every stall is
    estimated from request overlap and says so; its prefill causes and the sidecar's stall links (estimated
    too) name prompts that truly ran inside the request's decode, and the links name all of them."""
    from tests.oracle.through_sidecar import write_via_sidecars
    from tracer.sidecar.overlap import MAX_STALL_LINKS

    run = serve(Deployment("colocated", workers=1), *_workload(2), Physics())
    path = tmp_path / "vllm.jsonl"
    write_via_sidecars(path, run, seed=2)
    data = load([path])
    result = explain(data, choose(data, (), WORST, "ttft"), "ttft")
    index_of = {trace_id: int(trace.request_id.removeprefix("req-")) for trace_id, trace in data.traces.items()}
    iterations = [it for it in run.iterations or [] if it.worker == 0]
    checked = 0
    for request in result["requests"]:
        r = run.requests[index_of[request["trace_id"]]]
        ran = {
            index
            for it in iterations[r.first_iteration : r.first_iteration + r.output_tokens - 1]
            for index, _ in it.prefills
            if index != r.index
        }
        assert sum(request["ttft_parts_s"].values()) == pytest.approx(request["ttft_s"], abs=1e-9)
        linked = {index_of[link["trace_id"]] for link in request["stall_links"]}
        assert linked == ran if len(ran) <= MAX_STALL_LINKS else linked < ran
        assert all(link["estimated"] for link in request["stall_links"])
        for stall in request["stalls"]:
            assert stall["estimated"] and stall["basis"].startswith("request overlap on worker vllm-0")
            for cause in stall["causes"]:
                assert cause["estimated"]
                if cause["kind"] == "prefill":
                    assert index_of[cause["trace_id"]] in ran
                    checked += 1
    assert checked >= WORST // 2
    assert sum(bool(request["stall_links"]) for request in result["requests"]) >= WORST // 2
