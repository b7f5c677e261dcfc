"""Verdicts (architecture.md §7) from simulated goodput: margins against the current layout, and hysteresis
over time windows. Pure computation.

A change of layout needs a clear win: a split must beat the best single-pool option (colocated or
chunked) by `margin`; chunked prefill must beat plain colocated by `margin`; a merge must beat the best
split by `margin`; a rebalance must beat the current ratio by `margin`. Otherwise the current layout stays
(`stay-colocated`, or `split` at the ratio already deployed). Over several windows, a change is made only
when a majority of the windows with enough data call for it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from tracer.report.goodput import GoodputResult
from tracer.report.simulate import Layout
from tracer.vocabulary import Mode, Verdict


@dataclass(frozen=True)
class Decision:
    verdict: str
    recommended: Layout | None
    ratio: str | None = None  # prefill:decode for split / rebalance
    from_ratio: str | None = None  # rebalance: the ratio deployed now
    chunk_budget_tokens: int | None = None
    changes_layout: bool = False
    reasons: list[str] = field(default_factory=list)
    win_margin: float | None = None  # the winner's goodput over the option it had to beat, minus one

    @property
    def key(self) -> tuple:
        return (self.verdict, self.ratio, self.chunk_budget_tokens)


def candidate_layouts(gpus: int, chunk_budgets_tokens: tuple[int, ...]) -> list[Layout]:
    """Colocated, chunked at each budget, and every P:D split of `gpus`."""
    layouts = [Layout(Mode.COLOCATED, workers=gpus)]
    layouts += [Layout(Mode.CHUNKED, workers=gpus, chunk_budget_tokens=b) for b in chunk_budgets_tokens]
    layouts += [Layout(Mode.DISAGGREGATED, prefill_workers=p, decode_workers=gpus - p) for p in range(1, gpus)]
    return layouts


def _best(results: list[GoodputResult]) -> GoodputResult | None:
    return max(results, key=lambda r: r.goodput_per_gpu) if results else None


def _gain(winner: float, other: float) -> float:
    if other <= 0:
        return float("inf") if winner > 0 else 0.0
    return winner / other - 1.0


def decide(current: Layout, results: list[GoodputResult], margin: float, merge_margin: float | None = None) -> Decision:
    """The verdict for one window. `results` must include the current layout's own goodput. `merge_margin`:
    what a merge must clear instead of `margin` (more when its steps were never traced: build.py)."""
    if all(r.goodput_per_gpu == 0 for r in results):
        reasons = ["no simulated layout meets both SLOs at the attainment target, even at a trickle of requests"]
        return _keep(current, reasons)
    options = _Options.of(current, results)
    if current.mode == Mode.DISAGGREGATED:
        return _from_split(current, options, margin, margin if merge_margin is None else merge_margin)
    return _from_single_pool(current, options, margin)


@dataclass(frozen=True)
class _Options:
    """The simulated options a decision weighs against the current layout's own result (`now`)."""

    now: GoodputResult
    colocated: GoodputResult | None
    chunked: GoodputResult | None  # the best chunk budget
    best_single: GoodputResult | None  # colocated or chunked, whichever serves more
    best_split: GoodputResult | None  # among the splits of the current GPU count (any, if none has it)
    by_label: dict[str, GoodputResult]

    @classmethod
    def of(cls, current: Layout, results: list[GoodputResult]) -> _Options:
        by_label = {r.layout.label: r for r in results}
        singles = [r for r in results if r.layout.mode != Mode.DISAGGREGATED]
        splits = [r for r in results if r.layout.mode == Mode.DISAGGREGATED and r.layout.gpus == current.gpus] or [
            r for r in results if r.layout.mode == Mode.DISAGGREGATED
        ]
        return cls(
            by_label[current.label],
            next((r for r in singles if r.layout.mode == Mode.COLOCATED), None),
            _best([r for r in singles if r.layout.mode == Mode.CHUNKED]),
            _best(singles),
            _best(splits),
            by_label,
        )


def _fmt(result: GoodputResult) -> str:
    return f"{result.layout.label}: {result.goodput_per_gpu:.3g} req/s/GPU"


def _from_single_pool(current: Layout, o: _Options, margin: float) -> Decision:
    """Deployed colocated or chunked: split, turn chunked prefill on (or keep it), or stay colocated."""
    assert o.best_single is not None
    if o.best_split is not None:
        gain = _gain(o.best_split.goodput_per_gpu, o.best_single.goodput_per_gpu)
        if gain >= margin:
            reasons = [
                f"{_fmt(o.best_split)} beats the best single pool ({_fmt(o.best_single)}) by {_pct(gain)} (margin {_pct(margin)})"
            ]
            return Decision(
                Verdict.SPLIT,
                o.best_split.layout,
                ratio=o.best_split.layout.ratio,
                changes_layout=True,
                reasons=reasons,
                win_margin=gain,
            )
        split_note = _short_of("the best split", o.best_split, "the best single pool", o.best_single, gain, margin)
    else:
        split_note = "one GPU: no split possible"
    chunked, colocated = o.chunked, o.colocated
    if chunked is not None and colocated is not None:
        gain = _gain(chunked.goodput_per_gpu, colocated.goodput_per_gpu)
        if current.mode == Mode.COLOCATED and gain >= margin:
            reasons = [f"{_fmt(chunked)} beats {_fmt(colocated)} by {_pct(gain)} (margin {_pct(margin)})", split_note]
            return Decision(
                Verdict.ENABLE_CHUNKED_PREFILL,
                chunked.layout,
                chunk_budget_tokens=chunked.layout.chunk_budget_tokens,
                changes_layout=True,
                reasons=reasons,
                win_margin=gain,
            )
        # Deployed chunked: it stays on unless plain colocated beats it by the margin (the same rule as
        # turning it on, from the other side); its budget changes only for a margin's gain over the deployed one.
        if current.mode == Mode.CHUNKED and _gain(colocated.goodput_per_gpu, chunked.goodput_per_gpu) < margin:
            budget_changes = (
                chunked.layout.chunk_budget_tokens != current.chunk_budget_tokens
                and _gain(chunked.goodput_per_gpu, o.now.goodput_per_gpu) >= margin
            )
            layout = chunked.layout if budget_changes else current
            reasons = [
                f"chunked prefill stays on ({_fmt(o.by_label[layout.label])}; plain colocated {_fmt(colocated)})",
                split_note,
            ]
            return Decision(
                Verdict.ENABLE_CHUNKED_PREFILL,
                layout,
                chunk_budget_tokens=layout.chunk_budget_tokens,
                changes_layout=budget_changes,
                reasons=reasons,
            )
    reasons = [split_note]
    if chunked is not None and colocated is not None:
        reasons.append(
            _short_of(
                "chunked prefill at its best budget",
                chunked,
                "plain colocated",
                colocated,
                _gain(chunked.goodput_per_gpu, colocated.goodput_per_gpu),
                margin,
            )
        )
    return Decision(
        Verdict.STAY_COLOCATED,
        colocated.layout if colocated else current,
        changes_layout=current.mode != Mode.COLOCATED,
        reasons=reasons,
    )


def _from_split(current: Layout, o: _Options, margin: float, merge_margin: float) -> Decision:
    """Deployed as a split: merge back (by `merge_margin`), rebalance to a better ratio, or keep the split."""
    best_split, best_single, now = o.best_split, o.best_single, o.now
    assert best_split is not None and best_single is not None
    gain = _gain(best_single.goodput_per_gpu, best_split.goodput_per_gpu)
    if gain >= merge_margin:
        budget = best_single.layout.chunk_budget_tokens or None
        reasons = [
            f"{_fmt(best_single)} beats the best split ({_fmt(best_split)}) by {_pct(gain)} (margin {_pct(merge_margin)})"
        ]
        return Decision(
            Verdict.MERGE,
            best_single.layout,
            chunk_budget_tokens=budget,
            from_ratio=current.ratio,
            changes_layout=True,
            reasons=reasons,
            win_margin=gain,
        )
    gain_ratio = _gain(best_split.goodput_per_gpu, now.goodput_per_gpu)
    if best_split.layout.ratio != current.ratio and gain_ratio >= margin:
        reasons = [
            f"{_fmt(best_split)} beats the deployed {_fmt(now)} by {_pct(gain_ratio)} (margin {_pct(margin)})",
            f"best single pool {_fmt(best_single)}",
        ]
        return Decision(
            Verdict.REBALANCE,
            best_split.layout,
            ratio=best_split.layout.ratio,
            from_ratio=current.ratio,
            changes_layout=True,
            reasons=reasons,
            win_margin=gain_ratio,
        )
    reasons = [
        _short_of("the best ratio", best_split, "the deployed split", now, gain_ratio, margin),
        _short_of("the best single pool", best_single, "the best split", best_split, gain, merge_margin),
    ]
    return Decision(Verdict.SPLIT, current, ratio=current.ratio, changes_layout=False, reasons=reasons)


def _keep(current: Layout, reasons: list[str]) -> Decision:
    if current.mode == Mode.DISAGGREGATED:
        return Decision(Verdict.SPLIT, current, ratio=current.ratio, reasons=reasons)
    if current.mode == Mode.CHUNKED:
        return Decision(
            Verdict.ENABLE_CHUNKED_PREFILL, current, chunk_budget_tokens=current.chunk_budget_tokens, reasons=reasons
        )
    return Decision(Verdict.STAY_COLOCATED, current, reasons=reasons)


def insufficient(missing: list[str]) -> Decision:
    return Decision(Verdict.INSUFFICIENT_DATA, None, reasons=missing)


def combine_windows(current: Layout, decisions: list[Decision]) -> Decision:
    """Hysteresis: change the layout only when a strict majority of the windows with data call for the same
    kind of change; the most common target (ratio or budget) among them is taken."""
    with_data = [d for d in decisions if d.verdict != Verdict.INSUFFICIENT_DATA]
    if not with_data:
        return insufficient(sorted({reason for d in decisions for reason in d.reasons}))
    if len(with_data) == 1:
        return with_data[0]
    changes = Counter(d.verdict for d in with_data if d.changes_layout)
    summary = ", ".join(f"{v} x{c}" for v, c in Counter(d.verdict for d in with_data).items())
    if changes:
        verdict, count = changes.most_common(1)[0]
        if count * 2 > len(with_data):
            agreeing = [d for d in with_data if d.verdict == verdict and d.changes_layout]
            key, _ = Counter(d.key for d in agreeing).most_common(1)[0]
            chosen = next(d for d in agreeing if d.key == key)
            reasons = [f"{count} of {len(with_data)} windows call for {verdict} ({summary})"] + chosen.reasons
            return Decision(
                chosen.verdict,
                chosen.recommended,
                chosen.ratio,
                chosen.from_ratio,
                chosen.chunk_budget_tokens,
                True,
                reasons,
                chosen.win_margin,
            )
    keep = _keep(
        current, [f"no change holds in a majority of {len(with_data)} windows ({summary}); keeping the current layout"]
    )
    return keep


def _short_of(
    challenger_role: str, challenger: GoodputResult, holder_role: str, holder: GoodputResult, gain: float, margin: float
) -> str:
    """Why a challenger does not replace a holder, in words that match the sign of its gain."""
    first, second = f"{challenger_role} ({_fmt(challenger)})", f"{holder_role} ({_fmt(holder)})"
    if gain < 0:
        return f"{first} is {_share(-gain)} below {second}"
    if gain == 0:
        return f"{first} only ties {second}"
    return f"{first} beats {second} by only {_share(gain)}, under the {_share(margin)} margin"


def _share(value: float) -> str:
    return "inf" if value == float("inf") else f"{value * 100:.0f}%"


def _pct(value: float) -> str:
    return "inf" if value == float("inf") else f"{value * 100:+.0f}%"
