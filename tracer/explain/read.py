"""Trace files -> what `explain` reads: every request trace's spans, and per worker who ran what when.

Spans come from `tracer.otlp.iter_spans`, the generic reader, because explain needs the decode span's
`splitscope.decode.stall` events, which the report's fast reader (`tracer.report.read`) does not decode.
Step spans are checked and stored exactly as the report does it (`tracer.report.tables`), into the
report's `StepTable`. A trace file holds one process's view of many requests; a request's spans are
joined by trace id. Blocking file I/O.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tracer import spans as s
from tracer.engines import vllm
from tracer.otlp import SPAN_KIND_SERVER, ReadStats, Span, TraceFileError, iter_spans
from tracer.report.read import StepColumns
from tracer.report.tables import VLLM_REQUEST_SPAN, StepTable, TraceDataError, step_table, take_span

_STAGE_NAMES = frozenset((s.SPAN_QUEUE, s.SPAN_PREFILL, s.SPAN_KV_TRANSFER, s.SPAN_KV_RECV, s.SPAN_DECODE))


@dataclass
class Trace:
    """One request's spans (one trace id). Stage lists are in start order (`ExplainData` sorts them)."""

    trace_id: str
    root: Span | None = None
    stages: dict[str, list[Span]] = field(default_factory=dict)  # span name -> spans
    # Engines' request spans of this trace (vLLM behind a P/D proxy: one per instance of the pair)
    engine_requests: list[Span] = field(default_factory=list)

    def first(self, name: str) -> Span | None:
        spans = self.stages.get(name)
        return spans[0] if spans else None

    @property
    def request_id(self) -> str:
        if self.root is None:
            return ""
        attrs = self.root.attributes
        return str(attrs.get(s.ATTR_REQUEST_ID) or attrs.get(vllm.ATTR_REQUEST_ID) or "")

    @property
    def decode_side_first_token_ns(self) -> int | None:
        """A P/D pair of engine request spans (vLLM's): when the client's first token left, the later of
        the two instances' arrival + TTFT (the decode instance's: the prefill instance answers the
        proxy, not the client). None for one request span."""
        if len(self.engine_requests) < 2:
            return None
        firsts = []
        for span in self.engine_requests:
            value = span.attributes.get(vllm.ATTR_TTFT)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                firsts.append(span.start_ns + round(value * 1e9))
        return max(firsts) if firsts else None

    @property
    def ttft_s(self) -> float:
        """The request span's time to first token (ours or vLLM's; a vLLM P/D pair's: to the decode
        instance's first token), else the first token as the stage spans place it (prefill end plus an
        exposed transfer); NaN without either."""
        if self.root is None:
            return math.nan
        first_ns = self.decode_side_first_token_ns
        if first_ns is not None:
            return (first_ns - self.root.start_ns) / 1e9
        attrs = self.root.attributes
        value = attrs.get(s.ATTR_TTFT_S, attrs.get(vllm.ATTR_TTFT))
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        prefill = self.first(s.SPAN_PREFILL)
        if prefill is None:
            return math.nan
        first_token_ns = prefill.end_ns
        transfer = self.first(s.SPAN_KV_TRANSFER)
        if transfer is not None:
            first_token_ns = transfer.end_ns
        return (first_token_ns - self.root.start_ns) / 1e9

    @property
    def itl_p99_s(self) -> float:
        """The request's p99 inter-token gap: the router's figure, else its decode span's; NaN where none
        was measured (engines' request spans)."""
        for span, key in ((self.root, s.ATTR_ITL_P99_S), (self.first(s.SPAN_DECODE), s.ATTR_DECODE_ITL_P99_S)):
            value = span.attributes.get(key) if span is not None else None
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
        return math.nan


@dataclass
class WorkerSpan:
    """A stage span of some request on one worker, for "who else ran here then" questions."""

    trace_id: str
    start_ns: int
    end_ns: int
    tokens: int  # prefill: uncached prompt tokens; kv_transfer.recv: the request's prompt tokens; else 0


@dataclass
class ExplainData:
    traces: dict[str, Trace]
    steps: StepTable
    # worker -> span name -> that worker's spans of that name, by start
    by_worker: dict[str, dict[str, list[WorkerSpan]]]
    read: ReadStats

    def on_worker(self, worker: str, name: str) -> list[WorkerSpan]:
        return self.by_worker.get(worker, {}).get(name, [])

    def requests(self) -> list[Trace]:
        """Traces with a request span, by arrival."""
        rows = [t for t in self.traces.values() if t.root is not None]
        rows.sort(key=lambda t: t.root.start_ns)  # type: ignore[union-attr]
        return rows


def _is_request_span(span: Span) -> bool:
    if span.name.startswith(s.ROOT_SPAN_PREFIXES) and (span.kind == SPAN_KIND_SERVER or not span.parent_span_id):
        return True
    return span.name == VLLM_REQUEST_SPAN


def load(paths: Sequence[str | os.PathLike[str]], *, skip_bad: bool = False) -> ExplainData:
    """Read every span of `paths`. Raises TraceFileError (a bad record, a missing file) or TraceDataError (a
    step span without what the report needs), unless `skip_bad`, which skips and counts them."""
    traces: dict[str, Trace] = {}
    columns = StepColumns()
    total = ReadStats()
    for path in paths:
        stats = ReadStats()
        try:
            for span in iter_spans([path], skip_bad=skip_bad, stats=stats):
                try:
                    _take_span(span, traces, columns, f"{path}:{stats.record}")
                except TraceDataError:
                    if not skip_bad:
                        raise
        except FileNotFoundError:
            raise TraceFileError(str(path), 0, "no such file") from None
        total.lines += stats.lines
        total.spans += stats.spans
        total.skipped_lines += stats.skipped_lines
        total.first_error = total.first_error or stats.first_error
    for trace in traces.values():
        for spans in trace.stages.values():
            spans.sort(key=lambda span: span.start_ns)
    return ExplainData(traces, step_table(columns), _worker_index(traces), total)


def _take_span(span: Span, traces: dict[str, Trace], columns: StepColumns, where: str) -> None:
    if span.name == s.SPAN_STEP:
        # The report's own check and storage of a step span (it touches only the columns and the layout).
        take_span(span, {}, columns, {}, set(), where)
        return
    if _is_request_span(span):
        trace = traces.setdefault(span.trace_id, Trace(span.trace_id))
        if span.name == VLLM_REQUEST_SPAN:
            trace.engine_requests.append(span)
        # vLLM behind a P/D proxy writes one request span per instance: the earliest is the client's arrival.
        if trace.root is None or span.start_ns < trace.root.start_ns:
            trace.root = span
    elif span.name in _STAGE_NAMES:
        trace = traces.setdefault(span.trace_id, Trace(span.trace_id))
        trace.stages.setdefault(span.name, []).append(span)


def _tokens(span: Span, trace: Trace) -> int:
    if span.name == s.SPAN_PREFILL:
        prompt = _int(span.attributes.get(s.ATTR_PREFILL_TOKENS))
        return max(0, prompt - _int(span.attributes.get(s.ATTR_PREFILL_CACHED_TOKENS)))
    if span.name == s.SPAN_KV_RECV and trace.root is not None:
        attrs = trace.root.attributes
        return _int(attrs.get(s.ATTR_INPUT_TOKENS, attrs.get(vllm.ATTR_PROMPT_TOKENS)))
    return 0


def _int(value: Any) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def _worker_index(traces: dict[str, Trace]) -> dict[str, dict[str, list[WorkerSpan]]]:
    index: dict[str, dict[str, list[WorkerSpan]]] = {}
    for trace in traces.values():
        for name, spans in trace.stages.items():
            for span in spans:
                worker = span.attributes.get(s.ATTR_WORKER)
                if not isinstance(worker, str) or not worker:
                    continue  # a span that names no worker cannot be placed beside others
                entry = WorkerSpan(trace.trace_id, span.start_ns, span.end_ns, _tokens(span, trace))
                index.setdefault(worker, {}).setdefault(name, []).append(entry)
    for names in index.values():
        for entries in names.values():
            entries.sort(key=lambda entry: entry.start_ns)
    return index
