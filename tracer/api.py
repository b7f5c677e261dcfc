"""The tracer interface engine code calls (the engine never touches the OpenTelemetry SDK).

    tracer = start_tracing(pool="colocated", worker="w0", traces_file="traces.jsonl").tracer  # a Tracer
    t0 = tracer.mark()
    ...                                             # the stage's work
    tracer.stage("prefill", ctx, t0, tracer.mark(), {ATTR_PREFILL_TOKENS: 2000})

Every method runs on the calling (engine) thread, never blocks and never synchronises a device: it
builds one record tuple and pushes it into a bounded ring. `NoopTracer` has the same methods and does
nothing, so instrumented code costs a method call when tracing is off.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from tracer.context import TraceContext
from tracer.records import (
    KIND_DECODE,
    KIND_REQUEST,
    KIND_STAGE,
    KIND_STAGE_WALL,
    KIND_STEP,
    RecordRing,
    call_in_child_after_fork,
)
from tracer.vocabulary import OPERATION_TEXT_COMPLETION


@runtime_checkable
class Tracer(Protocol):
    """What engine code calls: `RecordingTracer` when tracing is on, `NoopTracer` when it is off.

    Every method runs on the calling (engine) thread, never blocks and never synchronises a device.
    """

    enabled: bool

    def mark(self) -> Any: ...

    def stage(
        self,
        stage: str,
        ctx: TraceContext,
        start: Any,
        end: Any,
        attrs: dict[str, Any] | None = None,
        span_id: int = 0,
        error_type: str = "",
    ) -> int: ...

    def stage_wall(
        self,
        stage: str,
        ctx: TraceContext,
        start_wall_ns: int,
        end_wall_ns: int,
        attrs: dict[str, Any] | None = None,
        span_id: int = 0,
        error_type: str = "",
    ) -> int: ...

    def decode(
        self,
        ctx: TraceContext,
        start: Any,
        end: Any,
        token_perf_ns: array,
        token_prefill_tokens: array | None,
        attrs: dict[str, Any] | None = None,
        error_type: str = "",
    ) -> int: ...

    def step(
        self,
        start: Any,
        end: Any,
        decode_requests: int,
        prefill_tokens: int,
        context_tokens: int,
        prefill_attention_tokens2: int = -1,
        emitted_perf_ns: int = 0,
        prefills: tuple[tuple[int, int, int], ...] = (),
    ) -> None: ...

    def request(
        self,
        ctx: TraceContext,
        span_id: int,
        start: Any,
        end: Any,
        first_token: Any,
        *,
        model: str,
        mode: str,
        request_id: str,
        input_tokens: int,
        output_tokens: int,
        token_gap_s: array | None = None,
        error_type: str = "",
        operation: str = OPERATION_TEXT_COMPLETION,
    ) -> None: ...


class RecordingTracer:
    """Records stages, steps and requests of one worker (or the router) into a ring (a `Tracer`).

    `mark()` is the clock's mark function (host `perf_counter_ns`, or a CUDA event record). A mark
    belongs to the one record it is passed to: on CUDA its event returns to a free list once that record
    resolves, so take a fresh mark for every start and end rather than sharing one between records.
    `ctx` is the request's TraceContext: the new span becomes a child of `ctx.span_id` in `ctx.trace_id`.

    The recording methods (`stage`, `stage_wall`, `decode`, `step`, `request`; documented in
    `_recorders`) are closures over the ring's `append`, rebuilt after `fork` when the ring renews its
    deque. A closure call with positional parameters skips method binding, attribute lookups and
    keyword-only argument handling: about 25 of the 220 ns a stage cost as a method
    (bench/tracer_overhead.py).
    """

    enabled = True
    stage: Callable[..., int]
    stage_wall: Callable[..., int]
    decode: Callable[..., int]
    step: Callable[..., None]
    request: Callable[..., None]

    def __init__(self, clock: Any, ring: RecordRing) -> None:
        self.clock = clock
        self.ring = ring
        self.mark = clock.mark
        self._bind_ring()
        call_in_child_after_fork(self._bind_ring)  # the ring renews its deque in a child

    def _bind_ring(self) -> None:
        self.stage, self.stage_wall, self.decode, self.step, self.request = _recorders(self.ring.append)


def _recorders(push: Callable[[tuple], None]) -> tuple[Callable[..., Any], ...]:
    """The hot-path functions of one Tracer; each pushes one record tuple."""

    def stage(
        stage: str,
        ctx: TraceContext,
        start: Any,
        end: Any,
        attrs: dict[str, Any] | None = None,
        span_id: int = 0,
        error_type: str = "",
    ) -> int:
        """Record one stage span. Its span id is `span_id` when given (chosen beforehand because it was
        already propagated to another process as a parent), else assigned off the hot path."""
        push((KIND_STAGE, stage, ctx, span_id, start, end, attrs, error_type))
        return span_id

    def stage_wall(
        stage: str,
        ctx: TraceContext,
        start_wall_ns: int,
        end_wall_ns: int,
        attrs: dict[str, Any] | None = None,
        span_id: int = 0,
        error_type: str = "",
    ) -> int:
        """Like `stage`, for times already on the wall clock (measured by another component)."""
        push((KIND_STAGE_WALL, stage, ctx, span_id, start_wall_ns, end_wall_ns, attrs, error_type))
        return span_id

    def decode(
        ctx: TraceContext,
        start: Any,
        end: Any,
        token_perf_ns: array,
        token_prefill_tokens: array | None,
        attrs: dict[str, Any] | None = None,
        error_type: str = "",
    ) -> int:
        """Record the decode span (its span id is assigned off the hot path; returns 0). `token_perf_ns[i]`
        is the host `perf_counter_ns` at which token i reached the host; `token_prefill_tokens[i]` the
        prefill tokens in the step that produced it. The arrays are handed over: do not append to them
        afterwards."""
        push((KIND_DECODE, ctx, start, end, attrs, error_type, token_perf_ns, token_prefill_tokens))
        return 0

    def step(
        start: Any,
        end: Any,
        decode_requests: int,
        prefill_tokens: int,
        context_tokens: int,
        prefill_attention_tokens2: int = -1,
        emitted_perf_ns: int = 0,
        prefills: tuple[tuple[int, int, int], ...] = (),
    ) -> None:
        """Record one engine iteration. `prefill_attention_tokens2`: each prefill chunk of n tokens at
        offset c counts (c + n)^2 - c^2 (tokens^2; -1 when the engine does not know). `emitted_perf_ns`:
        the `perf_counter_ns` the engine stamped on the tokens this step emitted (the decode records'
        token times); `prefills`: (trace id, prefill span id, chunk tokens) of each prompt it prefilled,
        the prefill span id being the one its `stage("prefill", ..., span_id=...)` will carry. With both,
        the pipeline links a decode span's stalls to those prefills (architecture.md section 4)."""
        push(
            (
                KIND_STEP,
                start,
                end,
                decode_requests,
                prefill_tokens,
                context_tokens,
                prefill_attention_tokens2,
                emitted_perf_ns,
                prefills,
            )
        )

    def request(
        ctx: TraceContext,
        span_id: int,
        start: Any,
        end: Any,
        first_token: Any,
        *,
        model: str,
        mode: str,
        request_id: str,
        input_tokens: int,
        output_tokens: int,
        token_gap_s: array | None = None,
        error_type: str = "",
        operation: str = OPERATION_TEXT_COMPLETION,
    ) -> None:
        """Record the router's root span (`{operation} {model}`: `text_completion` or `chat`) and the
        client-facing latencies. Once per request, so its keyword-only fields cost nothing that matters."""
        push(
            (
                KIND_REQUEST,
                ctx,
                span_id,
                start,
                end,
                first_token,
                model,
                mode,
                request_id,
                input_tokens,
                output_tokens,
                token_gap_s,
                error_type,
                operation,
            )
        )

    return stage, stage_wall, decode, step, request


def _zero() -> int:
    return 0


class NoopTracer:
    """Tracing off: the same signatures, no work."""

    enabled = False
    mark = staticmethod(_zero)

    def stage(
        self, stage: str, ctx: Any, start: Any, end: Any, attrs: Any = None, span_id: int = 0, error_type: str = ""
    ) -> int:
        return span_id

    def stage_wall(
        self,
        stage: str,
        ctx: Any,
        start_wall_ns: int,
        end_wall_ns: int,
        attrs: Any = None,
        span_id: int = 0,
        error_type: str = "",
    ) -> int:
        return span_id

    def decode(self, *args: Any, **kwargs: Any) -> int:
        return 0

    def step(self, *args: Any, **kwargs: Any) -> None:
        pass

    def request(self, *args: Any, **kwargs: Any) -> None:
        pass
