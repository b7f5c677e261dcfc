"""The engine loop of one worker: scheduler -> model.forward -> sample -> tokens to the host, on one thread.

`Engine` owns the model, the KV pool, the block allocator and the scheduler. Its thread runs iterations;
other threads talk to it only through `submit`, `expect_kv`, `kv_arrived`, `kv_failed`, `abort` and
`finish_handoff`, which append a command to its inbox (a deque; new requests are refused with
`QueueFull` past `max_waiting_requests`, every other command is bounded by the requests already live)
and wake it. None of them blocks.

Per iteration the thread takes the sampled tokens to the host once (`.tolist()`, where the host waits
for the device anyway; on CUDA the clock's anchor is taken right there), then hands every token event of
the step to `deliver(batch)` in one call -- the worker turns that into one `loop.call_soon_threadsafe`.

Tracing (architecture.md §4): one `tracer.step` per iteration; per request a `queue` span (arrival -> the step that
starts its prefill), a `prefill` span (that step's start -> the end of the step that produced the first
token), and on colocated and decode workers a `decode` span with each token's host time and the prefill
tokens that shared its step. Marks are never shared between two records: a CUDA clock recycles a record's
events once it is resolved, so every span start/end takes its own mark.

Stage boundaries are taken so that a request's stages never overlap (docs/architecture.md, section 4):
the queue ends at the host time of the prefill's start mark; the prefill's end mark (and, colocated, the
decode's start mark) is taken right after the step's end mark, before the scheduler's bookkeeping (which
can wait for the interpreter lock); on a prefill worker the KV transfer starts at the host time of that
same end mark, so on the host clock each boundary is one number shared by both stages.

Blocks are touched by the engine thread and, on a decode worker, by the KV receiver's threads (it
allocates destination blocks as a transfer starts): `allocator_lock` serialises the two; the engine holds
it only around scheduler calls, never around the forward.

Capacity on a decode worker is waited for, within a bound (`kv_wait_s`), never failed with a 500: a
transfer short of destination blocks waits in `allocate_blocks` (the receiver's thread) for blocks to come
back, and an arrived prompt short of the blocks to grow to its whole length is parked, first come first
served, holding its KV. Past the bound the request gets a 503 (the client retries). A request aborted by
its client leaves wherever it is -- queued, parked, running -- and its blocks go back at once.
"""

from __future__ import annotations

import logging
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from reference_server.kv_cache import BlockAllocator, BlockTable, KVCachePool, OutOfBlocks, blocks_for_tokens
from reference_server.model import SeqSlice, Transformer, multinomial_sample_one_no_sync, sample_no_sync
from reference_server.scheduler import (
    QueueFull,
    Request,
    RequestRejected,
    ScheduledRequest,
    Scheduler,
    SeqState,
    StepPlan,
)
from tracer import TraceContext
from tracer import spans as s
from tracer.metrics import KV_FAILURE_REFUSED, WorkerMetrics
from tracer.timing import perf_counter_ns
from tracer.vocabulary import POLICY_OF_ROLE, POOL_OF_ROLE, Role, Stage

log = logging.getLogger(__name__)

KV_REFUSED = KV_FAILURE_REFUSED  # the KV transfer failure reason for "the receiver had no room"

# A loop iteration that raises this many times in a row is a deterministic failure, not bad luck.
MAX_CONSECUTIVE_LOOP_FAILURES = 8

# Events handed to a request's sink, as tuples (cheap to build on the hot path):
#   (EVENT_TOKEN, token_id)
#   (EVENT_DONE, finish_reason, info)          info: prompt_tokens, cached_tokens, output_tokens, ...
#   (EVENT_ERROR, http_status, error_type, message)
EVENT_TOKEN = "token"
EVENT_DONE = "done"
EVENT_ERROR = "error"

Sink = Callable[[tuple], None]
Deliver = Callable[[list[tuple[Sink, tuple]]], None]


@dataclass
class Tracked:
    """One request as the engine follows it. Engine thread only, once submitted."""

    request: Request
    ctx: TraceContext
    sink: Sink
    arrival_perf_ns: int
    generator: torch.Generator | None = None
    kv_dst: tuple[str, int] | None = None  # prefill role: the decode worker's KV receiver
    kv_dst_worker: str = ""
    remote_cached_tokens: int = 0  # decode role: prefix-cache hits on the prefill worker
    seq: ScheduledRequest | None = None
    prefill_start: Any = None  # clock mark at the start of the step that began its prefill
    prefill_end: Any = None  # clock mark at the end of the step that completes its prompt
    prefill_span_id: int = 0  # chosen when its prefill starts, so the steps that run it can name it
    handoff_wall_ns: int = 0  # prefill role: where its KV transfer starts (the host time of `prefill_end`)
    decode_start: Any = None  # clock mark when its first token reached the host
    token_perf_ns: array = field(default_factory=lambda: array("q"))
    token_prefill_tokens: array = field(default_factory=lambda: array("i"))


@dataclass
class _Arrived:
    """Decode role: a request whose prompt KV arrived (its blocks held) and that waits to be scheduled."""

    tracked: Tracked
    block_ids: list[int]
    first_token: int
    deadline_s: float  # time.monotonic() after which it is refused (503) if the cache is still short


class Engine:
    """One worker's model, KV cache and scheduler, driven by `run()` on a dedicated thread.

    `role` is `colocated`, `chunked`, `prefill` or `decode`. `deliver` is called on the engine thread
    once per iteration with that iteration's (sink, event) pairs; it must not block. Prefill role:
    `on_handoff(tracked, first_token_id, handoff_wall_ns)` is called on the engine thread when a prompt
    is done (it must not block: it queues the KV transfer); `finish_handoff` then frees the blocks.
    """

    def __init__(
        self,
        *,
        role: Role | str,
        model: Transformer,
        kv_pool: KVCachePool,
        token_budget: int,
        max_batch_seqs: int,
        tracer: Any,
        metrics: WorkerMetrics | None,
        deliver: Deliver,
        max_waiting_requests: int = 256,
        anchor: Callable[[], None] | None = None,
        on_handoff: Callable[[Tracked, int, int], None] | None = None,
        kv_address: str = "",
        kv_wait_s: float = 5.0,
        on_fatal: Callable[[str], object] | None = None,  # its return value is ignored
    ) -> None:
        if role not in POLICY_OF_ROLE:
            raise ValueError(f"unknown worker role {role!r}; choose one of {', '.join(POLICY_OF_ROLE)}")
        self.role = Role(role)
        self.pool_name = POOL_OF_ROLE[self.role]
        self.model = model
        self.kv_pool = kv_pool
        self.device = model.device
        self.allocator = BlockAllocator(kv_pool.num_blocks, kv_pool.block_size)
        self.scheduler = Scheduler(
            POLICY_OF_ROLE[self.role],
            token_budget,
            max_batch_seqs,
            self.allocator,
            max_context_tokens=model.args.max_seq_len,
            max_waiting_requests=max_waiting_requests,
        )
        self.allocator_lock = threading.Lock()
        # Notified whenever blocks go back to the allocator: a KV receiver waiting for room wakes up.
        self._room = threading.Condition(self.allocator_lock)
        self.kv_wait_s = kv_wait_s
        self.tracer = tracer
        self.clock = getattr(tracer, "clock", None)
        self.metrics = metrics
        self.deliver = deliver
        self.max_waiting_requests = max_waiting_requests
        self._anchor = anchor
        self.on_handoff = on_handoff
        self.kv_address = kv_address
        self._inbox: deque[tuple] = deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._tracked: dict[str, Tracked] = {}
        self._expected: dict[str, Tracked] = {}  # decode workers: waiting for their KV to arrive
        self._parked: deque[_Arrived] = deque()  # decode workers: KV arrived, waiting for room to grow into
        self._thread: threading.Thread | None = None
        self.steps_total = 0
        self._on_fatal = on_fatal
        self.fatal_error = ""  # set when the loop gave up (MAX_CONSECUTIVE_LOOP_FAILURES)

    # ------------------------------------------------------------------------------ any thread

    def start(self) -> Engine:
        self._thread = threading.Thread(target=self.run, name=f"engine-{self.role}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the loop after its current iteration; blocks up to `timeout_s`."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _post(self, command: tuple) -> None:
        self._inbox.append(command)
        self._wake.set()

    def _admit_check(self) -> None:
        # An approximate bound (read without a lock): the scheduler's own bound is exact.
        waiting = len(self._inbox) + self.scheduler.num_waiting + len(self._expected) + len(self._parked)
        if waiting >= self.max_waiting_requests:
            raise QueueFull(f"worker queue is full ({self.max_waiting_requests} requests waiting)")

    def submit(
        self,
        request: Request,
        ctx: TraceContext,
        sink: Sink,
        *,
        seed: int | None = None,
        kv_dst: tuple[str, int] | None = None,
        kv_dst_worker: str = "",
    ) -> None:
        """Queue a new prompt (colocated, chunked, prefill roles; prefill takes `kv_dst`, the decode
        worker's KV receiver). Raises QueueFull; never blocks."""
        self._admit_check()
        if self.role == Role.PREFILL and kv_dst is None:
            raise RequestRejected("a prefill worker needs the KV destination of the request")
        tracked = Tracked(request, ctx, sink, perf_counter_ns(), self._generator(request, seed), kv_dst, kv_dst_worker)
        self._post(("submit", tracked))

    def expect_kv(self, request: Request, ctx: TraceContext, sink: Sink, *, seed: int | None = None) -> None:
        """Decode role: a request whose KV will arrive from a prefill worker. Raises QueueFull."""
        self._admit_check()
        # Decode draws start from seed + 1: the prefill worker drew the first token from `seed`.
        next_seed = None if seed is None else seed + 1
        self._post(("expect", Tracked(request, ctx, sink, perf_counter_ns(), self._generator(request, next_seed))))

    def kv_arrived(self, request_id: str, block_ids: list[int], meta: dict[str, Any], info: Any) -> None:
        """KV receiver callback (receiver thread): the blocks now belong to this engine."""
        self._post(("arrived", request_id, block_ids, meta, info))

    def kv_failed(self, request_id: str, reason: str) -> None:
        """KV receiver callback (receiver thread): the transfer failed; its blocks are already freed."""
        self._post(("kv_failed", request_id, reason))

    def abort(self, request_id: str, reason: str = "aborted") -> None:
        """The client went away: end the request wherever it is, freeing its blocks."""
        self._post(("abort", request_id, reason))

    def finish_handoff(self, request_id: str) -> None:
        """Prefill role: the KV transfer of `request_id` ended (either way); free its blocks."""
        self._post(("finish", request_id))

    def allocate_blocks(self, count: int) -> list[int] | None:
        """KV receiver callback (a receiver connection thread): `count` destination blocks, or None when
        the cache stays short. Blocks up to `kv_wait_s` for running requests to give blocks back, so a
        burst waits for room instead of failing; the receiver then refuses, and the client gets a 503."""
        deadline_s = time.monotonic() + self.kv_wait_s
        with self._room:
            while True:
                try:
                    return self.allocator.allocate(count)
                except OutOfBlocks:
                    pass
                remaining_s = deadline_s - time.monotonic()
                if remaining_s <= 0 or self._stop.is_set() or count > self.allocator.num_blocks:
                    return None
                self._room.wait(remaining_s)

    def free_blocks(self, block_ids: Sequence[int]) -> None:
        """KV receiver callback: give back the blocks of a failed transfer."""
        with self._room:
            self.allocator.free(block_ids)
            self._room.notify_all()

    def load(self) -> dict[str, Any]:
        """A snapshot for /health (reads without a lock: values may be one iteration stale)."""
        return {
            "waiting": self.scheduler.num_waiting + len(self._expected) + len(self._parked),
            "running": self.scheduler.num_running,
            "kv_cache_usage": round(self.allocator.usage_ratio(), 4),
            "steps": self.steps_total,
        }

    def _generator(self, request: Request, seed: int | None) -> torch.Generator | None:
        if request.temperature <= 0:
            return None
        generator = torch.Generator(device=self.device)
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
        return generator

    # ------------------------------------------------------------------------------ engine thread

    def run(self) -> None:
        """The loop. Engine thread only; returns when `stop()` is called, or after
        MAX_CONSECUTIVE_LOOP_FAILURES iterations in a row raised: then every request fails, `fatal_error`
        says why and `on_fatal(reason)` is called (the worker exits non-zero, so the launcher and router
        see a dead worker instead of one that answers nothing)."""
        failures = 0
        while not self._stop.is_set():
            try:
                self._drain_inbox()
                if self._parked:
                    self._admit_parked()
                if not self.scheduler.has_work:
                    self._set_gauges()
                    self._wait()
                    continue
                with self.allocator_lock:
                    plan = self.scheduler.schedule()
                if plan.is_empty:  # waiting requests that do not fit yet: wait for blocks to come back
                    self._set_gauges()
                    self._wait()
                    continue
                self._step(plan)
                failures = 0
            except Exception as exc:  # one bad iteration must not stop serving; a deterministic one must
                failures += 1
                log.exception("engine loop iteration failed (%d in a row)", failures)
                if failures >= MAX_CONSECUTIVE_LOOP_FAILURES:
                    self.fatal_error = f"{failures} engine iterations in a row failed, last: {exc!r}"
                    log.critical("engine giving up: %s", self.fatal_error)
                    break
        self._fail_everything("engine failed" if self.fatal_error else "worker stopping")
        if self.fatal_error and self._on_fatal is not None:
            self._on_fatal(self.fatal_error)

    def _wait(self) -> None:
        self._wake.wait(0.5)
        self._wake.clear()

    def _drain_inbox(self) -> None:
        inbox = self._inbox
        while inbox:
            command = inbox.popleft()
            try:
                getattr(self, "_on_" + command[0])(*command[1:])
            except Exception:
                log.exception("engine command %s failed", command[0])

    def _on_submit(self, tracked: Tracked) -> None:
        request = tracked.request
        try:
            with self.allocator_lock:
                tracked.seq = self.scheduler.add(request)
        except QueueFull as exc:
            self._send_now(tracked.sink, (EVENT_ERROR, 503, "overloaded", str(exc)))
            return
        except RequestRejected as exc:
            self._send_now(tracked.sink, (EVENT_ERROR, 400, "invalid_request_error", str(exc)))
            return
        self._tracked[request.request_id] = tracked

    def _on_expect(self, tracked: Tracked) -> None:
        self._expected[tracked.request.request_id] = tracked

    def _on_arrived(self, request_id: str, block_ids: list[int], meta: dict[str, Any], info: Any) -> None:
        tracked = self._expected.pop(request_id, None)
        if tracked is None:  # its stream is gone (client left, or the request failed elsewhere)
            self.free_blocks(block_ids)
            return
        self._record_recv(tracked, info, str(meta.get("src_worker") or info.src))
        first_token = meta.get("first_token_id")
        request = tracked.request
        if not isinstance(first_token, int) or meta.get("prompt_tokens") != len(request.prompt_token_ids):
            self.free_blocks(block_ids)
            self._send_now(
                tracked.sink, (EVENT_ERROR, 500, "kv_transfer", "transfer metadata does not match the request")
            )
            return
        tracked.remote_cached_tokens = int(meta.get("cached_tokens") or 0)
        arrived = _Arrived(tracked, list(block_ids), first_token, time.monotonic() + self.kv_wait_s)
        if self._parked or not self._admit_arrived(arrived):  # first come, first served
            self._parked.append(arrived)

    def _admit_arrived(self, arrived: _Arrived) -> bool:
        """Decode role: give an arrived prompt's KV to the scheduler, which grows it to the request's whole
        length. False while the cache is short of those blocks and its wait (`kv_wait_s`) is not over: it
        stays parked, holding its prompt's blocks. True once admitted, or answered with an error."""
        tracked = arrived.tracked
        request = tracked.request
        table = BlockTable(self.allocator.block_size, list(arrived.block_ids), 0)
        try:
            with self.allocator_lock:
                seq = self.scheduler.add_prefilled(request, table, arrived.first_token)
        except OutOfBlocks as exc:
            if time.monotonic() < arrived.deadline_s:
                return False
            self.free_blocks(arrived.block_ids)
            self._send_now(
                tracked.sink, (EVENT_ERROR, 503, "overloaded", f"KV cache is full on this decode worker: {exc}")
            )
            return True
        except (RequestRejected, QueueFull) as exc:
            self.free_blocks(arrived.block_ids)
            status = 503 if isinstance(exc, QueueFull) else 400
            self._send_now(
                tracked.sink,
                (EVENT_ERROR, status, "overloaded" if status == 503 else "invalid_request_error", str(exc)),
            )
            return True
        tracked.seq = seq
        tracked.decode_start = self.tracer.mark()
        tracked.token_perf_ns.append(perf_counter_ns())
        tracked.token_prefill_tokens.append(0)
        events: list[tuple[Sink, tuple]] = [(tracked.sink, (EVENT_TOKEN, arrived.first_token))]
        if seq.is_finished:
            self._finish(tracked, events)
        else:
            self._tracked[request.request_id] = tracked
        self.deliver(events)
        return True

    def _admit_parked(self) -> None:
        """Engine thread, every iteration: admit parked arrivals in order while they fit (or time out)."""
        parked = self._parked
        while parked and self._admit_arrived(parked[0]):
            parked.popleft()

    def _on_kv_failed(self, request_id: str, reason: str) -> None:
        tracked = self._expected.pop(request_id, None)
        if tracked is None:
            return
        if reason == KV_REFUSED:  # no room for its blocks, even after waiting: capacity, retryable
            self._send_now(
                tracked.sink,
                (EVENT_ERROR, 503, "overloaded", "KV cache is full on this decode worker (transfer refused)"),
            )
        else:
            self._send_now(tracked.sink, (EVENT_ERROR, 500, "kv_transfer", f"KV transfer failed ({reason})"))

    def _on_abort(self, request_id: str, reason: str) -> None:
        self._expected.pop(request_id, None)
        for arrived in self._parked:
            if arrived.tracked.request.request_id == request_id:  # parked for room: give its blocks back now
                self._parked.remove(arrived)
                self.free_blocks(arrived.block_ids)
                return
        tracked = self._tracked.get(request_id)
        if tracked is None or tracked.seq is None or tracked.seq.state is SeqState.HANDED_OFF:
            return  # a handed-off prompt's blocks are read by its transfer until finish_handoff()
        del self._tracked[request_id]
        with self._room:
            if not tracked.seq.is_finished:
                self.scheduler.abort(request_id)
                self._room.notify_all()
        self._record_spans_so_far(tracked, reason)

    def _on_finish(self, request_id: str) -> None:
        tracked = self._tracked.pop(request_id, None)
        with self._room:
            if tracked is not None and tracked.seq is not None and not tracked.seq.is_finished:
                self.scheduler.finish(request_id)
                self._room.notify_all()

    def _send_now(self, sink: Sink, event: tuple) -> None:
        self.deliver([(sink, event)])

    # -- one iteration

    def _step(self, plan: StepPlan) -> None:
        tracer = self.tracer
        mark = tracer.mark
        step_start = mark()
        tracked = self._tracked
        # (trace id, prefill span id, chunk tokens) of each prompt in the step: one tuple per prompt per
        # step, never per token; the pipeline links decode stalls to them (tracer/pipeline.py).
        prefills: list[tuple[int, int, int]] = []
        for chunk in plan.prefills:
            t = tracked[chunk.seq.seq_id]
            if t.prefill_start is None:
                t.prefill_start = mark()
                t.prefill_span_id = s.new_span_id()
                self._record_queue(t)
            prefills.append((t.ctx.trace_id, t.prefill_span_id, chunk.num_tokens))
        try:
            logits = self.model(self._slices(plan), self.kv_pool)
            token_ids = self._sample(logits, plan).tolist()  # the one host wait of the iteration
        except Exception as exc:
            self._fail_step(plan, exc)
            return
        if self._anchor is not None:
            self._anchor()  # the device just went idle: a fresh anchor for CUDA-event timing
        step_end = mark()
        # The prefills this step completes end here, before the bookkeeping below: a mark taken after it
        # could fall behind the start of the KV transfer by a wait for the interpreter lock.
        for chunk in plan.prefills:
            if chunk.is_last:
                self._end_prefill(tracked[chunk.seq.seq_id])
        now_perf_ns = perf_counter_ns()
        with self._room:
            outcome = self.scheduler.on_step_done(plan, token_ids)
            if outcome.finished:
                self._room.notify_all()
        self.steps_total += 1
        prefill_tokens = plan.prefill_tokens
        tracer.step(
            step_start,
            step_end,
            plan.num_decode_requests,
            prefill_tokens,
            plan.context_tokens,
            plan.prefill_attention_tokens2,
            now_perf_ns,
            tuple(prefills),
        )

        events: list[tuple[Sink, tuple]] = []
        for seq, token_id in outcome.emitted:
            t = tracked[seq.seq_id]
            if not t.token_perf_ns:  # its first token: its prefill ended with this step (_end_prefill)
                self._record_prefill(t)
            t.token_perf_ns.append(now_perf_ns)
            t.token_prefill_tokens.append(prefill_tokens)
            if self.role != Role.PREFILL:
                events.append((t.sink, (EVENT_TOKEN, token_id)))
        for seq in outcome.handed_off:  # stays tracked until finish_handoff()
            t = tracked[seq.seq_id]
            self._handoff(t, seq.output_token_ids[0], t.handoff_wall_ns)
        for seq in outcome.finished:
            self._finish(tracked.pop(seq.seq_id), events)
        if events:
            self.deliver(events)
        self._set_gauges()

    def _fail_step(self, plan: StepPlan, exc: Exception) -> None:
        """The model or the sampler raised: end every request of the step with a 500 and record its spans."""
        log.exception("engine step failed; failing its %d requests", len(plan.sequences))
        with self._room:
            ended = self.scheduler.on_step_failed(plan, "error")
            self._room.notify_all()
        events: list[tuple[Sink, tuple]] = []
        for seq in ended:
            failed = self._tracked.pop(seq.seq_id, None)
            if failed is not None:
                self._record_spans_so_far(failed, "engine_error")
                events.append((failed.sink, (EVENT_ERROR, 500, "engine_error", f"{type(exc).__name__}: {exc}")))
        self.deliver(events)

    def _handoff(self, t: Tracked, first_token_id: int, handoff_wall_ns: int) -> None:
        if self.on_handoff is None:
            raise RuntimeError("a prefill engine needs on_handoff")
        try:
            self.on_handoff(t, first_token_id, handoff_wall_ns)
        except Exception as exc:  # e.g. the transfer queue is full: fail this request, free its blocks
            log.warning("KV handoff of %s failed: %s", t.request.request_id, exc)
            self._on_finish(t.request.request_id)
            self._send_now(t.sink, (EVENT_ERROR, 503, "overloaded", f"KV transfer not started: {exc}"))

    def _slices(self, plan: StepPlan) -> list[SeqSlice]:
        device = self.device
        slices = []
        if plan.decodes:
            decode_tokens = torch.tensor([d.token_id for d in plan.decodes], dtype=torch.long).to(
                device, non_blocking=True
            )
            slices = [
                SeqSlice(decode_tokens[i : i + 1], d.position, d.seq.admitted_table) for i, d in enumerate(plan.decodes)
            ]
        for chunk in plan.prefills:
            token_ids = torch.tensor(chunk.token_ids, dtype=torch.long).to(device, non_blocking=True)
            slices.append(SeqSlice(token_ids, chunk.start, chunk.seq.admitted_table))
        return slices

    def _sample(self, logits: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        """Greedy for every row, then the rows with temperature > 0 redrawn with their own generator.
        No host sync here: the caller's `.tolist()` is the only one."""
        next_ids = torch.argmax(logits, dim=-1)
        for row, seq in enumerate(plan.sequences):
            temperature = seq.request.temperature
            if temperature > 0:
                generator = self._tracked[seq.seq_id].generator
                if seq.request.top_p < 1:
                    next_ids[row : row + 1] = sample_top_p_no_sync(
                        logits[row : row + 1], temperature, seq.request.top_p, generator
                    )
                else:
                    next_ids[row : row + 1] = sample_no_sync(logits[row : row + 1], temperature, generator)
        return next_ids

    def _finish(self, t: Tracked, events: list[tuple[Sink, tuple]]) -> None:
        seq = t.seq
        assert seq is not None
        if self.role == Role.PREFILL:  # finished by its first token: nothing to transfer
            events.append((t.sink, (EVENT_DONE, seq.finish_reason, self._info(t))))
            return
        self._record_decode(t, "")
        events.append((t.sink, (EVENT_DONE, seq.finish_reason, self._info(t))))

    def _info(self, t: Tracked) -> dict[str, Any]:
        seq = t.seq
        return {
            "prompt_tokens": len(t.request.prompt_token_ids),
            "cached_tokens": max(seq.num_cached_tokens if seq else 0, t.remote_cached_tokens),
            "output_tokens": len(seq.output_token_ids) if seq else 0,
            "prefill_chunks": seq.num_prefill_chunks if seq else 0,
            "first_token_id": seq.output_token_ids[0] if seq and seq.output_token_ids else None,
        }

    def _set_gauges(self) -> None:
        metrics = self.metrics
        if metrics is None:
            return
        metrics.requests_waiting.set(self.scheduler.num_waiting + len(self._expected) + len(self._parked))
        metrics.requests_running.set(self.scheduler.num_running)
        metrics.kv_cache_usage.set(self.allocator.usage_ratio())

    def _fail_everything(self, message: str) -> None:
        parked = [arrived.tracked for arrived in self._parked]
        for arrived in self._parked:
            self.free_blocks(arrived.block_ids)
        self._parked.clear()
        events = [
            (t.sink, (EVENT_ERROR, 503, "unavailable", message))
            for t in (*self._tracked.values(), *self._expected.values(), *parked)
        ]
        self._tracked.clear()
        self._expected.clear()
        if events:
            self.deliver(events)

    # -- spans

    def _mark_wall_ns(self, mark: Any) -> int:
        """The host time of a clock mark on the wall timeline (the boundary a host-timed stage shares)."""
        clock = self.clock
        return clock.to_wall_ns(clock.host_perf_ns(mark)) if clock is not None else 0

    def _record_queue(self, t: Tracked) -> None:
        """The queue ends where the prefill starts: at the host time of its start mark."""
        if self.clock is None:
            return
        start_wall_ns = self.clock.to_wall_ns(t.arrival_perf_ns)
        self.tracer.stage_wall("queue", t.ctx, start_wall_ns, self._mark_wall_ns(t.prefill_start))

    def _end_prefill(self, t: Tracked) -> None:
        """Right after the step's end mark: the prefill's end, then where the next stage starts (the KV
        transfer on a prefill worker, at the same host time; the decode on a colocated one, a mark later)."""
        t.prefill_end = self.tracer.mark()
        if self.role == Role.PREFILL:
            t.handoff_wall_ns = self._mark_wall_ns(t.prefill_end)
        else:
            t.decode_start = self.tracer.mark()

    def _record_prefill(self, t: Tracked, error_type: str = "") -> None:
        seq = t.seq
        if t.prefill_start is None or seq is None:
            return
        attrs = {
            s.ATTR_PREFILL_TOKENS: seq.prompt_len,
            s.ATTR_PREFILL_CACHED_TOKENS: seq.num_cached_tokens,
            s.ATTR_PREFILL_CHUNKS: seq.num_prefill_chunks,
        }
        end = t.prefill_end if t.prefill_end is not None else self.tracer.mark()
        self.tracer.stage(
            Stage.PREFILL, t.ctx, t.prefill_start, end, attrs, span_id=t.prefill_span_id, error_type=error_type
        )
        t.prefill_start = t.prefill_end = None

    def _record_decode(self, t: Tracked, error_type: str) -> None:
        if t.decode_start is None:
            return
        attrs = {s.ATTR_OUTPUT_TOKENS: len(t.token_perf_ns)}
        self.tracer.decode(
            t.ctx,
            t.decode_start,
            self.tracer.mark(),
            t.token_perf_ns,
            t.token_prefill_tokens,
            attrs,
            error_type=error_type,
        )
        t.decode_start = None

    def _record_spans_so_far(self, t: Tracked, error_type: str) -> None:
        """A request ended early: close the spans it had open, marked with `error_type`."""
        if t.prefill_start is not None:
            self._record_prefill(t, error_type)
        if self.role != Role.PREFILL:
            self._record_decode(t, error_type)

    def _record_recv(self, t: Tracked, info: Any, src: str) -> None:
        parent = TraceContext.from_traceparent(getattr(info, "traceparent", None)) or t.ctx
        attrs = kv_attributes(info, src=src[:100], dst=self.kv_address)
        self.tracer.stage_wall("kv_transfer.recv", parent, info.recv_start_wall_ns, info.recv_end_wall_ns, attrs)


def sample_top_p_no_sync(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> torch.Tensor:
    """Nucleus sampling of each row of `logits` [n, vocab] -> long [n]; never syncs the host.

    Keeps, per row, the most probable tokens whose probabilities (at `temperature`) add up to `top_p`
    (always at least the most probable one), renormalises, and draws with `generator`.
    """
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    # A token stays when the mass before it is still short of top_p: the first token always stays.
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return multinomial_sample_one_no_sync(kept / kept.sum(dim=-1, keepdim=True), generator)


def kv_attributes(info: Any, *, src: str | None = None, dst: str | None = None) -> dict[str, Any]:
    """architecture.md §4 KV attributes from a TransferResult (sender) or ReceiveInfo (receiver)."""
    return {
        s.ATTR_KV_BYTES: info.kv_bytes,
        s.ATTR_KV_BLOCKS: info.blocks,
        s.ATTR_KV_BLOCK_TOKENS: info.block_tokens,
        s.ATTR_KV_STREAMS: info.streams,
        s.ATTR_KV_SRC: src if src is not None else getattr(info, "src", ""),
        s.ATTR_KV_DST: dst if dst is not None else getattr(info, "dst", ""),
        s.ATTR_CLOCK_OFFSET_NS: info.clock_offset_ns,
    }


def default_kv_blocks(
    max_seq_len: int, block_size: int, max_batch_seqs: int, bytes_per_block: int, budget_bytes: int = 1 << 30
) -> int:
    """Enough blocks for `max_batch_seqs` full-length sequences, capped at `budget_bytes` of KV."""
    wanted = max_batch_seqs * blocks_for_tokens(max_seq_len, block_size)
    return max(blocks_for_tokens(max_seq_len, block_size), min(wanted, budget_bytes // bytes_per_block))
