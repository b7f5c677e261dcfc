"""What the hot path writes: stage and step records, and the bounded ring that holds them.

Records hold only ints, floats, short strings, clock marks and (for decode) two `array` buffers of token
times: nothing the engine loop must allocate per token. The pipeline thread turns them into spans and
metrics (pipeline.py).

`RecordRing` is a drop-oldest ring over `collections.deque(maxlen=...)`: `append` and `popleft` are atomic
in CPython, so producers (engine threads) and the one consumer (the pipeline thread) need no lock. When
it is full, the oldest record is dropped and counted.
"""

from __future__ import annotations

import os
import threading
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


class StageRecord(NamedTuple):
    """One stage of one request, as the engine saw it.

    `start`/`end` are marks of the tracer's clock, or wall-clock ns when `wall` is True (times measured
    elsewhere, e.g. by the KV transfer). `attrs` maps span attribute names to values. For decode,
    `token_perf_ns` holds the host time each output token became available and `token_prefill_tokens` the
    prefill tokens that shared that token's step (for stall attribution); both are `array`s, else None.
    """

    stage: str
    trace_id: int
    span_id: int
    parent_span_id: int
    start: Any
    end: Any
    attrs: dict[str, Any]
    error_type: str = ""
    wall: bool = False
    token_perf_ns: array | None = None
    token_prefill_tokens: array | None = None


class StepRecord(NamedTuple):
    """One engine iteration on one worker: the raw material of the interference measure."""

    start: Any
    end: Any
    decode_requests: int
    prefill_tokens: int
    context_tokens: int


class RequestRecord(NamedTuple):
    """The router's view of one request: the root span and the client-facing latency metrics.

    Times are the clock's marks. `first_token`, when not None, is the mark at which the first token was
    sent to the client; `token_gap_s` holds the inter-token gaps the client saw (seconds).
    """

    trace_id: int
    span_id: int
    parent_span_id: int
    start: Any
    end: Any
    first_token: Any
    model: str
    mode: str
    request_id: str
    input_tokens: int
    output_tokens: int
    token_gap_s: array | None
    error_type: str = ""


class RecordRing:
    """Bounded multi-producer, single-consumer ring; drop-oldest when full, drops counted.

    `push` never blocks. It sets `wakeup` when the ring passes half full, so the consumer can sleep on it
    between periodic drains. The drop counter may under-count by a few under heavy concurrent pushes from
    several threads (an unlocked `+=`); that is the price of a lock-free hot path. After `fork`, the child
    starts with an empty ring (the records belong to the parent's exporter).
    """

    def __init__(self, capacity: int = 65536) -> None:
        if capacity < 2:
            raise ValueError("ring capacity must be at least 2")
        self.capacity = capacity
        self._wake_at = capacity // 2
        self._items: deque[Any] = deque(maxlen=capacity)
        self.dropped = 0
        self.wakeup = threading.Event()
        os.register_at_fork(after_in_child=self._reset_after_fork)

    def _reset_after_fork(self) -> None:
        self._items = deque(maxlen=self.capacity)
        self.dropped = 0
        self.wakeup = threading.Event()

    def push(self, record: Any) -> None:
        items = self._items
        size = len(items)
        if size >= self._wake_at:
            if size >= self.capacity:
                self.dropped += 1
            self.wakeup.set()
        items.append(record)

    def drain(self, max_items: int) -> list[Any]:
        """Up to `max_items` records, oldest first. Consumer thread only."""
        items = self._items
        out = []
        pop = items.popleft
        for _ in range(min(max_items, len(items))):
            out.append(pop())
        return out

    def __len__(self) -> int:
        return len(self._items)
