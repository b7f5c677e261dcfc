"""Small hand-built trace files whose causes are known by construction, for explain's unit tests.

Times are seconds after `EPOCH_NS`; spans are written in the OTLP/JSON shape of
`tests.synthetic.span_dict` (the one `tracer.export.otel.encode_line` writes).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.synthetic import request_line, span_dict
from tracer import spans as s
from tracer.otlp import SPAN_KIND_INTERNAL, SPAN_KIND_SERVER

EPOCH_NS = 1_790_000_000_000_000_000
_ids = itertools.count(1)


def ns(seconds: float) -> int:
    return EPOCH_NS + round(seconds * 1e9)


@dataclass
class Traces:
    spans: list[dict[str, Any]] = field(default_factory=list)

    def _span(self, trace_id: str, parent: str, name: str, start_s: float, end_s: float, attrs: dict, **kw: Any) -> str:
        span_id = f"{next(_ids):016x}"
        kind = SPAN_KIND_SERVER if not parent else SPAN_KIND_INTERNAL
        self.spans.append(
            span_dict(
                trace_id=trace_id,
                span_id=span_id,
                parent_span_id=parent,
                name=name,
                kind=kind,
                start_ns=ns(start_s),
                end_ns=ns(end_s),
                attributes=attrs,
                **kw,
            )
        )
        return span_id

    def request(
        self,
        *,
        arrival_s: float,
        end_s: float,
        ttft_s: float | None = None,
        worker: str = "w0",
        queue: tuple[float, float] | None = None,
        prefill: tuple[float, float, int] | None = None,
        decode: list[tuple[float, float]] | tuple[float, float] | None = None,
        decode_worker: str | None = None,
        itl_p50_s: float | None = None,
        stalls: list[tuple[float, float, int]] = (),  # type: ignore[assignment]
        transfer: tuple[float, float, int] | None = None,  # start, end, clock offset ns
        pool: str = "colocated",
    ) -> str:
        """One request trace; returns its trace id. `stalls`: (token time, gap, prefill tokens) events."""
        trace_id = f"{next(_ids):032x}"
        root_attrs: dict[str, Any] = {
            s.ATTR_OPERATION: "text_completion",
            s.ATTR_MODEL: "m",
            s.ATTR_INPUT_TOKENS: prefill[2] if prefill else 10,
            s.ATTR_OUTPUT_TOKENS: 50,
            s.ATTR_REQUEST_ID: f"req-{trace_id[-4:]}",
            s.ATTR_MODE: "disaggregated" if transfer else "colocated",
        }
        if ttft_s is not None:
            root_attrs[s.ATTR_TTFT_S] = ttft_s
        root = self._span(trace_id, "", "text_completion m", arrival_s, end_s, root_attrs)
        where = {s.ATTR_POOL: "prefill" if transfer else pool, s.ATTR_WORKER: worker}
        if queue:
            self._span(trace_id, root, s.SPAN_QUEUE, *queue, where)
        if prefill:
            attrs = where | {s.ATTR_PREFILL_TOKENS: prefill[2], s.ATTR_PREFILL_CACHED_TOKENS: 0}
            self._span(trace_id, root, s.SPAN_PREFILL, prefill[0], prefill[1], attrs)
        d_worker = decode_worker or worker
        d_where = {s.ATTR_POOL: "decode" if transfer else pool, s.ATTR_WORKER: d_worker}
        if transfer:
            kv = {s.ATTR_KV_BYTES: 1000, s.ATTR_CLOCK_OFFSET_NS: transfer[2]}
            parent = self._span(trace_id, root, s.SPAN_KV_TRANSFER, transfer[0], transfer[1], where | kv)
            self._span(trace_id, parent, s.SPAN_KV_RECV, transfer[0], transfer[1], d_where | kv)
        pieces = [decode] if isinstance(decode, tuple) else (decode or [])
        for piece in pieces:
            attrs = dict(d_where)
            if itl_p50_s is not None:
                attrs |= {s.ATTR_DECODE_ITL_P50_S: itl_p50_s, s.ATTR_DECODE_ITL_P99_S: 3 * itl_p50_s}
                root_attrs[s.ATTR_ITL_P99_S] = 3 * itl_p50_s
            events = [
                (s.EVENT_DECODE_STALL, ns(t), {"gap_s": gap, "prefill_tokens": tokens})
                for t, gap, tokens in stalls
                if piece[0] <= t <= piece[1]
            ]
            self._span(trace_id, root, s.SPAN_DECODE, piece[0], piece[1], attrs, events=events)
        return trace_id

    def step(self, worker: str, start_s: float, end_s: float, prefill_tokens: int = 0, weight: float = 1) -> None:
        attrs = {
            s.ATTR_POOL: "colocated",
            s.ATTR_WORKER: worker,
            s.ATTR_STEP_DECODE_REQUESTS: 2,
            s.ATTR_STEP_PREFILL_TOKENS: prefill_tokens,
            s.ATTR_STEP_CONTEXT_TOKENS: 100,
            s.ATTR_SAMPLE_WEIGHT: weight,
        }
        self._span(f"{0xABC:032x}", "", s.SPAN_STEP, start_s, end_s, attrs)

    def write(self, path: Path) -> Path:
        # The root spans last: a reader must join a trace whatever order its spans come in.
        ordered = sorted(self.spans, key=lambda span: "parentSpanId" not in span)
        path.write_text(request_line([({"service.name": "test"}, ordered)]), encoding="utf-8")
        return path
