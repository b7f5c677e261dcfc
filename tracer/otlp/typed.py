"""Typed, lazy decoding of OTLP/JSON lines (msgspec): the fast path for readers that need speed.

msgspec decodes each JSON line into small structs (`JsonSpan` and its attributes; scopes, resources, links
and events are skipped by the decoder without being built). Values and ids convert to what the generic
reader (tracer.otlp.decode) gives for the same line; a line the structs refuse raises one of
`TYPED_REFUSALS`, and the caller reads it again the generic way, so a bad line fails with the generic
reader's message. The report's trace reader (tracer.report.read) specialises on these: it reads step spans
straight from the structs into its columns. Pure; single-threaded use per decoded line.
"""

from __future__ import annotations

import msgspec

from tracer.otlp.format import SPAN_ID_BYTES, STATUS_UNSET, TRACE_ID_BYTES, Span

# gc=False: a decoded line is a tree (no reference cycles), so the cyclic collector need not track its
# millions of structs.


class JsonValue(msgspec.Struct, gc=False):
    # Decoded with strict=False: proto3 JSON writes int64 as a decimal string, doubles as "NaN"/"Infinity".
    intValue: int | None = None
    stringValue: str | None = None
    doubleValue: float | None = None
    boolValue: bool | None = None
    arrayValue: JsonArrayValue | None = None
    kvlistValue: JsonKeyValueList | None = None
    bytesValue: str | None = None


class JsonKeyValue(msgspec.Struct, gc=False):
    key: str
    value: JsonValue | None = None


class JsonArrayValue(msgspec.Struct, gc=False):
    values: list[JsonValue] = []


class JsonKeyValueList(msgspec.Struct, gc=False):
    values: list[JsonKeyValue] = []


class JsonStatus(msgspec.Struct, gc=False):
    code: int = STATUS_UNSET
    message: str = ""


class JsonSpan(msgspec.Struct, gc=False):
    traceId: str
    spanId: str
    name: str
    startTimeUnixNano: int
    endTimeUnixNano: int
    parentSpanId: str = ""
    kind: int = 0
    attributes: list[JsonKeyValue] = []
    status: JsonStatus | None = None


class JsonScopeSpans(msgspec.Struct, gc=False):
    spans: list[JsonSpan] = []


class JsonResourceSpans(msgspec.Struct, gc=False):
    scopeSpans: list[JsonScopeSpans] = []


class JsonExportTraceServiceRequest(msgspec.Struct, gc=False):
    """One OTLP/JSON line: an `ExportTraceServiceRequest` object; only its spans are read."""

    resourceSpans: list[JsonResourceSpans]


# One OTLP/JSON line (bytes) -> JsonExportTraceServiceRequest. Raises one of TYPED_REFUSALS.
decode_request = msgspec.json.Decoder(JsonExportTraceServiceRequest, strict=False).decode
# What a line the structs refuse raises: read it the generic way (tracer.otlp.decode) for its message.
TYPED_REFUSALS = (msgspec.DecodeError, msgspec.ValidationError, ValueError)


def struct_number(value: JsonValue) -> int | float | None:
    """The value as the generic reader orders its fields (int, string, double, ...), if it is a number."""
    if value.intValue is not None:
        return value.intValue
    if value.stringValue is None and value.doubleValue is not None:
        return value.doubleValue
    return None


def struct_value(value: JsonValue | None):  # type: ignore[no-untyped-def]
    """What the generic reader gives for the same JSON value (its field order; arrays as lists, key-value
    lists as dicts, bytes as base64 text). Raises nothing: the structs have checked the shape."""
    if value is None:
        return None
    if value.intValue is not None:
        return value.intValue
    if value.stringValue is not None:
        return value.stringValue
    if value.doubleValue is not None:
        return value.doubleValue
    if value.boolValue is not None:
        return value.boolValue
    if value.arrayValue is not None:
        return [struct_value(item) for item in value.arrayValue.values]
    if value.kvlistValue is not None:
        return {kv.key: struct_value(kv.value) for kv in value.kvlistValue.values}
    return value.bytesValue


def struct_attributes(key_values: list[JsonKeyValue]) -> dict:  # type: ignore[type-arg]
    """A decoded KeyValue list as the generic reader's dict."""
    return {kv.key: struct_value(kv.value) for kv in key_values}


_TRACE_ID_HEX = 2 * TRACE_ID_BYTES
_SPAN_ID_HEX = 2 * SPAN_ID_BYTES


def _hex(value: str, length: int) -> str:
    if len(value) != length:
        raise ValueError(value)
    int(value, 16)  # ValueError when not hex
    return value.lower()


def _parent_id(value: str, checked: bool) -> str:
    return _hex(value, _SPAN_ID_HEX) if checked and value else value


def span_from_struct(raw: JsonSpan, *, checked_ids: bool = True) -> Span:
    """A decoded span without events and with an empty resource (neither is decoded). With `checked_ids`
    raises ValueError for an id the generic reader refuses (read the line again for its message); without,
    passes the ids through as written (for a caller that never reads them)."""
    status = raw.status
    return Span(
        trace_id=_hex(raw.traceId, _TRACE_ID_HEX) if checked_ids else raw.traceId,
        span_id=_hex(raw.spanId, _SPAN_ID_HEX) if checked_ids else raw.spanId,
        parent_span_id=_parent_id(raw.parentSpanId, checked_ids),
        name=raw.name,
        kind=raw.kind,
        start_ns=raw.startTimeUnixNano,
        end_ns=raw.endTimeUnixNano,
        attributes=struct_attributes(raw.attributes),
        resource={},
        status_code=status.code if status is not None else STATUS_UNSET,
        status_message=status.message if status is not None else "",
    )
