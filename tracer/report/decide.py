"""Verdicts (DESIGN section 7) from simulated goodput: margins against the current layout, and hysteresis
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

VERDICTS = ("stay-colocated", "enable-chunked-prefill", "split", "rebalance", "merge", "insufficient-data")


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
    layouts = [Layout("colocated", workers=gpus)]
    layouts += [Layout("chunked", workers=gpus, chunk_budget_tokens=b) for b in chunk_budgets_tokens]
    layouts += [Layout("disaggregated", prefill_workers=p, decode_workers=gpus - p) for p in range(1, gpus)]
    return layouts


def _best(results: list[GoodputResult]) -> GoodputResult | None:
    return max(results, key=lambda r: r.goodput_per_gpu) if results else None


def _gain(winner: float, other: float) -> float:
    if other <= 0:
        return float("inf") if winner > 0 else 0.0
    return winner / other - 1.0


def decide(current: Layout, results: list[GoodputResult], margin: float) -> Decision:
    """The verdict for one window. `results` must include the current layout's own goodput."""
    by_label = {r.layout.label: r for r in results}
    now = by_label[current.label]
    singles = [r for r in results if r.layout.mode != "disaggregated"]
    splits = [r for r in results if r.layout.mode == "disaggregated" and r.layout.gpus == current.gpus] or [
        r for r in results if r.layout.mode == "disaggregated"
    ]
    colocated = next((r for r in singles if r.layout.mode == "colocated"), None)
    chunked = _best([r for r in singles if r.layout.mode == "chunked"])
    best_single, best_split = _best(singles), _best(splits)
    fmt = lambda r: f"{r.layout.label}: {r.goodput_per_gpu:.3g} req/s/GPU"  # noqa: E731
    if all(r.goodput_per_gpu == 0 for r in results):
        reasons = ["no simulated layout meets both SLOs at the attainment target, even at a trickle of requests"]
        return _keep(current, reasons)

    if current.mode != "disaggregated":
        assert best_single is not None
        if best_split is not None:
            gain = _gain(best_split.goodput_per_gpu, best_single.goodput_per_gpu)
            if gain >= margin:
                reasons = [f"{fmt(best_split)} beats the best single pool ({fmt(best_single)}) by {_pct(gain)} (margin {_pct(margin)})"]
                return Decision("split", best_split.layout, ratio=best_split.layout.ratio, changes_layout=True, reasons=reasons, win_margin=gain)
            split_note = _short_of("the best split", best_split, "the best single pool", best_single, gain, margin)
        else:
            split_note = "one GPU: no split possible"
        if chunked is not None and colocated is not None:
            gain = _gain(chunked.goodput_per_gpu, colocated.goodput_per_gpu)
            if current.mode == "colocated" and gain >= margin:
                reasons = [f"{fmt(chunked)} beats {fmt(colocated)} by {_pct(gain)} (margin {_pct(margin)})", split_note]
                return Decision("enable-chunked-prefill", chunked.layout, chunk_budget_tokens=chunked.layout.chunk_budget_tokens,
                                changes_layout=True, reasons=reasons, win_margin=gain)
            if current.mode == "chunked" and -gain < margin / (1 + margin):
                budget_changes = chunked.layout.chunk_budget_tokens != current.chunk_budget_tokens and _gain(
                    chunked.goodput_per_gpu, now.goodput_per_gpu) >= margin
                layout = chunked.layout if budget_changes else current
                reasons = [f"chunked prefill stays on ({fmt(by_label[layout.label])}; plain colocated {fmt(colocated)})", split_note]
                return Decision("enable-chunked-prefill", layout, chunk_budget_tokens=layout.chunk_budget_tokens,
                                changes_layout=budget_changes, reasons=reasons)
        reasons = [split_note]
        if chunked is not None and colocated is not None:
            reasons.append(_short_of("chunked prefill at its best budget", chunked, "plain colocated", colocated,
                                     _gain(chunked.goodput_per_gpu, colocated.goodput_per_gpu), margin))
        return Decision("stay-colocated", colocated.layout if colocated else current, changes_layout=current.mode != "colocated", reasons=reasons)

    assert best_split is not None and best_single is not None
    gain = _gain(best_single.goodput_per_gpu, best_split.goodput_per_gpu)
    if gain >= margin:
        budget = best_single.layout.chunk_budget_tokens or None
        reasons = [f"{fmt(best_single)} beats the best split ({fmt(best_split)}) by {_pct(gain)} (margin {_pct(margin)})"]
        return Decision("merge", best_single.layout, chunk_budget_tokens=budget, from_ratio=current.ratio, changes_layout=True,
                        reasons=reasons, win_margin=gain)
    gain_ratio = _gain(best_split.goodput_per_gpu, now.goodput_per_gpu)
    if best_split.layout.ratio != current.ratio and gain_ratio >= margin:
        reasons = [f"{fmt(best_split)} beats the deployed {fmt(now)} by {_pct(gain_ratio)} (margin {_pct(margin)})",
                   f"best single pool {fmt(best_single)}"]
        return Decision("rebalance", best_split.layout, ratio=best_split.layout.ratio, from_ratio=current.ratio, changes_layout=True,
                        reasons=reasons, win_margin=gain_ratio)
    reasons = [_short_of("the best ratio", best_split, "the deployed split", now, gain_ratio, margin),
               _short_of("the best single pool", best_single, "the best split", best_split, gain, margin)]
    return Decision("split", current, ratio=current.ratio, changes_layout=False, reasons=reasons)


def _keep(current: Layout, reasons: list[str]) -> Decision:
    if current.mode == "disaggregated":
        return Decision("split", current, ratio=current.ratio, reasons=reasons)
    if current.mode == "chunked":
        return Decision("enable-chunked-prefill", current, chunk_budget_tokens=current.chunk_budget_tokens, reasons=reasons)
    return Decision("stay-colocated", current, reasons=reasons)


def insufficient(missing: list[str]) -> Decision:
    return Decision("insufficient-data", None, reasons=missing)


def combine_windows(current: Layout, decisions: list[Decision]) -> Decision:
    """Hysteresis: change the layout only when a strict majority of the windows with data call for the same
    kind of change; the most common target (ratio or budget) among them is taken."""
    with_data = [d for d in decisions if d.verdict != "insufficient-data"]
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
            return Decision(chosen.verdict, chosen.recommended, chosen.ratio, chosen.from_ratio, chosen.chunk_budget_tokens,
                            True, reasons, chosen.win_margin)
    keep = _keep(current, [f"no change holds in a majority of {len(with_data)} windows ({summary}); keeping the current layout"])
    return keep


def _fmt(result: GoodputResult) -> str:
    return f"{result.layout.label}: {result.goodput_per_gpu:.3g} req/s/GPU"


def _short_of(challenger_role: str, challenger: GoodputResult, holder_role: str, holder: GoodputResult, gain: float,
              margin: float) -> str:
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
