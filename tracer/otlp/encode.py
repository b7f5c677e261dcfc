"""Writing OTLP/JSON lines: SpanData without building SDK spans (the sidecar's file export), and SDK spans.

`encode_sdk_line` is the reference: the OpenTelemetry project's own OTLP JSON encoder over finished SDK
spans (what a worker exporting in-process writes; the SDK is imported when it is called). `LineEncoder`
writes byte-for-byte what `encode_sdk_line([to_readable_span(d, resource) ...])` writes for the same spans
(tests/otlp/test_encode.py checks it), about ten times faster: the resource and
scope prefix is encoded once per resource, and attribute key/value fragments that repeat (pool, worker,
timing source, ...) come from a bounded memo. One difference by design: span kinds CLIENT, PRODUCER and
CONSUMER (from spans received over OTLP) are kept, where `to_readable_span` maps them to INTERNAL.

Not thread-safe per instance (the memo): one encoder per export thread.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from tracer.otlp.values import any_value_json, key_value_json
from tracer.otlp.values import json_string as _str
from tracer.spans import ATTR_ERROR_TYPE, SpanData

SCOPE_JSON = '{"name":"splitscope.tracer","version":"0.1.0"}'
_MEMO_LIMIT = 65536


def resource_prefix(resource_attributes: Mapping[str, Any], scope_json: str = SCOPE_JSON) -> str:
    """Everything of a line before its first span, for one resource."""
    attrs = ",".join(key_value_json(k, v) for k, v in resource_attributes.items())
    resource = '{"attributes":[' + attrs + "]}" if attrs else "{}"
    return '{"resourceSpans":[{"resource":' + resource + ',"scopeSpans":[{"scope":' + scope_json + ',"spans":['


LINE_SUFFIX = "]}]}]}\n"


class LineEncoder:
    """Encodes batches of SpanData of one resource into OTLP/JSON lines (bytes, newline included)."""

    def __init__(self) -> None:
        self._keys: dict[str, str] = {}  # attribute key -> '{"key":...,"value":'
        self._pairs: dict[tuple[str, str], str] = {}  # (key, string value) -> the whole KeyValue object
        self._names: dict[str, str] = {}  # span name -> its JSON string
        self._last_trace = (0, "")  # spans of one request (and a worker's steps) arrive together

    def _key(self, key: str) -> str:
        keys = self._keys
        if len(keys) >= _MEMO_LIMIT:  # bounded: free-form keys or values must not grow a memo forever
            keys.clear()
        prefix = keys[key] = '{"key":' + _str(key) + ',"value":'
        return prefix

    def _pair(self, item: tuple[str, str]) -> str:
        pairs = self._pairs
        if len(pairs) >= _MEMO_LIMIT:
            pairs.clear()
        fragment = pairs[item] = '{"key":' + _str(item[0]) + ',"value":{"stringValue":' + _str(item[1]) + "}}"
        return fragment

    def _attributes(self, attributes: Mapping[str, Any], error_type: str) -> str:
        keys, pairs = self._keys, self._pairs
        parts: list[str] = []
        append = parts.append
        if error_type and ATTR_ERROR_TYPE in attributes:  # as to_readable_span: overwritten in place
            attributes = {**attributes, ATTR_ERROR_TYPE: error_type}
            error_type = ""
        for item in attributes.items():
            value = item[1]
            kind = type(value)
            if kind is str:
                append(pairs.get(item) or self._pair(item))
            elif kind is int:
                append((keys.get(item[0]) or self._key(item[0])) + '{"intValue":"' + str(value) + '"}}')
            else:
                append((keys.get(item[0]) or self._key(item[0])) + any_value_json(value) + "}")
        if error_type:
            append(key_value_json(ATTR_ERROR_TYPE, error_type))
        return ",".join(parts)

    def span(self, d: SpanData) -> str:
        trace_id = d.trace_id
        last_id, trace_hex = self._last_trace
        if trace_id != last_id:
            trace_hex = f"{trace_id:032x}"
            self._last_trace = (trace_id, trace_hex)
        name = self._names.get(d.name)
        if name is None:
            if len(self._names) >= _MEMO_LIMIT:
                self._names.clear()
            name = self._names[d.name] = _str(d.name)
        parent = d.parent_span_id
        kind = d.kind
        head = (
            f'{{"traceId":"{trace_hex}","spanId":"{d.span_id:016x}",'
            + (f'"parentSpanId":"{parent:016x}","flags":768,' if parent else '"flags":256,')
            + '"name":'
            + name
            + ',"kind":'
            + (str(kind) if 1 <= kind <= 5 else "1")
        )
        if d.start_ns:  # proto3 JSON leaves zero values out
            head += f',"startTimeUnixNano":"{d.start_ns}"'
        if d.end_ns:
            head += f',"endTimeUnixNano":"{d.end_ns}"'
        if d.attributes or d.error_type:
            head += ',"attributes":[' + self._attributes(d.attributes, d.error_type) + "]"
        if d.events:
            head += ',"events":[' + ",".join(_event(name, t, a) for name, t, a in d.events) + "]"
        if d.links:
            head += ',"links":[' + ",".join(_link(t, s, a) for t, s, a in d.links) + "]"
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
        parts.append('"attributes":[' + ",".join(key_value_json(k, v) for k, v in attributes.items()) + "]")
    return "{" + ",".join(parts) + "}"


def _link(trace_id: int, span_id: int, attributes: Mapping[str, Any]) -> str:
    # The SDK's links: a local, sampled context (flags 256), attributes before the flags.
    head = f'{{"traceId":"{trace_id:032x}","spanId":"{span_id:016x}"'
    if attributes:
        head += ',"attributes":[' + ",".join(key_value_json(k, v) for k, v in attributes.items()) + "]"
    return head + ',"flags":256}'


def encode_sdk_line(spans: Sequence[Any]) -> bytes:
    """One OTLP/JSON line (with its newline) for a batch of finished SDK spans (`ReadableSpan`s), through
    the OpenTelemetry project's own encoder. Needs the `export` extra."""
    from opentelemetry.exporter.otlp.json.common.trace_encoder import encode_spans

    request = encode_spans(spans)
    return (json.dumps(request.to_dict(), separators=(",", ":")) + "\n").encode()
