"""The bounded queue between the sidecar's network threads (producers) and its export thread (consumer).

Bounded by spans, not by batches, so memory stays bounded however senders batch. `offer` never blocks:
when a batch does not fit it is refused whole and its spans are counted as dropped (reason
`sidecar_queue_full`), so a slow exporter costs telemetry, never a stalled sender.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tracer.spans import SpanData

DROP_QUEUE_FULL = "sidecar_queue_full"


@dataclass(frozen=True, slots=True)
class Batch:
    """Spans of one resource. `resource` is a tuple of (key, value) attribute pairs (hashable)."""

    resource: tuple[tuple[str, Any], ...]
    spans: list[SpanData]


def resource_key(attributes: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """A hashable, order-keeping form of resource attributes (lists become tuples)."""
    return tuple((str(k), tuple(v) if isinstance(v, list) else v) for k, v in attributes.items())


class IngestQueue:
    """Multi-producer, single-consumer; `offer` from any thread, `take` from the export thread only."""

    def __init__(self, max_spans: int, on_drop: Callable[[str, int], None]) -> None:
        if max_spans < 1:
            raise ValueError("max_spans must be positive")
        self.max_spans = max_spans
        self._on_drop = on_drop
        self._items: deque[Batch] = deque()
        self._spans = 0
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self.offered_spans = 0

    def offer(self, batch: Batch) -> bool:
        """Queue `batch` unless it would exceed the bound; never blocks. False when dropped (counted)."""
        n = len(batch.spans)
        if n == 0:
            return True
        with self._lock:
            if self._spans + n > self.max_spans:
                accepted = False
            else:
                self._items.append(batch)
                self._spans += n
                self.offered_spans += n
                self._ready.notify()
                accepted = True
        if not accepted:
            self._on_drop(DROP_QUEUE_FULL, n)
        return accepted

    def take(self, timeout_s: float) -> list[Batch]:
        """Everything queued, waiting up to `timeout_s` for the first batch ([] on timeout)."""
        with self._lock:
            if not self._items:
                self._ready.wait(timeout_s)
            items = list(self._items)
            self._items.clear()
            self._spans = 0
        return items

    def wake(self) -> None:
        with self._lock:
            self._ready.notify_all()

    def __len__(self) -> int:
        """Spans waiting (approximate outside the lock)."""
        return self._spans
