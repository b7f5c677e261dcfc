"""What the hot path writes: stage and step records, and the bounded ring that holds them.

Records hold only ints, floats, short strings, clock marks and (for decode) two `array` buffers of token
times: nothing the engine loop must allocate per token. The pipeline thread turns them into spans and
metrics (pipeline.py).

`RecordRing` is a drop-oldest ring over `collections.deque(maxlen=...)`: `append` and `popleft` are atomic
in CPython, so producers (engine threads) and the one consumer (the pipeline thread) need no lock. When
it is full, the oldest record is dropped and counted.
"""

from __future__ import annotations

import itertools
import os
from array import array
from collections import deque
from typing import Any, NamedTuple

STAGE_QUEUE = "queue"
STAGE_PREFILL = "prefill"
STAGE_KV_TRANSFER = "kv_transfer"
STAGE_KV_SEND = "kv_transfer.send"
STAGE_KV_RECV = "kv_transfer.recv"
STAGE_DECODE = "decode"
STAGES = (STAGE_QUEUE, STAGE_PREFILL, STAGE_KV_TRANSFER, STAGE_KV_SEND, STAGE_KV_RECV, STAGE_DECODE)


# The hot path pushes plain tuples (a NamedTuple's constructor costs three times a tuple display);
# the first field says which record it is, and the pipeline views it through the NamedTuples below.
# The last field is the ring's sequence number (drop accounting). Trace contexts are kept as the
# engine's immutable TraceContext objects: reading their fields is the pipeline's job.
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
    seq: int


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
    seq: int


class StepRecord(NamedTuple):
    """One engine iteration on one worker: the raw material of the interference measure."""

    kind: int  # KIND_STEP
    start: Any
    end: Any
    decode_requests: int
    prefill_tokens: int
    context_tokens: int
    seq: int


class RequestRecord(NamedTuple):
    """The router's view of one request: the root span and the client-facing latency metrics.

    Times are the clock's marks. `first_token`, when not None, is the mark at which the first token was
    sent to the client; `token_gap_s` holds the inter-token gaps the client saw (seconds).
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
    seq: int


RECORD_TYPES = {
    KIND_STAGE: StageRecord,
    KIND_STAGE_WALL: StageRecord,
    KIND_DECODE: DecodeRecord,
    KIND_STEP: StepRecord,
    KIND_REQUEST: RequestRecord,
}


class RecordRing:
    """Bounded multi-producer, single-consumer ring; drop-oldest when full, drops counted exactly.

    Producers call `append` (the deque's own method: atomic, never blocks) with a record whose last field
    is `next(ring.seq)`. The consumer counts drops as sequence numbers that never arrived, so the hot path
    pays for no counter of its own. Two producer threads can append slightly out of sequence order (a
    thread switch between `next(seq)` and `append`), so a sequence number is declared dropped only one
    drain later, once every producer has had a whole drain interval to append it. After `fork`, the
    child starts with an empty ring (the records belong to the parent's exporter).
    """

    def __init__(self, capacity: int = 65536) -> None:
        if capacity < 2:
            raise ValueError("ring capacity must be at least 2")
        self.capacity = capacity
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._items: deque[Any] = deque(maxlen=self.capacity)
        self.append = self._items.append
        self.seq = itertools.count()
        self._accounted_below = 0  # every sequence number below this is either drained or counted dropped
        self._seen_above: list[int] = []  # drained sequence numbers >= _accounted_below
        self._settle_below = 0  # one past the highest number of the previous drain
        self.dropped = 0

    def push(self, record: Any) -> None:
        """Append a record (for callers that do not hold `append`)."""
        self.append(record)

    def drain(self, max_items: int) -> list[Any]:
        """Up to `max_items` records, oldest first, and updates `dropped`. Consumer thread only."""
        items = self._items
        pop = items.popleft
        out = [pop() for _ in range(min(max_items, len(items)))]
        seqs = [record[-1] for record in out]
        self._settle(self._settle_below, seqs)
        if seqs:
            self._settle_below = max(self._settle_below, max(seqs) + 1)
        return out

    def settle_all(self) -> None:
        """Count as dropped every number handed out and never drained (at shutdown, producers stopped)."""
        highest = max([self._settle_below - 1, *self._seen_above], default=-1)
        self._settle(highest + 1, [])

    def _settle(self, bound: int, new_seqs: list[int]) -> None:
        seen = self._seen_above
        seen.extend(new_seqs)
        if bound <= self._accounted_below:
            return
        arrived = sum(1 for s in seen if s < bound)
        self.dropped += (bound - self._accounted_below) - arrived
        self._seen_above = [s for s in seen if s >= bound]
        self._accounted_below = bound

    def __len__(self) -> int:
        return len(self._items)
