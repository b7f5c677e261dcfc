"""The body rules of an OTLP/HTTP trace export (POST /v1/traces), the same for every receiver of ours (the
sidecar's, the advisor's).

A body is `application/x-protobuf` (an ExportTraceServiceRequest) or `application/json` (OTLP/JSON, hex
ids), with `Content-Encoding` identity or gzip. `export_body` returns the body as the codec reads it, or
raises what the receiver answers: `UnsupportedMedia` (415), `BodyTooLarge` (413; gzip is inflated in
bounded steps, so a gzip bomb costs at most the limit in memory) or ValueError (400, the reason in it).
A protobuf body is also a `TracesData` record and a JSON body an OTLP/JSON line (the two messages share
their one field), so `TRACE_FORMAT[content_type]` names the record format `tracer.otlp.spans_from_record`
decodes. Pure; no I/O.
"""

from __future__ import annotations

import zlib

from tracer.otlp.files import TraceFormat

PROTOBUF = "application/x-protobuf"
JSON = "application/json"
TRACE_FORMAT = {PROTOBUF: TraceFormat.OTLP_PROTO, JSON: TraceFormat.OTLP_JSON}
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


class BodyTooLarge(Exception):
    pass


class UnsupportedMedia(ValueError):
    pass


def inflate_gzip(body: bytes, limit_bytes: int) -> bytes:
    """Decompress a gzip body, refusing (BodyTooLarge) past `limit_bytes`; ValueError when not gzip."""
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = inflater.decompress(body, limit_bytes + 1)
    except zlib.error as exc:
        raise ValueError(f"body is not valid gzip: {exc}") from None
    if len(out) > limit_bytes or inflater.unconsumed_tail:
        raise BodyTooLarge(f"decompressed body exceeds {limit_bytes} bytes")
    if not inflater.eof:
        raise ValueError("gzip body is truncated")
    return out


def check_content_type(content_type: str) -> None:
    """UnsupportedMedia unless `content_type` (without parameters) is one OTLP/HTTP defines."""
    if content_type not in TRACE_FORMAT:
        raise UnsupportedMedia(f"unsupported content type {content_type!r}; use {PROTOBUF} or {JSON}")


def export_body(content_type: str, content_encoding: str, body: bytes, limit_bytes: int) -> bytes:
    """The body to decode, after the content type and encoding checks and gzip (module doc for the errors)."""
    check_content_type(content_type)
    encoding = (content_encoding or "identity").lower()
    if encoding == "gzip":
        return inflate_gzip(body, limit_bytes)
    if encoding != "identity":
        raise UnsupportedMedia(f"unsupported content encoding {encoding!r}; use gzip")
    if len(body) > limit_bytes:
        raise BodyTooLarge(f"body exceeds {limit_bytes} bytes")
    return body


def empty_answer(content_type: str) -> bytes:
    """An ExportTraceServiceResponse with nothing rejected, in the request's encoding (protobuf: no bytes)."""
    return b"{}" if content_type == JSON else b""
