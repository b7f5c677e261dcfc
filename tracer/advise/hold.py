"""Hysteresis over per-window advice: the held advice changes only when a different one wins N windows in
a row (Dynamo's planner holds its scaling decision the same way). The first decided window sets it; a
window without a decision (None) neither counts for a challenger nor breaks its run.

An advice has a layout and may have a tuning inside it (the chunk budget of chunked prefill): `layout(key)`
names the layout. A run for another layout counts every window that advises that layout, whatever its
tuning, and the change takes the tuning of the window that completes the run: windows near a tie between
budgets (64 and 128 tokens within a few percent of goodput) would otherwise keep a clear layout change from
ever winning N in a row. A change of tuning alone, the layout held, needs N windows in a row at that tuning,
so the held target (the alert's label) moves only on a tuning that holds."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from tracer.vocabulary import AdviceReason

K = TypeVar("K", bound=Hashable)

# Why the held advice is what it is (JSON `advice.reason`).
INSUFFICIENT_DATA = "insufficient_data"  # no window decided
DECIDED = "decided"  # set by the first decided window; no window has disagreed since
HELD = "held"  # a window has disagreed since it was set or changed, without winning `hold` in a row
CHANGED = "changed"  # a different advice won `hold` windows in a row and took over


@dataclass(frozen=True)
class Held(Generic[K]):
    key: K | None  # None: nothing decided yet
    since_ns: int | None  # start of the first window of the run that set it
    reason: str
    changed_at: int | None = None  # index of the window where it last took over


def _same(key: K) -> Hashable:
    return key


def hold(votes: Sequence[tuple[K | None, int]], n: int, layout: Callable[[K], Hashable] = _same) -> Held[K]:
    """`votes`: per window in time order, (its advice, or None when it decided nothing; its start). `n`:
    windows in a row a different advice must win to replace the held one (n=1: follow every window).
    `layout`: the layout an advice names (default: the advice itself, no tuning)."""
    if n < 1:
        raise ValueError("--hold must be at least 1")
    held: Held[K] = Held(None, None, INSUFFICIENT_DATA)
    challenger: tuple[str, Hashable] | None = None
    run = 0
    run_start: int | None = None
    for index, (key, start_ns) in enumerate(votes):
        if key is None:
            continue
        if held.key is None:
            held = Held(key, start_ns, DECIDED, index)
            continue
        if key == held.key:
            challenger, run = None, 0
            continue
        same_layout = layout(key) == layout(held.key)
        # Another tuning of the held layout challenges as itself; another layout as that layout.
        contender = ("tuning", key) if same_layout else ("layout", layout(key))
        if contender != challenger:
            challenger, run, run_start = contender, 0, start_ns
        run += 1
        if run >= n:
            held = Held(key, run_start, CHANGED, index)
            challenger, run = None, 0
        else:
            held = Held(held.key, held.since_ns, HELD, held.changed_at)
    return held


def window_reason(before: Held[K], after: Held[K], key: K | None) -> AdviceReason:
    """What one window (its advice `key`, None when it decided nothing) did to the held advice: `before`
    and `after` are `hold` over the votes up to the window before it and up to it."""
    if key is None:
        return AdviceReason.INSUFFICIENT_DATA
    if before.key is None:
        return AdviceReason.FIRST
    if after.key != before.key:
        return AdviceReason.CHANGED
    return AdviceReason.AGREED if key == after.key else AdviceReason.HELD
