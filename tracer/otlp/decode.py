"""Trace file records -> `Span`s, the generic way: every span whole, with its events and resource.

Reading JSON is a small, fast walk over `orjson.loads` output and needs no OpenTelemetry package; reading
protobuf records uses the project's generated messages (`opentelemetry-proto`, imported only when a
protobuf record is read). Both give the same `Span` for the same data. Blocking file I/O in `iter_spans`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import orjson

from tracer.otlp.files import ReadStats, TraceFormat, describe_error, iter_counted_records, record_error
from tracer.otlp.format import (
    SPAN_ID_BYTES,
    STATUS_UNSET,
    TRACE_ID_BYTES,
    Span,
    SpanEvent,
    SpanLink,
    TraceFileError,
    hex_from_bytes,
    hex_id,
    span_name,
)
from tracer.otlp.values import json_attributes, proto_attributes

_TRACE_ID_HEX = 2 * TRACE_ID_BYTES
_SPAN_ID_HEX = 2 * SPAN_ID_BYTES


def spans_from_request(request: dict[str, Any]) -> Iterator[Span]:
    """Spans of one decoded ExportTraceServiceRequest object. Raises ValueError/KeyError/TypeError."""
    if not isinstance(request, dict) or "resourceSpans" not in request:
        raise ValueError("not an ExportTraceServiceRequest (no resourceSpans)")
    for resource_spans in request["resourceSpans"]:
        resource = json_attributes(resource_spans.get("resource", {}).get("attributes", ()))
        for scope_spans in resource_spans.get("scopeSpans", ()):
            for raw in scope_spans.get("spans", ()):
                status = raw.get("status") or {}
                parent = raw.get("parentSpanId") or ""

                yield Span(
                    trace_id=hex_id(raw.get("traceId"), _TRACE_ID_HEX, "traceId"),
                    span_id=hex_id(raw.get("spanId"), _SPAN_ID_HEX, "spanId"),
                    parent_span_id=hex_id(parent, _SPAN_ID_HEX, "parentSpanId") if parent else "",
                    name=span_name(raw["name"]),
                    kind=int(raw.get("kind", 0)),
                    start_ns=int(raw["startTimeUnixNano"]),
                    end_ns=int(raw["endTimeUnixNano"]),
                    attributes=json_attributes(raw.get("attributes", ())),
                    resource=resource,
                    events=[
                        SpanEvent(
                            e.get("name", ""), int(e.get("timeUnixNano", 0)), json_attributes(e.get("attributes", ()))
                        )
                        for e in raw.get("events", ())
                    ],
                    status_code=int(status.get("code", STATUS_UNSET)),
                    status_message=status.get("message", ""),
                    links=[
                        SpanLink(
                            hex_id(link.get("traceId"), _TRACE_ID_HEX, "link traceId"),
                            hex_id(link.get("spanId"), _SPAN_ID_HEX, "link spanId"),
                            json_attributes(link.get("attributes", ())),
                        )
                        for link in raw.get("links", ())
                    ],
                )


def parse_proto(record: bytes) -> Any:
    """One serialized OTLP `TracesData` (or `ExportTraceServiceRequest`: the same wire format) as the
    opentelemetry-proto message. Raises ValueError for bytes that are not one, ImportError without the
    `opentelemetry-proto` package."""
    from google.protobuf.message import DecodeError
    from opentelemetry.proto.trace.v1.trace_pb2 import TracesData

    try:
        return TracesData.FromString(record)
    except DecodeError as exc:
        raise ValueError(f"not an OTLP protobuf TracesData message ({exc})") from None


def span_from_proto(raw: Any, resource: dict[str, Any], *, events: bool = True, checked_ids: bool = True) -> Span:
    """One opentelemetry-proto `Span` as the JSON reader reads the same span; `events` False leaves out its
    events and links. With `checked_ids` raises ValueError for a bad id; without, passes the ids through as
    hex of whatever bytes they hold (for a caller that never reads them)."""
    if checked_ids:
        trace_id = hex_from_bytes(raw.trace_id, TRACE_ID_BYTES, "traceId")
        span_id = hex_from_bytes(raw.span_id, SPAN_ID_BYTES, "spanId")
        parent = hex_from_bytes(raw.parent_span_id, SPAN_ID_BYTES, "parentSpanId") if raw.parent_span_id else ""
    else:
        trace_id, span_id, parent = raw.trace_id.hex(), raw.span_id.hex(), raw.parent_span_id.hex()
    return Span(
        trace_id=trace_id,
        span_id=span_id,
        parent_span_id=parent,
        name=raw.name,
        kind=raw.kind,
        start_ns=raw.start_time_unix_nano,
        end_ns=raw.end_time_unix_nano,
        attributes=proto_attributes(raw.attributes),
        resource=resource,
        events=[SpanEvent(e.name, e.time_unix_nano, proto_attributes(e.attributes)) for e in raw.events]
        if events
        else [],
        status_code=raw.status.code,
        status_message=raw.status.message,
        links=[
            SpanLink(
                hex_from_bytes(link.trace_id, TRACE_ID_BYTES, "link traceId"),
                hex_from_bytes(link.span_id, SPAN_ID_BYTES, "link spanId"),
                proto_attributes(link.attributes),
            )
            for link in raw.links
        ]
        if events
        else [],
    )


def spans_from_proto(record: bytes) -> Iterator[Span]:
    """Spans of one serialized OTLP `TracesData` record. Raises ValueError, ImportError (see parse_proto)."""
    for resource_spans in parse_proto(record).resource_spans:
        resource = proto_attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for raw in scope_spans.spans:
                yield span_from_proto(raw, resource)


def spans_from_record(trace_format: TraceFormat, record: bytes) -> list[Span]:
    """Every span of one record. Raises ValueError/KeyError/TypeError/AttributeError for a bad record."""
    if trace_format is TraceFormat.OTLP_JSON:
        return list(spans_from_request(orjson.loads(record)))
    return list(spans_from_proto(record))


def record_spans(
    path: str | os.PathLike[str],
    number: int,
    trace_format: TraceFormat,
    record: bytes,
    *,
    skip_bad: bool,
    stats: ReadStats,
) -> list[Span]:
    """`spans_from_record`, counted in `stats`: a bad record raises TraceFileError naming `path` and its
    record `number`, or with `skip_bad` is counted as skipped and gives no span. The one place both readers
    (`iter_spans`, the report's) turn a record into spans the generic way."""
    try:
        batch = spans_from_record(trace_format, record)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        record_error(TraceFileError(str(path), number, describe_error(exc)), skip_bad, stats)
        return []
    stats.spans += len(batch)
    return batch


def iter_spans(
    paths: Sequence[str | os.PathLike[str]],
    *,
    skip_bad: bool = False,
    stats: ReadStats | None = None,
    growing: bool = False,
) -> Iterator[Span]:
    """Every span of every record of the given trace files (OTLP/JSON lines or protobuf), in file order.

    A bad record (truncated, not JSON, missing fields) raises TraceFileError with its line (record) number,
    or with `skip_bad` is skipped and counted in `stats`; a protobuf file whose framing breaks is skipped
    from there on. Blank lines are ignored (collectors end files with one). `growing`: the files are still
    being appended to (a running server), so an incomplete last record is a write in progress; it is left
    for the next read instead of being reported as truncated.
    """
    stats = stats if stats is not None else ReadStats()
    for path in paths:
        for trace_format, number, record in iter_counted_records(path, skip_bad=skip_bad, stats=stats, growing=growing):
            yield from record_spans(path, number, trace_format, record, skip_bad=skip_bad, stats=stats)
