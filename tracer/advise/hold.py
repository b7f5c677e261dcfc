"""Hysteresis over per-window advice: the held advice changes only when a different one wins N windows in
a row (Dynamo's planner holds its scaling decision the same way). The first decided window sets it; a
window without a decision (None) neither counts for a challenger nor breaks its run."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
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


def hold(votes: Sequence[tuple[K | None, int]], n: int) -> Held[K]:
    """`votes`: per window in time order, (its advice, or None when it decided nothing; its start). `n`:
    windows in a row a different advice must win to replace the held one (n=1: follow every window)."""
    if n < 1:
        raise ValueError("--hold must be at least 1")
    held: Held[K] = Held(None, None, INSUFFICIENT_DATA)
    challenger: K | None = None
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
        if key != challenger:
            challenger, run, run_start = key, 0, start_ns
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
