"""SpanData -> one OTLP/JSON line, without building SDK spans: the sidecar's file-export fast path.

The output is byte-for-byte what `tracer.traces.encode_line([to_readable_span(d, resource) ...])` writes
for the same spans (tests/sidecar/test_fast_json.py checks it), about ten times faster: the resource and
scope prefix is encoded once per resource, and attribute key/value fragments that repeat (pool, worker,
timing source, ...) come from a bounded memo. One difference by design: span kinds CLIENT, PRODUCER and
CONSUMER (from spans received over OTLP) are kept, where `to_readable_span` maps them to INTERNAL.

Not thread-safe per instance (the memo): one encoder per export thread.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from tracer.spans import ATTR_ERROR_TYPE, SpanData

_str = json.JSONEncoder(separators=(",", ":")).encode  # ensure_ascii, as the OpenTelemetry encoder
SCOPE_JSON = '{"name":"splitscope.tracer","version":"0.1.0"}'
_MEMO_LIMIT = 65536


def any_value(value: Any) -> str:
    """The OTLP/JSON AnyValue object for one attribute value (the OpenTelemetry encoder's type order)."""
    if value is None:
        return "{}"
    if value is True:
        return '{"boolValue":true}'
    if value is False:
        return '{"boolValue":false}'
    if isinstance(value, str):
        return '{"stringValue":' + _str(value) + "}"
    if isinstance(value, int):
        return '{"intValue":"' + str(int(value)) + '"}'
    if isinstance(value, float):
        if math.isfinite(value):
            return '{"doubleValue":' + float.__repr__(value) + "}"
        return '{"doubleValue":"' + ("NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity") + '"}'
    if isinstance(value, bytes):
        return '{"bytesValue":"' + base64.b64encode(value).decode() + '"}' if value else '{"bytesValue":""}'
    if isinstance(value, Sequence):
        inner = ",".join(any_value(v) for v in value)
        return '{"arrayValue":{' + ('"values":[' + inner + "]" if inner else "") + "}}"
    if isinstance(value, Mapping):
        inner = ",".join(_key_value(str(k), v) for k, v in value.items())
        return '{"kvlistValue":{' + ('"values":[' + inner + "]" if inner else "") + "}}"
    raise TypeError(f"Invalid type {type(value)} of value {value}")


def _key_value(key: str, value: Any) -> str:
    return '{"key":' + _str(key) + ',"value":' + any_value(value) + "}"


def resource_prefix(resource_attributes: Mapping[str, Any], scope_json: str = SCOPE_JSON) -> str:
    """Everything of a line before its first span, for one resource."""
    attrs = ",".join(_key_value(k, v) for k, v in resource_attributes.items())
    resource = '{"attributes":[' + attrs + "]}" if attrs else "{}"
    return '{"resourceSpans":[{"resource":' + resource + ',"scopeSpans":[{"scope":' + scope_json + ',"spans":['


LINE_SUFFIX = "]}]}]}\n"


class LineEncoder:
    """Encodes batches of SpanData of one resource into OTLP/JSON lines (bytes, newline included)."""

    def __init__(self) -> None:
        self._keys: dict[str, str] = {}  # attribute key -> '{"key":...,"value":'
        self._strings: dict[str, str] = {}  # string value / span name -> its JSON string

    def _json_string(self, value: str) -> str:
        strings = self._strings
        encoded = strings.get(value)
        if encoded is None:
            if len(strings) >= _MEMO_LIMIT:  # bounded: ids or free text in values must not grow it forever
                strings.clear()
            encoded = strings[value] = _str(value)
        return encoded

    def _attributes(self, attributes: Mapping[str, Any], error_type: str) -> str:
        keys = self._keys
        parts = []
        if error_type and ATTR_ERROR_TYPE in attributes:  # as to_readable_span: overwritten in place
            attributes = {**attributes, ATTR_ERROR_TYPE: error_type}
            error_type = ""
        for key, value in attributes.items():
            prefix = keys.get(key)
            if prefix is None:
                if len(keys) >= _MEMO_LIMIT:
                    keys.clear()
                prefix = keys[key] = '{"key":' + _str(key) + ',"value":'
            kind = type(value)
            if kind is str:
                parts.append(prefix + '{"stringValue":' + self._json_string(value) + "}}")
            elif kind is int:
                parts.append(prefix + '{"intValue":"' + str(value) + '"}}')
            else:
                parts.append(prefix + any_value(value) + "}")
        if error_type:
            parts.append(_key_value(ATTR_ERROR_TYPE, error_type))
        return ",".join(parts)

    def span(self, d: SpanData) -> str:
        parent = d.parent_span_id
        kind = d.kind
        head = (
            f'{{"traceId":"{d.trace_id:032x}","spanId":"{d.span_id:016x}",'
            + (f'"parentSpanId":"{parent:016x}","flags":768,' if parent else '"flags":256,')
            + '"name":' + self._json_string(d.name) + ',"kind":' + (str(kind) if 1 <= kind <= 5 else "1")
        )  # fmt: skip
        if d.start_ns:  # proto3 JSON leaves zero values out
            head += f',"startTimeUnixNano":"{d.start_ns}"'
        if d.end_ns:
            head += f',"endTimeUnixNano":"{d.end_ns}"'
        if d.attributes or d.error_type:
            head += ',"attributes":[' + self._attributes(d.attributes, d.error_type) + "]"
        if d.events:
            head += ',"events":[' + ",".join(_event(name, t, a) for name, t, a in d.events) + "]"
        if d.error_type:
            return head + ',"status":{"message":' + _str(d.error_type) + ',"code":2}}'
        return head + ',"status":{}}'

    def line(self, prefix: str, batch: Sequence[SpanData]) -> bytes:
        """One line for `batch` (sampled spans only; the caller filters) under a `resource_prefix`."""
        span = self.span
        return (prefix + ",".join([span(d) for d in batch]) + LINE_SUFFIX).encode()


def _event(name: str, time_ns: int, attributes: Mapping[str, Any]) -> str:
    parts = []
    if time_ns:
        parts.append(f'"timeUnixNano":"{time_ns}"')
    if name:
        parts.append('"name":' + _str(name))
    if attributes:
        parts.append('"attributes":[' + ",".join(_key_value(k, v) for k, v in attributes.items()) + "]")
    return "{" + ",".join(parts) + "}"
