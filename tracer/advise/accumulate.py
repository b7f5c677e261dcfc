"""The report's tables built up span by span (what `--follow` reads), pruned to a retention horizon.

`tracer.report.tables.load_traces` reads whole files into `TraceData`; `SpanTables` takes the same spans
one at a time (through the same interpretation, `tables.take_span`), so a live advisor decides on exactly what
the offline one would, and `data()` builds a `TraceData` of what it holds whenever a window closes.
`prune(cutoff_ns)` forgets requests that arrived and steps that started before the cutoff, and the workers
seen only before it, so memory and each window's cost stay bounded however long it runs; the layout in
`data().workers` is then the one of the retained traffic (a redeploy shows once the old workers age out).

Not thread-safe; CPU only.
"""

from __future__ import annotations

import numpy as np

from tracer.otlp import ReadStats, Span
from tracer.report.read import StepColumns
from tracer.report.tables import (
    RequestSpans,
    TraceData,
    TraceDataError,
    request_table,
    step_table,
    take_span,
    transfer_table,
)
from tracer.vocabulary import RESOURCE_SERVICE_NAMESPACE


class SpanTables:
    """Spans taken so far, as `load_traces` would hold them. `bucket_ns`: the granularity at which the
    workers seen are remembered for pruning (the advisor's window)."""

    def __init__(self, bucket_ns: int, *, skip_bad: bool = False) -> None:
        self.bucket_ns = max(int(bucket_ns), 1)
        self.skip_bad = skip_bad
        self.requests: dict[str, RequestSpans] = {}
        self.steps = StepColumns()
        self._workers: dict[int, dict[str, set[str]]] = {}  # bucket -> pool -> workers seen in it
        self.models: set[str] = set()
        self.read = ReadStats()
        self.skipped_spans = 0
        self.first_skip: str | None = None
        self.watermark_ns = 0  # the latest span end seen (spans are written when they end)
        self.first_arrival_ns: int | None = None  # the earliest request arrival seen
        self.namespace: str | None = None  # `service.namespace` of the first span whose resource names one

    def take(self, span: Span, where: str) -> None:
        """Interpret one span as the report does. Raises TraceDataError (names `where`) unless skip_bad."""
        workers: dict[str, set[str]] = {}
        try:
            take_span(span, self.requests, self.steps, workers, self.models, where)
        except TraceDataError as exc:
            if not self.skip_bad:
                raise
            self.skipped_spans += 1
            self.first_skip = self.first_skip or str(exc)
            return
        if workers:
            seen = self._workers.setdefault(span.start_ns // self.bucket_ns, {})
            for pool, names in workers.items():
                seen.setdefault(pool, set()).update(names)
        self.watermark_ns = max(self.watermark_ns, span.end_ns)
        request = self.requests.get(span.trace_id)
        if request is not None and request.root is not None:
            arrival = request.root[0]
            if self.first_arrival_ns is None or arrival < self.first_arrival_ns:
                self.first_arrival_ns = arrival
        if self.namespace is None:
            namespace = span.resource.get(RESOURCE_SERVICE_NAMESPACE)
            if isinstance(namespace, str) and namespace:
                self.namespace = namespace

    def data(self, files: list[str]) -> TraceData:
        """A `TraceData` of every span held (a snapshot: later spans do not change it). CPU: O(held)."""
        workers: dict[str, set[str]] = {}
        for seen in self._workers.values():
            for pool, names in seen.items():
                workers.setdefault(pool, set()).update(names)
        return TraceData(
            requests=request_table(self.requests),
            steps=step_table(self.steps),
            transfers=transfer_table(self.requests),
            workers={pool: sorted(names) for pool, names in workers.items()},
            models=sorted(self.models),
            read=self.read,
            skipped_spans=self.skipped_spans,
            first_skip=self.first_skip,
            files=files,
        )

    def prune(self, cutoff_ns: int) -> None:
        """Forget requests that arrived, steps that started and workers seen only before `cutoff_ns`. A
        request whose request span has not come yet is kept while any of its stages started after it."""
        self.requests = {
            trace_id: request for trace_id, request in self.requests.items() if _last_start_ns(request) >= cutoff_ns
        }
        starts = np.frombuffer(self.steps.start_ns, dtype=np.int64) if len(self.steps) else np.zeros(0, np.int64)
        keep = np.flatnonzero(starts >= cutoff_ns)
        if len(keep) < len(self.steps):
            old, self.steps = self.steps, StepColumns()
            pairs = list(old.pool_workers)
            for i in keep.tolist():
                pool, worker = pairs[old.pool_worker[i]]
                self.steps.append(
                    old.start_ns[i],
                    old.end_ns[i],
                    pool,
                    worker,
                    old.decode_requests[i],
                    old.prefill_tokens[i],
                    old.context_tokens[i],
                    old.prefill_attention_tokens2[i],
                    old.weight[i],
                )
        first_bucket = cutoff_ns // self.bucket_ns
        self._workers = {bucket: seen for bucket, seen in self._workers.items() if bucket >= first_bucket}


def _last_start_ns(request: RequestSpans) -> int:
    """When the request was last known to be alive: its arrival, else its latest stage's start."""
    if request.root is not None:
        return int(request.root[0])
    starts = [stage[0] for stage in (request.prefill, request.decode) if stage is not None]
    return max(starts) if starts else 2**63 - 1  # nothing timed yet (a queue span alone): keep it
