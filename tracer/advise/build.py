"""`advise(data, options, window_s, hold_windows)`: decide every window with the report's model, then hold.

Each window is `tracer.report.build.report_from_data` on the traces cut to it (windows.py), as one window
(the report's own --window is off). A window with fewer requests than the report needs
(ReportOptions.min_requests) is decided on itself merged with the windows before it, as few as reach that
count, and says so (`carried_fits`): the fits and the workload then carry over from the earlier traffic.
Blocking, CPU only; a window costs one report without its bootstrap unless `confidence_resamples` is set.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace

from tracer.advise import hold as hysteresis
from tracer.advise.windows import Window, count, cut, split
from tracer.report.build import ReportOptions, report_from_data
from tracer.report.tables import TraceData, TraceDataError, load_traces
from tracer.vocabulary import Verdict

# Why a window's verdict is what it is (JSON `windows[].reason`).
DECIDED = "decided"  # on the window's own requests
CARRIED_FITS = "carried_fits"  # too few requests: decided on it merged with the windows before it
INSUFFICIENT_DATA = "insufficient_data"  # no verdict: too few requests even merged, or the report refused

AdviceKey = tuple[str, str | None, int | None]  # verdict, ratio, chunk budget


def advice_layout(key: AdviceKey) -> tuple[str, str | None]:
    """The layout an advice names (verdict and ratio); the chunk budget is its tuning (hold.py)."""
    return key[0], key[1]


def hold_advice(votes: Sequence[tuple[AdviceKey | None, int]], hold_windows: int) -> hysteresis.Held[AdviceKey]:
    """`hold.hold` over advice keys, with the chunk budget as a tuning of its layout."""
    return hysteresis.hold(votes, hold_windows, layout=advice_layout)


@dataclass(frozen=True)
class WindowAdvice:
    start_unix_ns: int
    end_unix_ns: int
    requests: int  # arriving in this window (a carried decision saw more)
    verdict: str
    ratio: str | None
    chunk_budget_tokens: int | None
    gain: float | None  # the winner's goodput over the option it had to beat, minus one (the report's margin)
    confidence: float | None  # None: bootstrap skipped
    reason: str
    decided_from_unix_ns: int  # start of the traffic it was decided on (earlier than start when carried)
    evidence: tuple[str, ...] = ()  # the report's reasons when it decided nothing

    @property
    def key(self) -> AdviceKey | None:
        if self.verdict == Verdict.INSUFFICIENT_DATA:
            return None
        return (self.verdict, self.ratio, self.chunk_budget_tokens)


@dataclass(frozen=True)
class Advice:
    verdict: str
    ratio: str | None
    chunk_budget_tokens: int | None
    since_unix_ns: int | None  # start of the first window of the run that set it
    reason: str  # hold.py: insufficient_data, decided, held, changed


@dataclass(frozen=True)
class AdviseResult:
    windows: list[WindowAdvice]
    advice: Advice
    held_after: list[Advice]  # the held advice after each window (for the Markdown table)
    window_s: float
    hold: int
    confidence_resamples: int


def advise_files(
    paths: Sequence[str | os.PathLike[str]], options: ReportOptions, window_s: float, hold_windows: int
) -> AdviseResult:
    """Read `paths` once and advise. Raises TraceFileError / TraceDataError on bad input unless skip_bad."""
    if not paths:
        raise TraceDataError("no trace files given")
    return advise(load_traces(paths, skip_bad=options.skip_bad), options, window_s, hold_windows)


def advise(data: TraceData, options: ReportOptions, window_s: float, hold_windows: int) -> AdviseResult:
    if hold_windows < 1:
        raise ValueError("--hold must be at least 1")
    windows = split(data, window_s)
    if not windows:
        raise TraceDataError("no requests in the traces (no root `text_completion` span)")
    one_window = replace(options, window_s=None)
    decided = [decide_window(data, windows, i, one_window) for i in range(len(windows))]
    trail = [held_advice(decided[: i + 1], hold_windows) for i in range(len(decided))]
    return AdviseResult(decided, trail[-1], trail, window_s, hold_windows, options.confidence_resamples)


def decide_window(data: TraceData, windows: list[Window], index: int, options: ReportOptions) -> WindowAdvice:
    """Window `index` of `windows` (consecutive, in time order) decided on `data` (its own requests, or
    merged with the windows before it when too few). `options` as `advise` passes them (window_s None)."""
    window = windows[index]
    own = count(data, window.start_ns, window.end_ns)
    first = index
    while first > 0 and count(data, windows[first].start_ns, window.end_ns) < options.min_requests:
        first -= 1
    start = windows[first].start_ns
    if count(data, start, window.end_ns) < options.min_requests:
        reasons = (f"{count(data, start, window.end_ns)} requests up to this window (need {options.min_requests})",)
        return WindowAdvice(
            window.start_ns, window.end_ns, own, Verdict.INSUFFICIENT_DATA, None, None, None, None,
            INSUFFICIENT_DATA, start, reasons,
        )  # fmt: skip
    report = report_from_data(cut(data, start, window.end_ns), options)
    if report.verdict == Verdict.INSUFFICIENT_DATA:
        reason, evidence = INSUFFICIENT_DATA, tuple(report.evidence[-3:])
    else:
        reason, evidence = (CARRIED_FITS if first < index else DECIDED), ()
    return WindowAdvice(
        window.start_ns,
        window.end_ns,
        own,
        str(report.verdict),
        report.ratio,
        report.chunk_budget_tokens,
        report.win_margin,
        report.confidence,
        reason,
        start,
        evidence,
    )


def held_advice(windows: Sequence[WindowAdvice], hold_windows: int) -> Advice:
    """The held advice after `windows` (in time order), `hold.hold` over their keys."""
    held = hold_advice([(w.key, w.start_unix_ns) for w in windows], hold_windows)
    if held.key is None:
        return Advice(Verdict.INSUFFICIENT_DATA, None, None, None, held.reason)
    verdict, ratio, budget = held.key
    return Advice(verdict, ratio, budget, held.since_ns, held.reason)
