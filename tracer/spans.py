"""Resolved span data, and the span vocabulary re-exported for its many readers.

`SpanData` is a span whose timing is resolved: plain ints, strings and small dicts, so it can be turned
into an OpenTelemetry `ReadableSpan` in this process (`tracer.otel.to_readable_span`) or shipped to the
sidecar as JSON (`to_json` / `from_json`) and turned into one there. Explicit start/end times and ids come
from the engine's records, never from the SDK's clock.

Dependency-free: the names are defined in `tracer.vocabulary`, propagation in `tracer.context`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tracer.context import TraceContext, new_span_id, new_trace_id  # noqa: F401 -- re-exported
from tracer.vocabulary import *  # noqa: F403 -- the contract's names, for `from tracer import spans as s`
from tracer.vocabulary import KIND_INTERNAL


@dataclass(slots=True)
class SpanData:
    """A resolved span. Times are Unix ns. `samples` carries metric-only values (e.g. `itl_gaps_s`)
    that are not span attributes; `sampled` False means metrics only, no exported span."""

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

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "trace_id": format(self.trace_id, "032x"),
            "span_id": format(self.span_id, "016x"),
            "parent_span_id": format(self.parent_span_id, "016x"),
            "start_ns": self.start_ns,
            "end_ns": self.end_ns,
            "attributes": self.attributes,
            "events": self.events,
            "error_type": self.error_type,
            "samples": self.samples,
            "sampled": self.sampled,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> SpanData:
        """Inverse of `to_json`; raises ValueError/KeyError/TypeError on a malformed object."""
        start_ns, end_ns = int(obj["start_ns"]), int(obj["end_ns"])
        if end_ns < start_ns:
            raise ValueError("span ends before it starts")
        attributes = obj.get("attributes") or {}
        if not isinstance(attributes, dict):
            raise TypeError("attributes must be an object")
        events = [(str(n), int(t), dict(a)) for n, t, a in obj.get("events") or ()]
        samples = {str(k): [float(x) for x in v] for k, v in (obj.get("samples") or {}).items()}
        return cls(
            name=str(obj["name"]),
            kind=int(obj.get("kind", KIND_INTERNAL)),
            trace_id=int(obj["trace_id"], 16),
            span_id=int(obj["span_id"], 16),
            parent_span_id=int(obj.get("parent_span_id") or "0", 16),
            start_ns=start_ns,
            end_ns=end_ns,
            attributes=attributes,
            events=events,
            error_type=str(obj.get("error_type") or ""),
            samples=samples,
            sampled=bool(obj.get("sampled", True)),
        )
