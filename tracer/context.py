"""W3C trace-context propagation and id generation: what an engine needs to carry a request's trace.

Dependency-free: engine code imports it on every request path.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

_rng = random.SystemRandom()


def new_trace_id() -> int:
    return _rng.getrandbits(128) or 1


def new_span_id() -> int:
    return _rng.getrandbits(64) or 1


_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


@dataclass(frozen=True, slots=True)
class TraceContext:
    """Where a span hangs: its trace and its parent span (W3C trace context, sampled flag kept)."""

    trace_id: int
    span_id: int  # the parent for spans created under this context
    sampled: bool = True

    @classmethod
    def new_root(cls) -> TraceContext:
        """A fresh trace with no parent (span_id 0): the first span created under it is the root."""
        return cls(new_trace_id(), 0)

    @classmethod
    def from_traceparent(cls, header: str | None) -> TraceContext | None:
        """Parse a `traceparent` header; None when absent or malformed (W3C: then start a new trace)."""
        if not header:
            return None
        match = _TRACEPARENT.match(header.strip().lower())
        if not match or match.group(1) == "ff":
            return None
        trace_id, span_id = int(match.group(2), 16), int(match.group(3), 16)
        if trace_id == 0 or span_id == 0:
            return None
        return cls(trace_id, span_id, sampled=bool(int(match.group(4), 16) & 1))

    def child(self, span_id: int) -> TraceContext:
        """The context for spans whose parent is `span_id` in this trace."""
        return TraceContext(self.trace_id, span_id, self.sampled)

    def traceparent(self) -> str:
        return f"00-{self.trace_id:032x}-{self.span_id:016x}-{'01' if self.sampled else '00'}"
