"""The step model and inter-token gaps from request spans alone (stock vLLM, SGLang, Dynamo via the sidecar).

Without step spans, each request's decode span still says how long its `output - 1` iterations took, and
the requests around it on the same worker say what those iterations carried:

- the decode batch and context it ran with: the time-average, over its decode window, of the requests
  decoding on that worker (each weighing its prompt plus half its output in context);
- the prefills that ran on that worker inside its window: in a colocated engine each is one iteration
  that every running decode waited for, as long as that prefill span (a whole prefill in a mixed step).

So `(decode_s - sum of those prefills) / (iterations - their count)` is a decode-only iteration at that
batch and context, fitted as `base + per_context * context + per_request * batch`; the prefill terms come
from the prefill fit. Per-request gaps follow: its decode-only iteration, plus one stall per overlapping
prefill of that prefill's length. Everything here is an estimate and the report says so. Pure computation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from tracer.report.fit import PASS_TERMS, PrefillFit, StepFit, fit_nonnegative, fit_passes
from tracer.report.model_shape import ModelShape
from tracer.report.simulate import StepCosts
from tracer.report.tables import RequestTable


@dataclass(frozen=True)
class Overlap:
    """Per request (NaN / empty where it did not decode): what its decode window shared on its worker."""

    iterations: np.ndarray  # output tokens - 1
    mean_batch: np.ndarray
    mean_context_tokens: np.ndarray
    decode_only_step_s: np.ndarray  # its decode time net of the prefills it waited for, per iteration
    stalls_s: list[np.ndarray]  # the durations of the prefills that ran inside its decode window


def _time_average(
    starts: np.ndarray, ends: np.ndarray, weights: np.ndarray, lo: np.ndarray, hi: np.ndarray
) -> np.ndarray:
    """For each window [lo, hi]: the time-average of sum(weight) over the intervals [start, end) covering t."""
    times = np.concatenate([starts, ends])
    deltas = np.concatenate([weights, -weights])
    order = np.argsort(times, kind="stable")
    times, level = times[order], np.cumsum(deltas[order])
    # Integral of the step function from times[0] up to each breakpoint.
    integral = np.concatenate([[0.0], np.cumsum(level[:-1] * np.diff(times))])

    def at(t: np.ndarray) -> np.ndarray:
        k = np.searchsorted(times, t, side="right") - 1
        inside = k >= 0
        k = np.maximum(k, 0)
        return np.where(inside, integral[k] + level[k] * (t - times[k]), 0.0)

    span = np.maximum(hi - lo, 1e-12)
    return (at(hi) - at(lo)) / span


@dataclass(frozen=True)
class PrefillIterations:
    """Prefill spans merged per worker into the iterations that ran them: prompts prefilled together (a
    colocated engine batches waiting prompts into one iteration) share one span-long stall."""

    worker: np.ndarray  # object
    start_s: np.ndarray
    end_s: np.ndarray
    tokens: np.ndarray  # sum of the prompts' uncached tokens
    attention_tokens2: np.ndarray  # sum of their squares


def prefill_iterations(requests: RequestTable) -> PrefillIterations:
    rows: list[tuple[object, float, float, float, float]] = []
    has = (requests.prefill_end_ns > requests.prefill_start_ns) & ~requests.failed
    tokens_all = np.maximum(requests.input_tokens - requests.cached_tokens, 1).astype(float)
    for worker in set(requests.prefill_worker[has]):
        index = np.flatnonzero(has & (requests.prefill_worker == worker))
        index = index[np.argsort(requests.prefill_start_ns[index], kind="stable")]
        group: list[float] | None = None  # [start, end, tokens, attention] of the iteration being merged
        for i in index:
            s_i, e_i = float(requests.prefill_start_ns[i] / 1e9), float(requests.prefill_end_ns[i] / 1e9)
            if group is not None and s_i < group[1]:  # overlaps it: the same iteration
                group[1] = max(group[1], e_i)
            else:
                if group is not None:
                    rows.append((worker, group[0], group[1], group[2], group[3]))
                group = [s_i, e_i, 0.0, 0.0]
            group[2] += float(tokens_all[i])
            group[3] += float(tokens_all[i]) ** 2
        if group is not None:
            rows.append((worker, group[0], group[1], group[2], group[3]))
    return PrefillIterations(
        np.asarray([r[0] for r in rows], dtype=object),
        *(np.asarray([r[k] for r in rows], dtype=float) for k in range(1, 5)),
    )


def overlap(requests: RequestTable) -> Overlap:
    n = len(requests)
    iterations = np.maximum(requests.output_tokens - 1, 0).astype(float)
    batch, context, decode_only = (np.full(n, np.nan) for _ in range(3))
    stalls: list[np.ndarray] = [np.zeros(0)] * n
    decoding = (requests.decode_end_ns > requests.decode_start_ns) & (iterations > 0) & ~requests.failed
    prefills = prefill_iterations(requests)
    ds = requests.decode_start_ns / 1e9
    de = requests.decode_end_ns / 1e9
    for worker in set(requests.decode_worker[decoding]):
        on = np.flatnonzero(decoding & (requests.decode_worker == worker))
        weight = requests.input_tokens[on] + requests.output_tokens[on] / 2.0
        batch[on] = _time_average(ds[on], de[on], np.ones(len(on)), ds[on], de[on])
        context[on] = _time_average(ds[on], de[on], weight.astype(float), ds[on], de[on])
        here = prefills.worker == worker
        p_start, p_end = prefills.start_s[here], prefills.end_s[here]  # sorted by start
        for i in on:
            first = np.searchsorted(p_start, ds[i], side="left")
            last = np.searchsorted(p_start, de[i], side="left")
            inside = slice(first, last)
            durations = (p_end[inside] - p_start[inside])[p_end[inside] <= de[i] + 1e-9]
            stalls[i] = durations
            plain = iterations[i] - len(durations)
            if plain >= 1:
                decode_only[i] = max(0.0, (de[i] - ds[i]) - float(durations.sum())) / plain
    return Overlap(iterations, batch, context, decode_only, stalls)


def _stall_ratios(seen: Overlap, use: np.ndarray) -> list[float]:
    """Interference per request: a mixed iteration (a prefill's span it waited for) over its decode-only one."""
    return [
        float(np.mean(s)) / seen.decode_only_step_s[i]
        for i, s in enumerate(seen.stalls_s)
        if len(s) and use[i] and seen.decode_only_step_s[i] > 0
    ]


def fit_prefill_iterations(requests: RequestTable) -> PrefillFit | None:
    """prefill iteration s = a + b * tokens + c * attention over the merged prefill iterations (the prefill
    terms of the step model; `a` also holds the decode part of those iterations and is not used)."""
    prefills = prefill_iterations(requests)
    if len(prefills.start_s) < 3:
        return None
    features = np.column_stack([np.ones(len(prefills.start_s)), prefills.tokens, prefills.attention_tokens2])
    fit = fit_nonnegative(features, prefills.end_s - prefills.start_s)
    a, b, c = (float(x) for x in fit.coefficients)
    return PrefillFit(a, b, c, fit.r2, fit.samples)


def estimate_steps(
    requests: RequestTable, prefill: PrefillFit | None = None, shape: ModelShape | None = None
) -> StepFit | None:
    """The step model from request overlap (module docstring). None when too few requests decoded.
    `prefill` defaults to the fit over merged prefill iterations. With the model's `shape` (an accelerator's
    roofline), the decode-only iterations and the merged prefill iterations are fitted together pass by pass
    (`fit_passes`) instead."""
    if shape is not None:
        return _estimate_passes(requests, shape)
    prefill = prefill or fit_prefill_iterations(requests)
    if prefill is None:
        return None
    seen = overlap(requests)
    use = ~np.isnan(seen.decode_only_step_s)
    if use.sum() < 3:
        return None
    features = np.column_stack([np.ones(use.sum()), seen.mean_context_tokens[use], seen.mean_batch[use]])
    fit = fit_nonnegative(features, seen.decode_only_step_s[use])
    base, per_context, per_request = (float(x) for x in fit.coefficients)
    costs = StepCosts(base, per_context, per_request, prefill.b_s_per_token, prefill.c_s_per_token2)
    # Interference: a mixed iteration (a prefill's span) over the decode-only iteration of those waiting.
    ratios = _stall_ratios(seen, use)
    factor = float(np.median(ratios)) if ratios else None
    predicted = features @ fit.coefficients
    ok = (predicted > 0) & (seen.decode_only_step_s[use] > 0)
    ratios_log = np.log(seen.decode_only_step_s[use][ok] / predicted[ok])
    sigma = float(1.4826 * np.median(np.abs(ratios_log - np.median(ratios_log)))) if ok.sum() > 2 else 0.0
    return StepFit(
        costs,
        "estimated from request spans",
        fit.r2,
        fit.samples,
        factor,
        len(ratios),
        0,
        sigma,
        features,
        seen.decode_only_step_s[use],
        ("base_s", "context_s_per_token", "decode_s_per_request"),
        typical_miss=float(np.mean(np.abs(ratios_log))) if ok.sum() > 2 else None,
    )


def _estimate_passes(requests: RequestTable, shape: ModelShape) -> StepFit | None:
    """`fit_passes` over each request's decode-only iteration (its time-averaged batch and context) and
    the merged prefill iterations (their prompts' tokens and attention; the decodes that shared them are not
    known and count as none, so their part lands in the prefill floor)."""
    seen = overlap(requests)
    use = ~np.isnan(seen.decode_only_step_s)
    prefills = prefill_iterations(requests)
    if use.sum() < 3 or len(prefills.start_s) < 3:
        return None
    none = np.zeros(len(prefills.start_s))
    decode = np.concatenate([seen.mean_batch[use], none])
    context = np.concatenate([seen.mean_context_tokens[use], none])
    tokens = np.concatenate([np.zeros(use.sum()), prefills.tokens])
    attention = np.concatenate([np.zeros(use.sum()), prefills.attention_tokens2])
    step_s = np.concatenate([seen.decode_only_step_s[use], prefills.end_s - prefills.start_s])
    costs, fit, design = fit_passes(decode, context, tokens, attention, step_s, np.ones(len(step_s)), shape)
    largest = int(np.ceil(np.nanmax(seen.mean_batch[use])))
    costs = replace(costs, max_batch_seen=largest)
    predicted = design @ fit.coefficients
    ok = (predicted > 0) & (step_s > 0)
    logs = np.log(step_s[ok] / predicted[ok])
    ratios = _stall_ratios(seen, use)
    return StepFit(
        costs,
        "estimated from request spans",
        fit.r2,
        fit.samples,
        float(np.median(ratios)) if ratios else None,
        len(ratios),
        0,
        float(1.4826 * np.median(np.abs(logs - np.median(logs)))) if ok.sum() > 2 else 0.0,
        design,
        step_s,
        PASS_TERMS,
        max_batch_seen=largest,
        typical_miss=float(np.mean(np.abs(logs))) if ok.sum() > 2 else None,
    )


@dataclass(frozen=True)
class ChunkedOverlap:
    """Per request on a chunked-prefill worker (NaN where it did not decode): its decode window against the
    prefill windows on that worker. A prompt's chunks run in several steps, each with every running decode,
    so a prefill window is no single stall: the decodes inside it ran mixed steps, each slower by a chunk.

    decode_s = iterations x (its decode-only step) + the chunk work done during its window, where the chunk
    work of `prefill_tokens` tokens (each prefill's tokens in proportion to the share of its window inside
    the decode window; likewise its P^2 attention) costs `b * tokens + c * attention` (a prompt's chunks add
    up to its whole prefill). `under_prefill_s` is the part of the window under some prefill window."""

    iterations: np.ndarray
    mean_batch: np.ndarray
    mean_context_tokens: np.ndarray
    decode_s: np.ndarray
    under_prefill_s: np.ndarray
    prefill_tokens: np.ndarray
    attention_tokens2: np.ndarray


def _merged(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of intervals as disjoint sorted intervals."""
    order = np.argsort(starts, kind="stable")
    out_s: list[float] = []
    out_e: list[float] = []
    for s_i, e_i in zip(starts[order], ends[order]):
        if out_e and s_i <= out_e[-1]:
            out_e[-1] = max(out_e[-1], e_i)
        else:
            out_s.append(float(s_i))
            out_e.append(float(e_i))
    return np.asarray(out_s), np.asarray(out_e)


def chunked_overlap(requests: RequestTable) -> ChunkedOverlap:
    n = len(requests)
    iterations = np.maximum(requests.output_tokens - 1, 0).astype(float)
    batch, context, under, tokens, attention = (np.full(n, np.nan) for _ in range(5))
    decoding = (requests.decode_end_ns > requests.decode_start_ns) & (iterations > 0) & ~requests.failed
    prefilling = (requests.prefill_end_ns > requests.prefill_start_ns) & ~requests.failed
    ds, de = requests.decode_start_ns / 1e9, requests.decode_end_ns / 1e9
    ps, pe = requests.prefill_start_ns / 1e9, requests.prefill_end_ns / 1e9
    prompt = np.maximum(requests.input_tokens - requests.cached_tokens, 1).astype(float)
    for worker in set(requests.decode_worker[decoding]):
        on = np.flatnonzero(decoding & (requests.decode_worker == worker))
        span = de[on] - ds[on]
        weight = requests.input_tokens[on] + requests.output_tokens[on] / 2.0
        batch[on] = _time_average(ds[on], de[on], np.ones(len(on)), ds[on], de[on])
        context[on] = _time_average(ds[on], de[on], weight.astype(float), ds[on], de[on])
        here = np.flatnonzero(prefilling & (requests.prefill_worker == worker))
        if not len(here):
            under[on] = tokens[on] = attention[on] = 0.0
            continue
        union_s, union_e = _merged(ps[here], pe[here])
        under[on] = span * _time_average(union_s, union_e, np.ones(len(union_s)), ds[on], de[on])
        length = pe[here] - ps[here]
        tokens[on] = span * _time_average(ps[here], pe[here], prompt[here] / length, ds[on], de[on])
        attention[on] = span * _time_average(ps[here], pe[here], prompt[here] ** 2 / length, ds[on], de[on])
    decode_s = np.where(decoding, de - ds, np.nan)
    return ChunkedOverlap(iterations, batch, context, decode_s, under, tokens, attention)


_SPLIT_ROUNDS = 5  # a pass fit's mixed-step count settles in two or three


def _chunked_split(seen: ChunkedOverlap, costs: StepCosts) -> tuple[np.ndarray, np.ndarray]:
    """Per request: its decode-only step (s) and how many of its steps carried chunks (the steps of the
    time under prefill windows net of the chunk work, at that step length). With a pass fit's costs
    (`gemm_knee_tokens`) a mixed step's GEMMs replace the decode step's weights' read instead of adding to
    it, so each mixed step's work is less by base - per_token x batch: counted and priced in turn."""
    chunk_work = np.clip(
        costs.prefill_s_per_token * seen.prefill_tokens + costs.prefill_s_per_token2 * seen.attention_tokens2,
        0.0,
        seen.decode_s,
    )
    saved_per_mixed_s = costs.base_s - costs.prefill_s_per_token * seen.mean_batch if costs.gemm_knee_tokens else 0.0
    mixed = np.zeros(len(seen.decode_s))
    for _ in range(_SPLIT_ROUNDS if costs.gemm_knee_tokens else 1):
        work = np.clip(chunk_work - mixed * saved_per_mixed_s, 0.0, seen.decode_s)
        plain = (seen.decode_s - work) / np.maximum(seen.iterations, 1)
        with np.errstate(invalid="ignore", divide="ignore"):
            mixed = np.clip(np.round((seen.under_prefill_s - work) / plain), 0, seen.iterations)
        mixed = np.where((seen.under_prefill_s > 0) & (mixed < 1), 1, mixed)
    return plain, mixed


def estimate_chunked_steps(requests: RequestTable, shape: ModelShape | None = None) -> StepFit | None:
    """The step model of a chunked-prefill engine from request overlap (ChunkedOverlap): per request,
    decode_s / iterations = base + per_context * context + per_request * batch + (b * tokens + c * attention)
    / iterations, fitted over requests. None when too few requests decoded. With the model's `shape` (an
    accelerator's roofline) the KV read and the attention are tied to the weights' read and the GEMMs as in
    `fit_passes`: per_context = base x its KV-to-weights ratio, c = b x its attention-to-GEMM ratio."""
    seen = chunked_overlap(requests)
    use = ~np.isnan(seen.decode_s) & ~np.isnan(seen.prefill_tokens) & (seen.iterations > 0)
    if use.sum() < 5:
        return None
    per = seen.iterations[use]
    features = np.column_stack(
        [
            np.ones(use.sum()),
            seen.mean_context_tokens[use],
            seen.mean_batch[use],
            seen.prefill_tokens[use] / per,
            seen.attention_tokens2[use] / per,
        ]
    )
    target = seen.decode_s[use] / per
    if shape is None:
        fit = fit_nonnegative(features, target)
        costs = StepCosts(*(float(x) for x in fit.coefficients))
    else:
        kv, attention = shape.kv_read_per_weight_read, shape.attention_per_gemm_token
        tied = np.column_stack(
            [features[:, 0] + kv * features[:, 1], features[:, 2], features[:, 3] + attention * features[:, 4]]
        )
        fit = fit_nonnegative(tied, target)
        base, per_request, per_token = (float(x) for x in fit.coefficients)
        costs = StepCosts(base, base * kv, per_request, per_token, per_token * attention)
        fit = replace(fit, coefficients=np.array([base, base * kv, per_request, per_token, per_token * attention]))
        costs = _chunked_passes(seen, use, costs, shape)
    plain, mixed = _chunked_split(seen, costs)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratios = (seen.under_prefill_s / mixed) / plain
    ok = use & (mixed >= 1) & (plain > 0)
    predicted = features @ fit.coefficients
    good = (predicted > 0) & (target > 0)
    logs = np.log(target[good] / predicted[good])
    sigma = float(1.4826 * np.median(np.abs(logs - np.median(logs)))) if good.sum() > 2 else 0.0
    return StepFit(
        costs,
        "estimated from request spans",
        fit.r2,
        fit.samples,
        float(np.median(ratios[ok])) if ok.any() else None,
        int(ok.sum()),
        0,
        sigma,
        features,
        target,
        ("base_s", "context_s_per_token", "decode_s_per_request", "prefill_s_per_token", "prefill_s_per_token2"),
        typical_miss=float(np.mean(np.abs(logs))) if good.sum() > 2 else None,
    )


def _chunked_passes(seen: ChunkedOverlap, use: np.ndarray, tied: StepCosts, shape: ModelShape) -> StepCosts:
    """`fit_passes`' costs from a chunked engine's request overlap. Per request, `m` of its `n` steps carried
    a chunk (counted at the `tied` linear costs, `_chunked_split`), each past the GEMMs' knee (a budget of
    hundreds of tokens), so a mixed step of C chunk tokens beside B decodes costs per_token x (C + B) for its
    GEMMs where a decode-only step costs base, plus the chunk's attention:

        decode_s / n = base x (1 + kv x context - m / n) + per_token x (T + m x B + att x A) / n

    over its T chunk tokens and A attention, kv and att the model's ratios; the knee is base / per_token. No
    prefill floor: every mixed step of one budget runs about as many tokens, so a floor per mixed step and
    the GEMMs' per-token cost cannot be told apart; the floor goes into the per-token cost."""
    _, mixed = _chunked_split(seen, tied)
    n, m = seen.iterations[use], mixed[use]
    kv, att = shape.kv_read_per_weight_read, shape.attention_per_gemm_token
    design = np.column_stack(
        [
            1.0 + kv * seen.mean_context_tokens[use] - m / n,
            (seen.prefill_tokens[use] + m * seen.mean_batch[use] + att * seen.attention_tokens2[use]) / n,
        ]
    )
    fit = fit_nonnegative(design, seen.decode_s[use] / n)
    base, per_token = (float(x) for x in fit.coefficients)
    if per_token <= 0:
        return tied
    return StepCosts(base, base * kv, 0.0, per_token, per_token * att, gemm_knee_tokens=base / per_token)


def chunk_budget_tokens(requests: RequestTable, costs: StepCosts) -> int | None:
    """The engine's token budget per step, inferred: prefill tokens per mixed step plus the decodes that
    shared it, the median over requests whose decode saw at least two mixed steps. None without any."""
    seen = chunked_overlap(requests)
    _, mixed = _chunked_split(seen, costs)
    ok = ~np.isnan(seen.prefill_tokens) & (mixed >= 2)
    if not ok.any():
        return None
    return int(round(float(np.median(seen.prefill_tokens[ok] / mixed[ok] + seen.mean_batch[ok]))))


@dataclass(frozen=True)
class EstimatedGaps:
    p50_s: np.ndarray
    p99_s: np.ndarray
    max_s: np.ndarray
    mean_s: np.ndarray
    gaps_s: list[np.ndarray]  # per request, every estimated gap (empty where none was estimated)


def estimate_gaps(requests: RequestTable, chunked_costs: StepCosts | None = None) -> EstimatedGaps:
    """Per-request inter-token gaps where the spans lack them. Colocated (whole prefills): `iterations - k`
    decode-only iterations of the request's own measured length, and k stalls as long as the prefills that
    ran in its window. Chunked (`chunked_costs`, the chunked step estimate): the steps under prefill windows
    each as long as that time over their count, the others decode-only (`_chunked_split`)."""
    n = len(requests)
    p50, p99, biggest, mean = (np.full(n, np.nan) for _ in range(4))
    out = EstimatedGaps(p50, p99, biggest, mean, [np.zeros(0)] * n)
    if chunked_costs is not None:
        chunked = chunked_overlap(requests)
        plain, mixed = _chunked_split(chunked, chunked_costs)
        iterations, decode_s = chunked.iterations, chunked.decode_s
    else:
        seen = overlap(requests)
        iterations = seen.iterations
    for i in range(n):
        steps = int(iterations[i])
        if steps < 1 or requests.decode_end_ns[i] <= requests.decode_start_ns[i]:
            continue
        if chunked_costs is not None:
            gaps = _chunked_gaps(steps, int(mixed[i]), float(decode_s[i]), float(chunked.under_prefill_s[i]))
        else:
            gaps = _colocated_gaps(requests, seen, i, steps)
        out.gaps_s[i] = gaps
        out.p50_s[i] = float(np.median(gaps))
        out.p99_s[i] = float(np.percentile(gaps, 99))
        out.max_s[i] = float(gaps.max())
        out.mean_s[i] = float(gaps.mean())
    return out


def _colocated_gaps(requests: RequestTable, seen: Overlap, i: int, steps: int) -> np.ndarray:
    stalls = seen.stalls_s[i][:steps]
    plain = seen.decode_only_step_s[i]
    if np.isnan(plain):  # every iteration it ran carried a prefill: its mean gap is all we know
        plain = (requests.decode_end_ns[i] - requests.decode_start_ns[i]) / 1e9 / steps
    return np.concatenate([np.full(steps - len(stalls), plain), stalls])


def _chunked_gaps(steps: int, mixed: int, decode_s: float, under_s: float) -> np.ndarray:
    if mixed <= 0 or np.isnan(under_s):
        return np.full(steps, decode_s / steps)
    if mixed >= steps:
        return np.full(steps, decode_s / steps)
    rest = max(0.0, decode_s - under_s) / (steps - mixed)
    return np.concatenate([np.full(steps - mixed, rest), np.full(mixed, under_s / mixed)])


def _binomial_pmf(trials: int, p: float, up_to: int) -> np.ndarray:
    return np.array([math.comb(trials, k) * p**k * (1 - p) ** (trials - k) for k in range(up_to + 1)])


def _tolerated_over(gaps: int, stat: str) -> int:
    """How many gaps may exceed the SLO while the request's `stat` stays within it, when those gaps are far
    above it (numpy's linear p99 interpolates towards the next larger gap: that one must stay within too)."""
    if stat == "max":
        return 0
    rank = 0.99 * (gaps - 1)
    below = math.floor(rank)
    return max(0, gaps - 1 - below - (1 if rank > below else 0))


def itl_pass_probability(gaps_s: list[np.ndarray], itl_s: float, stat: str, measured_share_above: float) -> np.ndarray:
    """Per request, the probability that its `stat` (p99 or max) gap meets `itl_s`, with the count of
    gaps over the SLO taken from a measured histogram instead of the estimate (NaN where no gaps).

    The estimate says which requests' gaps could exceed (the stalls of overlapping prefills) and the
    measured share over the SLO says how many do. Measured fewer than estimated: each estimated stall
    over the SLO is real with probability measured / estimated. Measured more: every estimated one is,
    and each other gap exceeds with the probability that makes up the difference."""
    sizes = np.array([len(g) for g in gaps_s])
    over = np.array([int(np.sum(g > itl_s)) for g in gaps_s])
    out = np.full(len(gaps_s), np.nan)
    if not sizes.sum():
        return out
    estimated_share = over.sum() / sizes.sum()
    if estimated_share > 0 and measured_share_above <= estimated_share:
        keep, extra = measured_share_above / estimated_share, 0.0
    else:
        keep, extra = 1.0, max(0.0, measured_share_above - estimated_share) / max(1e-12, 1.0 - estimated_share)
    for i, (n, e) in enumerate(zip(sizes, over)):
        if not n:
            continue
        allowed = _tolerated_over(int(n), stat)
        real = _binomial_pmf(int(e), keep, allowed)  # estimated stalls that are real
        more = _binomial_pmf(int(n - e), extra, allowed)  # gaps the estimate saw under the SLO, over it
        out[i] = float(sum(real[a] * more[: allowed - a + 1].sum() for a in range(allowed + 1)))
    return out
