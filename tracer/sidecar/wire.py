"""The Unix-socket ingest protocol between a worker (client.SidecarSink) and the sidecar (unix_ingest).

1. The client sends one handshake line: JSON `{"splitscope_ingest": 1, "token": str, "resource": {...}}`
   and `\\n`. `resource` holds the worker's resource attributes (service.name, ...).
2. The sidecar answers one line: `{"ok": true}` or `{"ok": false, "error": "..."}` (and then closes).
3. Then frames, client to sidecar only: a 4-byte big-endian payload length, then the payload, a
   MessagePack array of records. A record is the fields of `tracer.spans.SpanData` in order, positional,
   with the 128-bit trace id split in two (MessagePack integers stop at 64 bits):
   `[name, kind, trace_id_high64, trace_id_low64, span_id, parent_span_id, start_ns, end_ns, attributes,
   events, error_type, samples, sampled]`, then (protocol version 3), only when the span has any, its
   links: `[[trace_id_high64, trace_id_low64, span_id, attributes], ...]`. A record without links is
   the same 13 fields as before, so a version-3 sidecar reads older clients' records unchanged.
4. Or, in the same stream (protocol version 2), a metrics snapshot frame: the payload is a MessagePack map
   `{"samples": [[family, {label: value}, value], ...]}` holding the current value of the worker's own
   gauges and counters that no span carries (queue depth, KV cache use, ...: `Catalogue.process_set()`).
   The sidecar sets gauges to it and adds counters' increase since the last snapshot of the same process.
   A version-2 client is refused at the handshake by a version-1 sidecar (which would take a snapshot for
   a bad frame), and a version-2 sidecar still takes version-1 clients; likewise a version-3 client (span
   links) by a version-2 sidecar, which would take a 14-field record for a bad frame.

Why MessagePack through msgspec rather than JSON: decoding with a declared record type validates every
field in C, and it is what lets the sidecar ingest 100k records/s on two cores (bench/sidecar_ingest.py).
Nothing is ever unpickled; a malformed frame raises WireError.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import Annotated, Any

import msgspec

from tracer.spans import SpanData

PROTOCOL_VERSION = 3
ACCEPTED_VERSIONS = (1, 2, 3)  # version 1: span frames only; 2: snapshots; 3: span links
HANDSHAKE_MAX_BYTES = 64 * 1024
FRAME_HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 16 * 1024 * 1024
# The client splits larger batches so that one frame stays far below MAX_FRAME_BYTES.
MAX_RECORDS_PER_FRAME = 2048

_U64_MASK = (1 << 64) - 1
_NonNegative = Annotated[int, msgspec.Meta(ge=0)]
_Link = tuple[_NonNegative, _NonNegative, _NonNegative, dict[str, Any]]


class _Record(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """A span record as decoded: the positional fields above; `links` may be left off the end."""

    name: str
    kind: int
    trace_high: _NonNegative
    trace_low: _NonNegative
    span_id: _NonNegative
    parent_span_id: _NonNegative
    start_ns: _NonNegative
    end_ns: _NonNegative
    attributes: dict[str, Any]
    events: list[tuple[str, int, dict[str, Any]]]
    error_type: str
    samples: dict[str, list[float]]
    sampled: bool
    links: list[_Link] = []


_encode = msgspec.msgpack.Encoder().encode


class MetricsSnapshot(msgspec.Struct, forbid_unknown_fields=True):
    """A worker's gauge and counter values at one moment: (family name, labels, value) per series."""

    samples: list[tuple[str, dict[str, str], float]]


# An array payload is a batch of spans, a map payload a snapshot (msgspec tells them apart in C).
_decode = msgspec.msgpack.Decoder(list[_Record] | MetricsSnapshot).decode


class WireError(ValueError):
    """A handshake or frame that does not follow this protocol."""


def encode_handshake(token: str, resource: dict[str, Any]) -> bytes:
    return (json.dumps({"splitscope_ingest": PROTOCOL_VERSION, "token": token, "resource": resource}) + "\n").encode()


def decode_handshake(line: bytes) -> tuple[str, dict[str, Any]]:
    """(token, resource attributes) from a handshake line; raises WireError."""
    try:
        obj = json.loads(line)
    except ValueError as exc:
        raise WireError(f"handshake is not JSON: {exc}") from None
    version = obj.get("splitscope_ingest") if isinstance(obj, dict) else None
    if type(version) is not int or version not in ACCEPTED_VERSIONS:  # JSON `true` is no version
        raise WireError(f"not a splitscope ingest handshake (protocol versions {ACCEPTED_VERSIONS} accepted)")
    token, resource = obj.get("token", ""), obj.get("resource") or {}
    if not isinstance(token, str) or not isinstance(resource, dict):
        raise WireError("handshake token must be a string and resource an object")
    return token, resource


def encode_answer(error: str | None) -> bytes:
    return (json.dumps({"ok": True} if error is None else {"ok": False, "error": error}) + "\n").encode()


def decode_answer(line: bytes) -> str | None:
    """None when the sidecar accepted the handshake, else its reason."""
    try:
        obj = json.loads(line)
    except ValueError:
        return f"unreadable answer {line[:80]!r}"
    if isinstance(obj, dict) and obj.get("ok") is True:
        return None
    return str(obj.get("error") if isinstance(obj, dict) else obj)


def encode_frame(batch: Sequence[SpanData]) -> bytes:
    """One frame (header included). Raises TypeError for attribute values MessagePack cannot carry."""
    payload = _encode(
        [
            (
                d.name,
                d.kind,
                d.trace_id >> 64,
                d.trace_id & _U64_MASK,
                d.span_id,
                d.parent_span_id,
                d.start_ns,
                d.end_ns,
                d.attributes,
                d.events,
                d.error_type,
                d.samples,
                d.sampled,
            )
            + (([(t >> 64, t & _U64_MASK, span, attrs) for t, span, attrs in d.links],) if d.links else ())
            for d in batch
        ]
    )
    return FRAME_HEADER.pack(len(payload)) + payload


def encode_snapshot(samples: Sequence[tuple[str, dict[str, str], float]]) -> bytes:
    """One metrics snapshot frame (header included)."""
    payload = _encode(MetricsSnapshot(list(samples)))
    return FRAME_HEADER.pack(len(payload)) + payload


def decode_payload(payload: bytes | bytearray | memoryview) -> list[SpanData] | MetricsSnapshot:
    """The spans of one frame payload, or a metrics snapshot; raises WireError on anything malformed."""
    try:
        records = _decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(f"bad frame: {exc}") from None
    if isinstance(records, MetricsSnapshot):
        return records
    out = [
        SpanData(
            r.name,
            r.kind,
            (r.trace_high << 64) | r.trace_low,
            r.span_id,
            r.parent_span_id,
            r.start_ns,
            r.end_ns,
            r.attributes,
            r.events,
            r.error_type,
            r.samples,
            r.sampled,
            [((high << 64) | low, span, attrs) for high, low, span, attrs in r.links],
        )
        for r in records
    ]
    # MessagePack integers stop at 64 bits and the record type says non-negative: ids cannot be too wide.
    for d in out:
        if not d.trace_id or not d.span_id or d.end_ns < d.start_ns:
            raise WireError(f"bad span {d.name!r}: a zero id, or it ends before it starts")
    return out
