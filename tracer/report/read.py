"""The report's trace reader: every record of the trace files, decoded into only what the report reads.

Records come from the codec (`tracer.otlp.files.iter_counted_records`: OTLP/JSON lines or the collector's
length-prefixed protobuf, told apart by content). Step spans are most of a trace file (one per engine iteration, about 90%
of a million spans), so an OTLP/JSON step span that is well formed goes straight into `StepColumns`: no
`Span`, no attribute dict, no per-span object kept; its ids, events and the attributes the report does not
use are not read. Every other span becomes a `tracer.otlp.Span` without events and with an empty
resource (the report reads neither) for `tracer.report.tables` to interpret.

Each JSON line is decoded by the codec's typed decoder (`tracer.otlp.typed`: msgspec structs, with
scopes, resources, links and events skipped). A line the structs refuse, or a non-step span whose ids are
not hex, is read again whole by `tracer.otlp.decode.record_spans`, so a bad line fails with the
generic reader's message; a step span that lacks an attribute or carries one of another type is handed on as
a `Span`, so `tracer.report.tables` names what is wrong with it. Protobuf records are read by
`spans_from_record` into `Span`s (the opentelemetry-proto messages), steps included.

Blocking file I/O; single-threaded (one StepColumns per read).
"""

from __future__ import annotations

import math
import os
from array import array
from collections.abc import Iterator, Sequence
from typing import Any

from tracer.otlp.decode import parse_proto, record_spans, span_from_proto
from tracer.otlp.files import ReadStats, TraceFormat, iter_counted_records
from tracer.otlp.format import Span
from tracer.otlp.typed import (
    TYPED_REFUSALS,
    JsonSpan,
    decode_request,
    span_from_struct,
    struct_number,
)
from tracer.spans import (
    ATTR_POOL,
    ATTR_SAMPLE_WEIGHT,
    ATTR_STEP_CONTEXT_TOKENS,
    ATTR_STEP_DECODE_REQUESTS,
    ATTR_STEP_PREFILL_ATTENTION_TOKENS2,
    ATTR_STEP_PREFILL_TOKENS,
    ATTR_WORKER,
    SPAN_STEP,
)


class StepColumns:
    """The step spans read so far, one compact column per field (8 bytes a value), in file order.

    Pools and workers are stored once, as an index into `pool_workers` (the distinct (pool, worker) pairs
    in order of first appearance). Times in Unix ns. Not thread-safe.
    """

    def __init__(self) -> None:
        self.start_ns = array("q")
        self.end_ns = array("q")
        self.pool_worker = array("q")  # index into pool_workers
        self.pool_workers: dict[tuple[str, str], int] = {}
        self.decode_requests = array("q")
        self.prefill_tokens = array("q")
        self.context_tokens = array("q")
        self.prefill_attention_tokens2 = array("d")  # NaN where not recorded
        self.weight = array("d")  # steps each span stands for (splitscope.sample.weight, 1 where absent)

    def __len__(self) -> int:
        return len(self.start_ns)

    def append(
        self,
        start_ns: int,
        end_ns: int,
        pool: str,
        worker: str,
        decode_requests: int,
        prefill_tokens: int,
        context_tokens: int,
        prefill_attention_tokens2: float,
        weight: float,
    ) -> None:
        """One step, already checked (tracer.report.tables checks a `Span`; `append_json` its own)."""
        code = self.pool_workers.setdefault((pool, worker), len(self.pool_workers))
        self.start_ns.append(start_ns)
        self.end_ns.append(end_ns)
        self.pool_worker.append(code)
        self.decode_requests.append(decode_requests)
        self.prefill_tokens.append(prefill_tokens)
        self.context_tokens.append(context_tokens)
        self.prefill_attention_tokens2.append(prefill_attention_tokens2)
        self.weight.append(weight)

    def append_json(self, span: JsonSpan) -> bool:
        """Append a decoded OTLP/JSON step span whose attributes are exactly as the contract types them
        (pool and worker non-empty strings, token counts ints, attention work and weight numbers, weight
        >= 1); return False, appending nothing, for anything else, so the caller hands it on as a `Span`
        and `tracer.report.tables` reads or refuses it with its message. Values are those the `Span` path
        would give. The hot loop of the reader: one dict lookup per attribute, no object kept."""
        pool = worker = decode = prefill = context = attention = weight = None
        for kv in span.attributes:
            slot = _STEP_SLOTS.get(kv.key)
            if slot is None:
                continue
            value = kv.value
            if value is None:
                return False
            if slot == 0:
                pool = value
            elif slot == 1:
                worker = value
            elif slot == 2:
                decode = value.intValue
            elif slot == 3:
                prefill = value.intValue
            elif slot == 4:
                context = value.intValue
            elif slot == 5:
                attention = struct_number(value)
                if attention is None:
                    return False
            else:
                weight = struct_number(value)
                if weight is None or not weight >= 1:  # NaN or below 1: the Span path decides
                    return False
        if (
            pool is None
            or worker is None
            or decode is None
            or prefill is None
            or context is None
            or pool.intValue is not None
            or worker.intValue is not None
            or not pool.stringValue
            or not worker.stringValue
        ):
            return False
        # `append`, inlined: this runs once per step span.
        pool_workers = self.pool_workers
        key = (pool.stringValue, worker.stringValue)
        code = pool_workers.get(key)
        if code is None:
            code = pool_workers[key] = len(pool_workers)
        self.start_ns.append(span.startTimeUnixNano)
        self.end_ns.append(span.endTimeUnixNano)
        self.pool_worker.append(code)
        self.decode_requests.append(decode)
        self.prefill_tokens.append(prefill)
        self.context_tokens.append(context)
        self.prefill_attention_tokens2.append(math.nan if attention is None else attention)
        self.weight.append(1.0 if weight is None else weight)
        return True

    def append_proto(self, span: Any) -> bool:
        """`append_json` for an opentelemetry-proto `Span` (a step span of a protobuf record)."""
        pool = worker = decode = prefill = context = attention = weight = None
        for kv in span.attributes:
            slot = _STEP_SLOTS.get(kv.key)
            if slot is None:
                continue
            value = kv.value
            which = value.WhichOneof("value")
            if slot <= 1:
                if which != "string_value" or not value.string_value:
                    return False
                if slot == 0:
                    pool = value.string_value
                else:
                    worker = value.string_value
            elif slot <= 4:
                if which != "int_value":
                    return False
                if slot == 2:
                    decode = value.int_value
                elif slot == 3:
                    prefill = value.int_value
                else:
                    context = value.int_value
            elif which not in _PROTO_NUMBERS:
                return False
            elif slot == 5:
                attention = getattr(value, which)
            else:
                weight = getattr(value, which)
                if not weight >= 1:  # NaN or below 1: the Span path decides
                    return False
        if pool is None or worker is None or decode is None or prefill is None or context is None:
            return False
        self.append(
            span.start_time_unix_nano,
            span.end_time_unix_nano,
            pool,
            worker,
            decode,
            prefill,
            context,
            math.nan if attention is None else attention,
            1.0 if weight is None else weight,
        )
        return True


_PROTO_NUMBERS = frozenset(("int_value", "double_value"))
_STEP_SLOTS = {
    ATTR_POOL: 0,
    ATTR_WORKER: 1,
    ATTR_STEP_DECODE_REQUESTS: 2,
    ATTR_STEP_PREFILL_TOKENS: 3,
    ATTR_STEP_CONTEXT_TOKENS: 4,
    ATTR_STEP_PREFILL_ATTENTION_TOKENS2: 5,
    ATTR_SAMPLE_WEIGHT: 6,
}


def _typed_proto(record: bytes) -> list[Any]:
    """`_typed_line` for a protobuf record: step spans as opentelemetry-proto messages, the others as
    `Span`s. Raises ValueError for a record to be read the generic way (for its message)."""
    out: list[Any] = []
    for resource_spans in parse_proto(record).resource_spans:
        for scope_spans in resource_spans.scope_spans:
            for raw in scope_spans.spans:
                out.append(raw if raw.name == SPAN_STEP else span_from_proto(raw, {}, events=False))
    return out


def _typed_line(line: bytes) -> list[JsonSpan | Span]:
    """A JSON line's spans in order: step spans as decoded structs, the others as `Span`s. Raises one of
    _TYPED_REFUSALS when the line must be read the generic way; builds nothing for the columns yet, so a
    refused line leaves no half of itself behind."""
    out: list[JsonSpan | Span] = []
    for resource_spans in decode_request(line).resourceSpans:
        for scope_spans in resource_spans.scopeSpans:
            for raw in scope_spans.spans:
                out.append(raw if raw.name == SPAN_STEP else span_from_struct(raw))
    return out


def iter_report_spans(
    paths: Sequence[str | os.PathLike[str]],
    *,
    skip_bad: bool = False,
    stats: ReadStats | None = None,
    steps: StepColumns | None = None,
) -> Iterator[Span]:
    """The spans of `paths` the report reads, in file order; with `steps`, well-formed OTLP/JSON step spans
    are appended to it instead of being yielded (the others, steps included, are yielded as `Span`s).

    Lines (records), spans, errors and `skip_bad` counts are those of `tracer.otlp.decode.iter_spans`, except that
    step spans' ids are not checked. Raises TraceFileError naming file and line (record).
    """
    stats = stats if stats is not None else ReadStats()
    for path in paths:
        for trace_format, number, record in iter_counted_records(path, skip_bad=skip_bad, stats=stats):
            typed: list[Any] | None = None
            json = trace_format is TraceFormat.OTLP_JSON
            try:
                typed = _typed_line(record) if json else _typed_proto(record)
            except TYPED_REFUSALS:
                typed = None
            if typed is None:
                yield from record_spans(path, number, trace_format, record, skip_bad=skip_bad, stats=stats)
                continue
            stats.spans += len(typed)
            append = None if steps is None else steps.append_json if json else steps.append_proto
            for item in typed:
                if isinstance(item, Span):
                    yield item
                elif append is None or not append(item):
                    # A step span the columns refused, for the tables to read or name what is wrong; the
                    # report never reads a step's ids, so they are passed through unchecked.
                    yield (
                        span_from_struct(item, checked_ids=False)
                        if json
                        else span_from_proto(item, {}, events=False, checked_ids=False)
                    )
