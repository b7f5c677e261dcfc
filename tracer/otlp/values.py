"""OTLP AnyValue and attribute conversions, in every direction the project needs. Pure; no I/O.

Reading into a `tracer.otlp.Span` (the trace-file view: what `splitscope report` and `explain` read), the
value is what OTLP/JSON holds: int, str, float, bool, a list for an array, a dict for a key-value list,
and bytes as their base64 text (proto3 JSON); a protobuf record gives the same values. Reading into a
`tracer.spans.SpanData` (the sidecar's view: spans to meter and encode again), bytes stay bytes, which the
encoder writes back as the same base64 text. Writing (`any_value_json`) follows the OpenTelemetry
encoder's type order, so our lines are byte-identical to the SDK's.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

# ------------------------------------------------------------------------ OTLP/JSON (orjson's dicts)


def json_value(value: dict[str, Any]) -> Any:
    """One decoded AnyValue object. One field is set; int64 arrives as a decimal string (proto3 JSON)."""
    # Most frequent first.
    if "intValue" in value:
        return int(value["intValue"])
    if "stringValue" in value:
        return value["stringValue"]
    if "doubleValue" in value:
        return float(value["doubleValue"])
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "arrayValue" in value:
        return [json_value(v) for v in value["arrayValue"].get("values", ())]
    if "kvlistValue" in value:
        return json_attributes(value["kvlistValue"].get("values", ()))
    return value.get("bytesValue")


def json_attributes(key_values: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A decoded KeyValue list as a dict."""
    out = {}
    for kv in key_values:
        value = kv.get("value") or {}
        # The two common cases inline: a million spans' attributes go through here.
        if "intValue" in value:
            out[kv["key"]] = int(value["intValue"])
        elif "stringValue" in value:
            out[kv["key"]] = value["stringValue"]
        else:
            out[kv["key"]] = json_value(value)
    return out


# ------------------------------------------------------------- protobuf messages (opentelemetry-proto)


def proto_value(value: Any) -> Any:
    """One protobuf AnyValue as the JSON reader reads the same data (bytes as base64 text)."""
    which = value.WhichOneof("value")
    if which == "int_value":
        return value.int_value
    if which == "string_value":
        return value.string_value
    if which == "double_value":
        return value.double_value
    if which == "bool_value":
        return value.bool_value
    if which == "array_value":
        return [proto_value(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return proto_attributes(value.kvlist_value.values)
    if which == "bytes_value":
        return base64.b64encode(value.bytes_value).decode("ascii")
    return None


def proto_attributes(key_values: Any) -> dict[str, Any]:
    """A protobuf KeyValue list as a dict (the JSON reader's values)."""
    return {kv.key: proto_value(kv.value) for kv in key_values}


# ------------------------------------------- request messages -> SpanData values (bytes kept as bytes)

_ANY_VALUE_FIELDS = (
    "string_value",
    "bool_value",
    "int_value",
    "double_value",
    "array_value",
    "kvlist_value",
    "bytes_value",
)


def message_value(value: Any) -> Any:
    """One AnyValue of an export request, protobuf or opentelemetry-proto-json (the two message families
    share field names), for a SpanData: bytes as bytes."""
    if value is None:
        return None
    which = value.WhichOneof("value") if hasattr(value, "WhichOneof") else _json_which(value)
    if which is None:
        return None
    if which == "array_value":
        return [message_value(v) for v in getattr(value, which).values]
    if which == "kvlist_value":
        return message_attributes(getattr(value, which).values)
    if which == "bytes_value":
        return bytes(getattr(value, which))
    return getattr(value, which)


def message_attributes(key_values: Any) -> dict[str, Any]:
    """A KeyValue list of an export request (either family) as a dict of SpanData values."""
    return {kv.key: message_value(kv.value) for kv in key_values}


def _json_which(value: Any) -> str | None:
    for name in _ANY_VALUE_FIELDS:
        if getattr(value, name) is not None:
            return name
    return None


# ------------------------------------------------------------------------ Python -> OTLP/JSON text

json_string = json.JSONEncoder(separators=(",", ":")).encode  # ensure_ascii, as the OpenTelemetry encoder


def any_value_json(value: Any) -> str:
    """The OTLP/JSON AnyValue object for one attribute value (the OpenTelemetry encoder's type order).
    Raises TypeError for a type OTLP has no value for."""
    kind = type(value)  # the common exact types first: this runs once per attribute of every span and link
    if kind is int:
        return '{"intValue":"' + str(value) + '"}'
    if kind is str:
        return '{"stringValue":' + json_string(value) + "}"
    if value is None:
        return "{}"
    if value is True:
        return '{"boolValue":true}'
    if value is False:
        return '{"boolValue":false}'
    if isinstance(value, str):
        return '{"stringValue":' + json_string(value) + "}"
    if isinstance(value, int):
        return '{"intValue":"' + str(int(value)) + '"}'
    if isinstance(value, float):
        if math.isfinite(value):
            return '{"doubleValue":' + float.__repr__(value) + "}"
        return '{"doubleValue":"' + ("NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity") + '"}'
    if isinstance(value, bytes):
        return '{"bytesValue":"' + base64.b64encode(value).decode() + '"}' if value else '{"bytesValue":""}'
    if isinstance(value, Sequence):
        inner = ",".join(any_value_json(v) for v in value)
        return '{"arrayValue":{' + ('"values":[' + inner + "]" if inner else "") + "}}"
    if isinstance(value, Mapping):
        inner = ",".join(key_value_json(str(k), v) for k, v in value.items())
        return '{"kvlistValue":{' + ('"values":[' + inner + "]" if inner else "") + "}}"
    raise TypeError(f"Invalid type {type(value)} of value {value}")


# Attribute keys repeat on every span (our vocabulary, an engine's): their encoded prefix is kept, up to a bound
# that an engine sending unbounded key names cannot grow past.
_KEY_PREFIXES: dict[str, str] = {}
_MAX_KEY_PREFIXES = 4096


def key_value_json(key: str, value: Any) -> str:
    """One OTLP/JSON KeyValue object."""
    prefix = _KEY_PREFIXES.get(key)
    if prefix is None:
        prefix = '{"key":' + json_string(key) + ',"value":'
        if len(_KEY_PREFIXES) < _MAX_KEY_PREFIXES:
            _KEY_PREFIXES[key] = prefix
    return prefix + any_value_json(value) + "}"
