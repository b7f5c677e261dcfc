"""What the hot path writes: stage and step records, and the bounded ring that holds them.

Records hold only ints, floats, short strings, clock marks and (for decode) two `array` buffers of token
times: nothing the engine loop must allocate per token. The pipeline thread turns them into spans and
metrics (pipeline.py).

`RecordRing` is a drop-oldest ring over `collections.deque`: `append` and `popleft` are atomic in CPython,
so producers (engine threads) append with no lock and no counter. The oldest records beyond its capacity
are dropped and counted off the hot path (see `RecordRing`).
"""

from __future__ import annotations

import gc
import os
import threading
import weakref
from array import array
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

# The hot path pushes plain tuples (a NamedTuple's constructor costs three times a tuple display);
# the first field says which record it is, and the pipeline views it through the NamedTuples below.
# Trace contexts are kept as the engine's immutable TraceContext objects: reading their fields is the
# pipeline's job.
KIND_STAGE = 0
KIND_STAGE_WALL = 1
KIND_DECODE = 2
KIND_STEP = 3
KIND_REQUEST = 4


class StageRecord(NamedTuple):
    """One stage of one request. `start`/`end` are marks of the tracer's clock (KIND_STAGE) or Unix ns
    measured elsewhere, e.g. by the KV transfer (KIND_STAGE_WALL). `span_id` 0 means "assign one"."""

    kind: int
    stage: str
    ctx: Any  # tracer.spans.TraceContext: the parent
    span_id: int
    start: Any
    end: Any
    attrs: dict[str, Any] | None
    error_type: str


class DecodeRecord(NamedTuple):
    """The decode stage of one request. `token_perf_ns[i]`: host perf_counter_ns at which token i
    reached the host; `token_prefill_tokens[i]`: prefill tokens that shared its step (or None)."""

    kind: int  # KIND_DECODE
    ctx: Any
    start: Any
    end: Any
    attrs: dict[str, Any] | None
    error_type: str
    token_perf_ns: array
    token_prefill_tokens: array | None


class StepRecord(NamedTuple):
    """One engine iteration on one worker: the raw material of the interference measure."""

    kind: int  # KIND_STEP
    start: Any
    end: Any
    decode_requests: int
    prefill_tokens: int
    context_tokens: int
    prefill_attention_tokens2: int  # tokens^2 of the chunks' attention over their prompts; -1: not recorded
    # The host perf_counter_ns stamped on the tokens this step emitted (the decode record's
    # `token_perf_ns` entries), 0 when not given; and the prompts it prefilled, as (trace id, prefill span
    # id, tokens of its chunk) per prompt: what the pipeline links a stalled decode span to.
    emitted_perf_ns: int
    prefills: tuple[tuple[int, int, int], ...]


class RequestRecord(NamedTuple):
    """The router's view of one request: the root span and the client-facing latency metrics.

    Times are the clock's marks. `first_token`, when not None, is the mark at which the first token was
    sent to the client; `token_gap_s` holds the inter-token gaps the client saw (seconds), 0.0 for a token that
    reached it in the same stream event as the token before (counted as `splitscope.itl_joined_tokens`).
    """

    kind: int  # KIND_REQUEST
    ctx: Any  # the client's context (span_id 0 when the client sent none)
    span_id: int
    start: Any
    end: Any
    first_token: Any
    model: str
    mode: str
    request_id: str
    input_tokens: int
    output_tokens: int
    token_gap_s: array | None
    error_type: str
    operation: str  # gen_ai.operation.name: text_completion | chat (the root span's name prefix)


RECORD_TYPES: dict[int, Any] = {  # record kind -> its NamedTuple view
    KIND_STAGE: StageRecord,
    KIND_STAGE_WALL: StageRecord,
    KIND_DECODE: DecodeRecord,
    KIND_STEP: StepRecord,
    KIND_REQUEST: RequestRecord,
}


class RecordRing:
    """Bounded multi-producer, single-consumer ring; drop-oldest beyond `capacity`, every drop counted in
    `dropped`: each record appended is either drained or counted, exactly.

    Producers call `append` (the deque's own method: atomic, never blocks): that is the whole hot path,
    no counter and no length check. The bound is kept off the hot path by `trim()`, which pops the oldest
    records beyond `capacity` and counts each one. The consumer trims on every `drain` (the pipeline every
    `interval_s`: its sink never blocks it); between drains a garbage-collector callback trims too. That
    callback runs often because holding records is what makes CPython collect: every record a producer
    adds is a new GC-tracked tuple, so a young-generation collection starts at least every
    `gc.get_threshold()[0]` of them (700 by default) once the tuple free list (2,000) is used up.

    The deque itself has no `maxlen`, on purpose: a deque drops past its `maxlen` silently, and that can
    be reached. While one thread runs a collection (and so this ring's callback), CPython starts no other:
    when that callback waits for the interpreter lock, the other producers append unchecked for a switch
    interval or more (`sys.getswitchinterval()`, 5 ms: tens of thousands of records in a tight loop). So
    the ring may briefly hold more than `capacity` (a collection or drain later trims it, counting), and
    in a process that disables the collector it holds what arrives between two drains.
    After `fork`, the child starts with an empty ring (the records belong to the parent's exporter).
    """

    def __init__(self, capacity: int = 65536) -> None:
        if capacity < 2:
            raise ValueError("ring capacity must be at least 2")
        self.capacity = capacity
        self._reset()
        call_in_child_after_fork(self._reset)
        self._gc_callback = _trim_on_collect(weakref.ref(self))
        gc.callbacks.append(self._gc_callback)
        weakref.finalize(self, _forget_callback, self._gc_callback)

    def _reset(self) -> None:
        self._items: deque[Any] = deque()  # no maxlen: its drops could not be counted (see the class)
        self.append = self._items.append
        self._counting = threading.Lock()  # guards `dropped` only; renewed here in case fork caught it held
        self.dropped = 0

    def drain(self, max_items: int) -> list[Any]:
        """Up to `max_items` records, oldest first, after trimming to capacity. Consumer thread only."""
        self.trim()
        pop = self._items.popleft
        out: list[Any] = []
        take = out.append
        try:
            for _ in range(min(max_items, len(self._items))):
                take(pop())
        except IndexError:  # a collection's trim on another thread got there first
            pass
        return out

    def trim(self) -> None:
        """Drop the oldest records beyond `capacity` and count each one. Any thread; never waits for the
        consumer. Two trims at once (the consumer's and a collection's) may together drop a record or two
        below capacity; each one they drop is still counted once."""
        items = self._items
        if len(items) <= self.capacity:
            return
        pop = items.popleft
        popped = 0
        try:
            while len(items) > self.capacity:
                pop()
                popped += 1
        except IndexError:  # the other trim or the consumer emptied it meanwhile
            pass
        with self._counting:
            self.dropped += popped

    def close(self) -> None:
        """Stop trimming from the collector (the session is over); idempotent."""
        _forget_callback(self._gc_callback)

    def __len__(self) -> int:
        return len(self._items)


def _trim_on_collect(ring_ref: weakref.ref[RecordRing]) -> Callable[[str, dict[str, int]], None]:
    """A `gc.callbacks` entry that trims the ring at the start of each collection. It holds the ring
    weakly, so a ring nobody uses is freed (and its callback removed by its finalizer)."""

    def on_collect(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            ring = ring_ref()
            if ring is not None:
                ring.trim()

    return on_collect


def _forget_callback(callback: Callable[[str, dict[str, int]], None]) -> None:
    try:
        gc.callbacks.remove(callback)
    except ValueError:
        pass


def call_in_child_after_fork(method: Callable[[], None]) -> None:
    """Run the bound `method` in every child after `fork`, for as long as its object lives (held weakly:
    `os.register_at_fork` keeps its callables for the life of the process)."""
    method_ref = weakref.WeakMethod(method)

    def in_child() -> None:
        alive = method_ref()
        if alive is not None:
            alive()

    os.register_at_fork(after_in_child=in_child)
