"""`advise --follow`: tail growing trace files (and/or take OTLP/HTTP exports, otlp_in.py) and decide each
window as it closes.

Windows are those of the offline advisor (windows.py): consecutive, `window_s` wide, by request arrival,
from the earliest request seen; that start is fixed when the first window closes.

**The close rule.** Spans are written when they end, so the advisor's clock is the *watermark*: the
latest span end it has read, over all files and exports received. Window [start, end) closes when the watermark reaches
`end + grace_s`: by then every span that ended before `end + grace_s` has been read, and `grace_s` is the
allowance for requests still running past the window's end and for exporters' batching (a request that
arrived in the window but ends after `end + grace_s` is missed by it; it still counts for the windows that
carry fits). A request span read after its window closed is kept for later windows but does not re-decide a
closed one. With no spans at all (idle traffic) the watermark stands still and no window closes; the last
advice is served as it is. Reading a finished file decides every window whose end + grace it reaches.

Each closed window is decided as the offline advisor decides it (build.decide_window, on the spans held,
which are pruned to the last `retain_windows` windows: a thin window carries fits back at most that far)
and held with the same hysteresis (hold.py). With `namespace` set, spans whose resource names another
`service.namespace` are skipped (a file several deployments share); spans that name none are kept.
Blocking; one thread (the CLI's loop) reads, decides and drains the OTLP inbox; CPU: one report without its
bootstrap per window, plus reading.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from tracer.advise import hold as hysteresis
from tracer.advise.accumulate import SpanTables
from tracer.advise.build import Advice, AdviceKey, AdviseResult, WindowAdvice, decide_window, held_advice, hold_advice
from tracer.advise.deployed import Shape, deployed_shape
from tracer.advise.otlp_in import OtlpInbox
from tracer.advise.tail import FileTail
from tracer.advise.windows import Window, cut
from tracer.otlp import (
    ReadStats,
    Span,
    TraceFileError,
    TraceFormat,
    describe_error,
    record_error,
    spans_from_record,
)
from tracer.report.build import ReportOptions
from tracer.report.tables import TraceData
from tracer.vocabulary import RESOURCE_SERVICE_NAMESPACE, AdviceReason, Verdict

DEFAULT_RETAIN_WINDOWS = 12
OTLP_SOURCE = "OTLP/HTTP"  # where spans received by --otlp-port come from, in error messages


@dataclass(frozen=True)
class ClosedWindow:
    """What one closed window decided and what it did to the held advice."""

    window: WindowAdvice
    held: Advice  # after this window
    reason: AdviceReason
    deployed: Shape | None  # the layout the window's traces show
    namespace: str


class Follower:
    """Tails `paths` and decides windows as they close (the module's rule). `poll()` reads what was appended
    and returns the windows it closed; `run(stop)` polls every `poll_interval_s` until `stop` is set."""

    def __init__(
        self,
        paths: Sequence[str],
        options: ReportOptions,
        window_s: float,
        hold_windows: int,
        grace_s: float,
        *,
        namespace: str | None = None,
        retain_windows: int = DEFAULT_RETAIN_WINDOWS,
        inbox: OtlpInbox | None = None,
    ) -> None:
        if window_s <= 0:
            raise ValueError("the window must be a positive duration")
        if hold_windows < 1:
            raise ValueError("--hold must be at least 1")
        if grace_s < 0:
            raise ValueError("--grace must not be negative")
        self.paths = [str(p) for p in paths]
        self.options = replace(options, window_s=None)
        self.window_ns = max(int(window_s * 1e9), 1)
        self.grace_ns = int(grace_s * 1e9)
        self.hold_windows = hold_windows
        self.retain_windows = max(retain_windows, hold_windows, 1)
        self.namespace = namespace
        self.tails = [FileTail(p) for p in self.paths]
        self.inbox = inbox
        self.tables = SpanTables(self.window_ns, skip_bad=options.skip_bad)
        self.stats = ReadStats()
        self.skipped_other_namespace = 0
        self.start_ns: int | None = None  # fixed when the first window closes
        self.decided: list[WindowAdvice] = []
        self._votes: list[tuple[AdviceKey | None, int]] = []
        self._held: hysteresis.Held[AdviceKey] = hysteresis.Held(None, None, hysteresis.INSUFFICIENT_DATA)

    def poll(self) -> list[ClosedWindow]:
        """Read every file's new records, then decide each window that closed. Raises TraceFileError /
        TraceDataError on bad input unless the options skip bad records."""
        for tail in self.tails:
            for record in tail.poll():
                self.take_record(tail.path, record.trace_format, record.number, record.data)
        if self.inbox is not None:
            for spans in self.inbox.drain():
                self.stats.lines += 1
                self.take_spans(OTLP_SOURCE, spans)
        closed = []
        while (window := self._next_closed()) is not None:
            closed.append(self._decide(window))
        return closed

    def run(self, stop: threading.Event, poll_interval_s: float, on_window: Callable[[ClosedWindow], None]) -> None:
        while not stop.is_set():
            for window in self.poll():
                on_window(window)
            stop.wait(poll_interval_s)

    def close(self) -> None:
        for tail in self.tails:
            tail.close()
        if self.inbox is not None:
            self.inbox.close()

    @property
    def advice(self) -> Advice:
        return held_advice(self.decided, self.hold_windows) if self.decided else _NO_ADVICE

    def take_record(self, path: str, trace_format: TraceFormat, number: int, data: bytes) -> None:
        """One record of `path`: its spans into the tables (those of other namespaces skipped)."""
        self.stats.lines += 1
        try:
            spans = spans_from_record(trace_format, data)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            record_error(TraceFileError(path, number, describe_error(exc)), self.options.skip_bad, self.stats)
            return
        self.take_spans(f"{path}:{number}", spans)

    def take_spans(self, where: str, spans: list[Span]) -> None:
        """Spans read from `where` (a file's record, or OTLP) into the tables, other namespaces' skipped."""
        self.stats.spans += len(spans)
        for span in spans:
            if self.namespace and span.resource.get(RESOURCE_SERVICE_NAMESPACE, self.namespace) != self.namespace:
                self.skipped_other_namespace += 1  # another deployment's span in a shared file
                continue
            self.tables.take(span, where)

    def _next_closed(self) -> Window | None:
        start = self.start_ns if self.start_ns is not None else self.tables.first_arrival_ns
        if start is None:
            return None
        index = len(self.decided)
        end = start + (index + 1) * self.window_ns
        if self.tables.watermark_ns < end + self.grace_ns:
            return None
        self.start_ns = start
        return Window(end - self.window_ns, end)

    def _decide(self, window: Window) -> ClosedWindow:
        index = len(self.decided)
        first = max(0, index - self.retain_windows + 1)
        assert self.start_ns is not None
        windows = [
            Window(self.start_ns + i * self.window_ns, self.start_ns + (i + 1) * self.window_ns)
            for i in range(first, index + 1)
        ]
        self.tables.read = self.stats
        data = self.tables.data(self.paths)
        decision = decide_window(data, windows, len(windows) - 1, self.options)
        self.decided.append(decision)
        before = self._held
        self._votes.append((decision.key, decision.start_unix_ns))
        self._held = hold_advice(self._votes, self.hold_windows)
        reason = hysteresis.window_reason(before, self._held, decision.key)
        deployed = deployed_shape(cut(data, window.start_ns, window.end_ns))
        self.tables.prune(windows[0].start_ns if len(windows) == self.retain_windows else 0)
        namespace = self.namespace or self.tables.namespace or ""
        return ClosedWindow(decision, self.advice, reason, deployed, namespace)


_NO_ADVICE = Advice(Verdict.INSUFFICIENT_DATA, None, None, None, hysteresis.INSUFFICIENT_DATA)


def replay(result: AdviseResult, data: TraceData, namespace: str) -> list[ClosedWindow]:
    """The offline advisor's windows as `Follower` would have closed them (for --metrics-port without
    --follow): each with its held advice, its reason and the layout its traces show."""
    closed = []
    before: hysteresis.Held[AdviceKey] = hysteresis.Held(None, None, hysteresis.INSUFFICIENT_DATA)
    for i, window in enumerate(result.windows):
        after = hold_advice([(w.key, w.start_unix_ns) for w in result.windows[: i + 1]], result.hold)
        reason = hysteresis.window_reason(before, after, window.key)
        deployed = deployed_shape(cut(data, window.start_unix_ns, window.end_unix_ns))
        closed.append(ClosedWindow(window, result.held_after[i], reason, deployed, namespace))
        before = after
    return closed
