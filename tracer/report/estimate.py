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

from dataclasses import dataclass

import numpy as np

from tracer.report.fit import PrefillFit, StepFit, fit_nonnegative
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


def estimate_steps(requests: RequestTable, prefill: PrefillFit | None = None) -> StepFit | None:
    """The step model from request overlap (module docstring). None when too few requests decoded.
    `prefill` defaults to the fit over merged prefill iterations."""
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
    ratios = [
        float(np.mean(s)) / seen.decode_only_step_s[i]
        for i, s in enumerate(seen.stalls_s)
        if len(s) and use[i] and seen.decode_only_step_s[i] > 0
    ]
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
    )


@dataclass(frozen=True)
class EstimatedGaps:
    p50_s: np.ndarray
    p99_s: np.ndarray
    max_s: np.ndarray
    mean_s: np.ndarray


def estimate_gaps(requests: RequestTable) -> EstimatedGaps:
    """Per-request inter-token gaps where the spans lack them: `iterations - k` decode-only iterations of
    the request's own measured length, and k stalls as long as the prefills that ran in its window."""
    seen = overlap(requests)
    n = len(requests)
    out = EstimatedGaps(*(np.full(n, np.nan) for _ in range(4)))
    for i in range(n):
        steps = int(seen.iterations[i])
        if steps < 1 or requests.decode_end_ns[i] <= requests.decode_start_ns[i]:
            continue
        stalls = seen.stalls_s[i][:steps]
        plain = seen.decode_only_step_s[i]
        if np.isnan(plain):  # every iteration it ran carried a prefill: its mean gap is all we know
            plain = (requests.decode_end_ns[i] - requests.decode_start_ns[i]) / 1e9 / steps
        gaps = np.concatenate([np.full(steps - len(stalls), plain), stalls])
        out.p50_s[i] = float(np.median(gaps))
        out.p99_s[i] = float(np.percentile(gaps, 99))
        out.max_s[i] = float(gaps.max())
        out.mean_s[i] = float(gaps.mean())
    return out
