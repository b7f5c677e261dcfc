"""Resolved span data, and the span vocabulary re-exported for its many readers.

`SpanData` is a span whose timing is resolved: plain ints, strings and small dicts, so it can be turned
into an OpenTelemetry `ReadableSpan` in this process (`tracer.export.otel.to_readable_span`) or shipped to the
sidecar as a positional MessagePack record (tracer/sidecar/wire.py) and turned into one there. Explicit start/end times and ids come
from the engine's records, never from the SDK's clock.

Dependency-free: the names are defined in `tracer.vocabulary`, propagation in `tracer.context`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tracer.context import TraceContext, new_span_id, new_trace_id  # noqa: F401 -- re-exported
from tracer.vocabulary import *  # noqa: F403 -- the contract's names, for `from tracer import spans as s`


@dataclass(slots=True)
class SpanData:
    """A resolved span. Times are Unix ns. `samples` carries metric-only values (e.g. `itl_gaps_s`)
    that are not span attributes; `sampled` False means metrics only, no exported span. `links`:
    OpenTelemetry span links, (trace id, span id, attributes) each (a decode span's stall links)."""

    name: str
    kind: int
    trace_id: int
    span_id: int
    parent_span_id: int  # 0 for a root
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, int, dict[str, Any]]] = field(default_factory=list)
    error_type: str = ""
    samples: dict[str, list[float]] = field(default_factory=dict)
    sampled: bool = True
    links: list[tuple[int, int, dict[str, Any]]] = field(default_factory=list)
