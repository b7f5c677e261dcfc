"""Span vocabulary (DESIGN section 4), resolved span data, and W3C trace-context propagation.

`SpanData` is a span whose timing is resolved: plain ints, strings and small dicts, so it can be turned
into an OpenTelemetry `ReadableSpan` in this process (`to_readable_span`) or shipped to the sidecar as
JSON (`to_json` / `from_json`) and turned into one there. Explicit start/end times and ids come from the
engine's records, never from the SDK's clock.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

# Span names.
ROOT_SPAN_PREFIX = "text_completion"
SPAN_QUEUE = "splitscope.queue"
SPAN_PREFILL = "splitscope.prefill"
SPAN_KV_TRANSFER = "splitscope.kv_transfer"
SPAN_KV_SEND = "splitscope.kv_transfer.send"
SPAN_KV_RECV = "splitscope.kv_transfer.recv"
SPAN_DECODE = "splitscope.decode"
SPAN_STEP = "splitscope.step"
EVENT_DECODE_STALL = "splitscope.decode.stall"

# Attribute names.
ATTR_OPERATION = "gen_ai.operation.name"
ATTR_MODEL = "gen_ai.request.model"
ATTR_INPUT_TOKENS = "gen_ai.usage.input_tokens"
ATTR_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
ATTR_REQUEST_ID = "splitscope.request.id"
ATTR_MODE = "splitscope.mode"
ATTR_TTFT_S = "splitscope.ttft_s"
ATTR_ITL_P99_S = "splitscope.itl_p99_s"
ATTR_ITL_MAX_S = "splitscope.itl_max_s"
ATTR_ITL_MEAN_S = "splitscope.itl_mean_s"
ATTR_POOL = "splitscope.pool"
ATTR_WORKER = "splitscope.worker"
ATTR_TIMING_SOURCE = "splitscope.timing.source"
# On the first stage span adapted from an engine's request span: seconds from the request's arrival at the
# engine's front end until its scheduler queued it (tokenisation, IPC), outside every stage.
ATTR_FRONTEND_S = "splitscope.frontend_s"
ATTR_PREFILL_TOKENS = "splitscope.prefill.tokens"
ATTR_PREFILL_CACHED_TOKENS = "splitscope.prefill.cached_tokens"
ATTR_PREFILL_CHUNKS = "splitscope.prefill.chunks"
ATTR_KV_BYTES = "splitscope.kv.bytes"
ATTR_KV_BLOCKS = "splitscope.kv.blocks"
ATTR_KV_BLOCK_TOKENS = "splitscope.kv.block_tokens"
ATTR_KV_STREAMS = "splitscope.kv.streams"
ATTR_KV_SRC = "splitscope.kv.src"
ATTR_KV_DST = "splitscope.kv.dst"
ATTR_CLOCK_OFFSET_NS = "splitscope.clock.offset_ns"
ATTR_DECODE_ITL_P50_S = "splitscope.decode.itl_p50_s"
ATTR_DECODE_ITL_P99_S = "splitscope.decode.itl_p99_s"
ATTR_DECODE_ITL_MAX_S = "splitscope.decode.itl_max_s"
ATTR_DECODE_STALLS = "splitscope.decode.stalls"
ATTR_STEP_DECODE_REQUESTS = "splitscope.step.decode_requests"
ATTR_STEP_PREFILL_TOKENS = "splitscope.step.prefill_tokens"
ATTR_STEP_CONTEXT_TOKENS = "splitscope.step.context_tokens"
ATTR_ERROR_TYPE = "error.type"

# OTLP span kinds (trace.proto Span.SpanKind); ours are INTERNAL and SERVER, others pass through.
KIND_INTERNAL = 1
KIND_SERVER = 2
KIND_CLIENT = 3
KIND_PRODUCER = 4
KIND_CONSUMER = 5
_SPAN_KINDS = {
    KIND_INTERNAL: SpanKind.INTERNAL,
    KIND_SERVER: SpanKind.SERVER,
    KIND_CLIENT: SpanKind.CLIENT,
    KIND_PRODUCER: SpanKind.PRODUCER,
    KIND_CONSUMER: SpanKind.CONSUMER,
}

_SCOPE = InstrumentationScope("splitscope.tracer", "0.1.0")
_rng = random.SystemRandom()


def new_trace_id() -> int:
    return _rng.getrandbits(128) or 1


def new_span_id() -> int:
    return _rng.getrandbits(64) or 1


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
            "name": self.name, "kind": self.kind, "trace_id": format(self.trace_id, "032x"),
            "span_id": format(self.span_id, "016x"), "parent_span_id": format(self.parent_span_id, "016x"),
            "start_ns": self.start_ns, "end_ns": self.end_ns, "attributes": self.attributes,
            "events": self.events, "error_type": self.error_type, "samples": self.samples,
            "sampled": self.sampled,
        }  # fmt: skip

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
            name=str(obj["name"]), kind=int(obj.get("kind", KIND_INTERNAL)),
            trace_id=int(obj["trace_id"], 16), span_id=int(obj["span_id"], 16),
            parent_span_id=int(obj.get("parent_span_id") or "0", 16), start_ns=start_ns, end_ns=end_ns,
            attributes=attributes, events=events, error_type=str(obj.get("error_type") or ""),
            samples=samples, sampled=bool(obj.get("sampled", True)),
        )  # fmt: skip


def to_readable_span(data: SpanData, resource: Resource) -> ReadableSpan:
    """The SDK span for `data`, ready for a SpanProcessor's `on_end`."""
    context = SpanContext(data.trace_id, data.span_id, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    parent = (
        SpanContext(data.trace_id, data.parent_span_id, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
        if data.parent_span_id
        else None
    )
    attributes = dict(data.attributes)
    if data.error_type:
        attributes[ATTR_ERROR_TYPE] = data.error_type
        status = Status(StatusCode.ERROR, data.error_type)
    else:
        status = Status(StatusCode.UNSET)
    return ReadableSpan(
        name=data.name,
        context=context,
        parent=parent,
        resource=resource,
        attributes=attributes,
        events=[Event(name, attrs, timestamp=t) for name, t, attrs in data.events],
        kind=_SPAN_KINDS.get(data.kind, SpanKind.INTERNAL),
        status=status,
        start_time=data.start_ns,
        end_time=data.end_ns,
        instrumentation_scope=_SCOPE,
    )


# ------------------------------------------------------------------------------ W3C trace context

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
