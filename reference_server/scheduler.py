"""Iteration-level (continuous batching) scheduling of one worker. Pure bookkeeping: no tensors.

Each engine iteration: `plan = scheduler.schedule()`, run the model on the plan's decode tokens and
prefill chunks, sample one token per entry of `plan.sequences`, then `scheduler.on_step_done(plan, tokens)`.

Policies:
- `colocated`: every running decode, plus the WHOLE prefill of waiting prompts (FCFS) in the same
  iteration -- the decodes wait for it (the interference this project measures). Prompts after the
  first join only while the iteration stays within the token budget; the first always joins whole.
- `chunked` (Sarathi-Serve stall-free batching): every running decode first (one token each), then
  prefill chunks -- prompts already in progress, then new ones -- until the token budget is used.
  The budget is never exceeded.
- `prefill-only`: whole prompts, as `colocated` but without decodes. A sequence whose prefill is done is
  handed off (`StepOutcome.handed_off`): the caller transfers its KV, then calls `finish()`.
- `decode-only`: sequences arrive with their KV already in the pool (`add_prefilled`); only decodes run.

KV blocks for a request's whole life (prompt + max_new_tokens) are reserved at admission, so a running
sequence never runs out of blocks mid-decode and nothing is ever preempted. Admission is FCFS and stops
at the first request that does not fit (no overtaking), when `max_batch_seqs` sequences are running, or
when the free blocks are short.

Not thread-safe: call everything from the engine loop's thread. No call blocks.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from reference_server.kv_cache import BlockAllocator, BlockTable, OutOfBlocks, blocks_for_tokens
from reference_server.tokenizer import EOS_ID
from tracer.vocabulary import SchedulerPolicy

POLICIES = tuple(SchedulerPolicy)


class RequestRejected(ValueError):
    """A request that can never run here (too long, malformed); answer it with a 4xx."""


class QueueFull(RuntimeError):
    """The waiting queue is at its bound; shed load (HTTP 503/429) and let the client retry."""


@dataclass(frozen=True)
class Request:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 0.0
    stop_token_ids: frozenset[int] = frozenset({EOS_ID})
    top_p: float = 1.0  # nucleus sampling: draw from the smallest set of tokens holding this probability
    # Token sequences that end the request once the output ends with one (stop strings, byte-tokenized).
    stop_sequences: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))
        if not 0 < self.top_p <= 1:
            raise RequestRejected(f"request {self.request_id}: top_p must be in (0, 1], got {self.top_p}")
        if any(not stop for stop in self.stop_sequences):
            raise RequestRejected(f"request {self.request_id}: empty stop sequence")
        if not self.prompt_token_ids:
            raise RequestRejected(f"request {self.request_id}: empty prompt")
        if self.max_new_tokens < 1:
            raise RequestRejected(f"request {self.request_id}: max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise RequestRejected(f"request {self.request_id}: temperature must be >= 0, got {self.temperature}")


class SeqState(enum.Enum):
    WAITING = "waiting"  # queued; holds blocks only in decode-only (its KV arrived already)
    PREFILLING = "prefilling"  # admitted, prompt partly computed
    DECODING = "decoding"
    HANDED_OFF = "handed_off"  # prefill-only: prompt done, blocks held until the caller's finish()
    FINISHED = "finished"  # blocks freed


@dataclass(eq=False)
class ScheduledRequest:
    """One request's state on this worker. Read it freely; only the scheduler changes it."""

    request: Request
    state: SeqState = SeqState.WAITING
    block_table: BlockTable | None = None
    num_computed_tokens: int = 0  # positions whose K/V are in the pool
    output_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    num_prefill_chunks: int = 0
    finish_reason: str | None = None  # "stop", "length", "abort", or the caller's reason

    @property
    def seq_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.state is SeqState.FINISHED

    @property
    def admitted_table(self) -> BlockTable:
        """`block_table` of a sequence the scheduler has admitted (set on admission, never unset), typed as
        present; only for sequences in a plan or running."""
        assert self.block_table is not None, f"sequence {self.seq_id} is not admitted"
        return self.block_table


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt positions [start, end) of `seq` computed in this step; `is_last` when it completes the prompt."""

    seq: ScheduledRequest
    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def is_last(self) -> bool:
        return self.end == self.seq.prompt_len

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.seq.request.prompt_token_ids[self.start : self.end]


@dataclass(frozen=True)
class DecodeSlot:
    """One decode token of `seq` in this step: feed `token_id` at `position`."""

    seq: ScheduledRequest
    token_id: int
    position: int


@dataclass(frozen=True)
class StepPlan:
    """What one iteration runs: decodes first, then prefill chunks. A snapshot: fixed when scheduled."""

    decodes: tuple[DecodeSlot, ...]
    prefills: tuple[PrefillChunk, ...]

    @property
    def sequences(self) -> tuple[ScheduledRequest, ...]:
        """The order of `on_step_done`'s tokens: the decodes' sequences, then the chunks' sequences."""
        return tuple(d.seq for d in self.decodes) + tuple(c.seq for c in self.prefills)

    @property
    def num_decode_requests(self) -> int:
        return len(self.decodes)

    @property
    def prefill_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.prefills)

    @property
    def num_tokens(self) -> int:
        return self.num_decode_requests + self.prefill_tokens

    @property
    def prefill_attention_tokens2(self) -> int:
        """Each chunk's attention over its prompt so far, tokens^2: (end^2 - start^2) summed over chunks."""
        return sum(chunk.end * chunk.end - chunk.start * chunk.start for chunk in self.prefills)

    @property
    def context_tokens(self) -> int:
        """KV tokens attended over in this step, new ones included (the step record's context size)."""
        return sum(d.position + 1 for d in self.decodes) + sum(chunk.end for chunk in self.prefills)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


@dataclass
class StepOutcome:
    """What `on_step_done` changed: tokens to stream, and sequences that left the running set."""

    emitted: list[tuple[ScheduledRequest, int]] = field(default_factory=list)  # (sequence, new token id)
    finished: list[ScheduledRequest] = field(default_factory=list)  # blocks already freed
    handed_off: list[ScheduledRequest] = field(default_factory=list)  # prefill-only: transfer KV, then finish()


class Scheduler:
    """Continuous batching for one worker over one `BlockAllocator` (which it allocates from and frees to)."""

    def __init__(
        self,
        policy: SchedulerPolicy | str,
        token_budget: int,
        max_batch_seqs: int,
        allocator: BlockAllocator,
        *,
        max_context_tokens: int | None = None,
        prefix_caching: bool = True,
        max_waiting_requests: int = 1024,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {policy!r}; choose one of {', '.join(POLICIES)}")
        if max_batch_seqs < 1:
            raise ValueError(f"max_batch_seqs must be >= 1, got {max_batch_seqs}")
        if token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {token_budget}")
        if policy == SchedulerPolicy.CHUNKED and token_budget <= max_batch_seqs:
            # Decodes always run; a budget they alone can fill would leave no room for prefill progress.
            raise ValueError(f"chunked policy needs token_budget > max_batch_seqs ({token_budget} <= {max_batch_seqs})")
        self.policy = SchedulerPolicy(policy)
        self.token_budget = token_budget
        self.max_batch_seqs = max_batch_seqs
        self.allocator = allocator
        self.max_context_tokens = max_context_tokens
        self.prefix_caching = prefix_caching and policy != SchedulerPolicy.DECODE_ONLY
        self.max_waiting_requests = max_waiting_requests
        self._waiting: deque[ScheduledRequest] = deque()
        self._running: list[ScheduledRequest] = []  # PREFILLING and DECODING, in admission order
        self._handed_off: dict[str, ScheduledRequest] = {}
        self._live: dict[str, ScheduledRequest] = {}
        self._plan_in_flight: StepPlan | None = None
        self.prefix_queried_tokens_total = 0
        self.prefix_hit_tokens_total = 0

    # --- gauges -----------------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def get(self, seq_id: str) -> ScheduledRequest:
        try:
            return self._live[seq_id]
        except KeyError:
            raise KeyError(f"no live sequence {seq_id!r} on this scheduler") from None

    # --- arrivals ---------------------------------------------------------------------------------

    def _kv_tokens_needed(self, request: Request) -> int:
        if self.policy == SchedulerPolicy.PREFILL_ONLY:
            return len(request.prompt_token_ids)
        return len(request.prompt_token_ids) + request.max_new_tokens - 1  # the last token's KV is never written

    def _check_admissible(self, request: Request) -> None:
        if request.request_id in self._live:
            raise RequestRejected(f"request id {request.request_id!r} is already live on this worker")
        total_tokens = len(request.prompt_token_ids) + request.max_new_tokens
        if self.max_context_tokens is not None and total_tokens > self.max_context_tokens:
            raise RequestRejected(
                f"request {request.request_id}: prompt ({len(request.prompt_token_ids)} tokens) + max_new_tokens "
                f"({request.max_new_tokens}) exceeds the context limit of {self.max_context_tokens} tokens"
            )
        blocks = blocks_for_tokens(self._kv_tokens_needed(request), self.allocator.block_size)
        if blocks > self.allocator.num_blocks:
            raise RequestRejected(
                f"request {request.request_id}: needs {blocks} KV blocks, "
                f"the whole cache has {self.allocator.num_blocks}"
            )
        if len(self._waiting) >= self.max_waiting_requests:
            raise QueueFull(f"{len(self._waiting)} requests already waiting (bound {self.max_waiting_requests})")

    def add(self, request: Request) -> ScheduledRequest:
        """Queue a new prompt (all policies but decode-only). Raises RequestRejected or QueueFull."""
        if self.policy == SchedulerPolicy.DECODE_ONLY:
            raise RequestRejected("a decode-only scheduler takes prefilled sequences: use add_prefilled()")
        self._check_admissible(request)
        seq = ScheduledRequest(request)
        self._waiting.append(seq)
        self._live[seq.seq_id] = seq
        return seq

    def add_prefilled(self, request: Request, block_table: BlockTable, first_token_id: int) -> ScheduledRequest:
        """Decode-only: register a sequence whose prompt KV is in `block_table` and whose first token is known.

        The scheduler takes ownership of the table's blocks (it frees them when the sequence ends) and
        grows the table to hold prompt + max_new_tokens - 1 positions; on OutOfBlocks it takes nothing
        and the caller still owns the table. A request finished by its first token (stop token, or
        max_new_tokens == 1) comes back already FINISHED, its blocks freed.
        """
        if self.policy != SchedulerPolicy.DECODE_ONLY:
            raise RequestRejected(f"add_prefilled() is for decode-only schedulers, this one is {self.policy}")
        if block_table.block_size != self.allocator.block_size:
            raise RequestRejected(
                f"block table of {block_table.block_size}-token blocks, this cache has {self.allocator.block_size}"
            )
        self._check_admissible(request)
        prompt_len = len(request.prompt_token_ids)
        if block_table.capacity_tokens < prompt_len:
            raise RequestRejected(
                f"request {request.request_id}: block table holds {block_table.capacity_tokens} tokens, "
                f"prompt has {prompt_len}"
            )
        missing = blocks_for_tokens(self._kv_tokens_needed(request), block_table.block_size) - len(
            block_table.block_ids
        )
        if missing > 0:
            block_table.block_ids.extend(self.allocator.allocate(missing))
        block_table.num_tokens = prompt_len
        seq = ScheduledRequest(request, block_table=block_table, num_computed_tokens=prompt_len)
        self._live[seq.seq_id] = seq
        seq.output_token_ids.append(first_token_id)
        if not self._finish_if_done(seq):
            self._waiting.append(seq)
        return seq

    # --- scheduling -------------------------------------------------------------------------------

    def _admit(self, seq: ScheduledRequest) -> bool:
        """Give the head of the queue its blocks (prefix hits first). False when the cache is short."""
        if self.policy == SchedulerPolicy.DECODE_ONLY:  # its blocks came with it
            seq.state = SeqState.DECODING
            return True
        request = seq.request
        hit_blocks: tuple[int, ...] = ()
        if self.prefix_caching:
            # Never the whole prompt: its last token must run to give the first output token's logits.
            hit = self.allocator.lookup_prefix(request.prompt_token_ids, max_tokens=seq.prompt_len - 1)
            hit_blocks, seq.num_cached_tokens = hit.block_ids, hit.num_tokens
        needed = blocks_for_tokens(self._kv_tokens_needed(request), self.allocator.block_size)
        try:
            fresh = self.allocator.allocate(needed - len(hit_blocks))
        except OutOfBlocks:
            self.allocator.free(hit_blocks)
            seq.num_cached_tokens = 0
            return False
        if self.prefix_caching:
            self.prefix_queried_tokens_total += seq.prompt_len
            self.prefix_hit_tokens_total += seq.num_cached_tokens
        seq.block_table = BlockTable(self.allocator.block_size, [*hit_blocks, *fresh], seq.num_cached_tokens)
        seq.num_computed_tokens = seq.num_cached_tokens
        seq.state = SeqState.PREFILLING
        return True

    def _admit_next(self) -> ScheduledRequest | None:
        if not self._waiting or len(self._running) >= self.max_batch_seqs:
            return None
        seq = self._waiting[0]
        if not self._admit(seq):
            return None
        self._waiting.popleft()
        self._running.append(seq)
        return seq

    def schedule(self) -> StepPlan:
        """Plan the next iteration (possibly empty). Call `on_step_done` or `on_step_failed` before the next."""
        if self._plan_in_flight is not None:
            raise RuntimeError("schedule() called again before on_step_done() / on_step_failed() of the last plan")
        if self.policy == SchedulerPolicy.DECODE_ONLY:
            while self._admit_next() is not None:
                pass
        decodes = tuple(
            DecodeSlot(seq, seq.output_token_ids[-1], seq.num_computed_tokens)
            for seq in self._running
            if seq.state is SeqState.DECODING
        )
        if self.policy == SchedulerPolicy.CHUNKED:
            prefills = self._chunked_prefills(self.token_budget - len(decodes))
        elif self.policy in (SchedulerPolicy.COLOCATED, SchedulerPolicy.PREFILL_ONLY):
            prefills = self._whole_prefills(self.token_budget - len(decodes))
        else:
            prefills = ()
        plan = StepPlan(decodes, prefills)
        if not plan.is_empty:
            self._plan_in_flight = plan
        return plan

    def _whole_prefills(self, budget_left: int) -> tuple[PrefillChunk, ...]:
        chunks: list[PrefillChunk] = []
        while self._waiting:
            head = self._waiting[0]
            # The first prompt always joins whole. Later ones are judged by their full prompt length:
            # admission (which finds prefix hits) takes blocks, so it only runs for a prompt that fits.
            if chunks and head.prompt_len > budget_left:
                break
            seq = self._admit_next()
            if seq is None:
                break
            chunks.append(PrefillChunk(seq, seq.num_computed_tokens, seq.prompt_len))
            budget_left -= chunks[-1].num_tokens
        return tuple(chunks)

    def _chunked_prefills(self, budget_left: int) -> tuple[PrefillChunk, ...]:
        chunks: list[PrefillChunk] = []
        for seq in self._running:
            if budget_left <= 0:
                break
            if seq.state is SeqState.PREFILLING:
                end = min(seq.prompt_len, seq.num_computed_tokens + budget_left)
                chunks.append(PrefillChunk(seq, seq.num_computed_tokens, end))
                budget_left -= chunks[-1].num_tokens
        while budget_left > 0:
            admitted = self._admit_next()
            if admitted is None:
                break
            end = min(admitted.prompt_len, admitted.num_computed_tokens + budget_left)
            chunks.append(PrefillChunk(admitted, admitted.num_computed_tokens, end))
            budget_left -= chunks[-1].num_tokens
        return tuple(chunks)

    # --- completion -------------------------------------------------------------------------------

    def on_step_done(self, plan: StepPlan, next_token_ids: Sequence[int]) -> StepOutcome:
        """Record a finished iteration. `next_token_ids[i]` is the token sampled for `plan.sequences[i]`
        (ignored for prefill chunks that do not complete their prompt). Sequences aborted while the step
        ran are skipped.
        """
        if plan is not self._plan_in_flight:
            raise RuntimeError("on_step_done() got a plan that is not the one in flight")
        if len(next_token_ids) != len(plan.decodes) + len(plan.prefills):
            raise ValueError(
                f"{len(next_token_ids)} tokens for a plan of {len(plan.decodes) + len(plan.prefills)} sequences"
            )
        self._plan_in_flight = None
        outcome = StepOutcome()
        decode_tokens, prefill_tokens = next_token_ids[: len(plan.decodes)], next_token_ids[len(plan.decodes) :]
        for slot, token_id in zip(plan.decodes, decode_tokens):
            seq = slot.seq
            if seq.is_finished:
                continue
            seq.num_computed_tokens = slot.position + 1
            seq.admitted_table.num_tokens = max(seq.admitted_table.num_tokens, seq.num_computed_tokens)
            self._emit(seq, token_id, outcome)
        for chunk, token_id in zip(plan.prefills, prefill_tokens):
            seq = chunk.seq
            if seq.is_finished:
                continue
            seq.num_computed_tokens = chunk.end
            seq.admitted_table.num_tokens = max(seq.admitted_table.num_tokens, chunk.end)
            seq.num_prefill_chunks += 1
            if self.prefix_caching:
                self.allocator.cache_full_blocks(seq.admitted_table, seq.request.prompt_token_ids)
            if not chunk.is_last:
                continue
            if self.policy == SchedulerPolicy.PREFILL_ONLY:
                seq.output_token_ids.append(token_id)
                outcome.emitted.append((seq, token_id))
                self._running.remove(seq)
                if self._finish_if_done(seq):
                    outcome.finished.append(seq)
                else:
                    seq.state = SeqState.HANDED_OFF
                    self._handed_off[seq.seq_id] = seq
                    outcome.handed_off.append(seq)
                continue
            seq.state = SeqState.DECODING
            self._emit(seq, token_id, outcome)
        return outcome

    def on_step_failed(self, plan: StepPlan, reason: str = "error") -> list[ScheduledRequest]:
        """The iteration raised: end every sequence in it (blocks freed) so the rest keep serving."""
        if plan is not self._plan_in_flight:
            raise RuntimeError("on_step_failed() got a plan that is not the one in flight")
        self._plan_in_flight = None
        ended = []
        for seq in plan.sequences:
            if not seq.is_finished:
                self._end(seq, reason)
                ended.append(seq)
        return ended

    def _emit(self, seq: ScheduledRequest, token_id: int, outcome: StepOutcome) -> None:
        seq.output_token_ids.append(token_id)
        outcome.emitted.append((seq, token_id))
        if self._finish_if_done(seq):
            outcome.finished.append(seq)

    def _finish_if_done(self, seq: ScheduledRequest) -> bool:
        output = seq.output_token_ids
        stop_sequences = seq.request.stop_sequences
        if output[-1] in seq.request.stop_token_ids or (stop_sequences and _ends_with_any(output, stop_sequences)):
            self._end(seq, "stop")
        elif len(seq.output_token_ids) >= seq.request.max_new_tokens:
            self._end(seq, "length")
        return seq.is_finished

    def finish(self, seq_id: str, reason: str = "handed_off") -> ScheduledRequest:
        """End a live sequence in any state and free its blocks (prefill-only: call after the KV transfer)."""
        seq = self.get(seq_id)
        self._end(seq, reason)
        return seq

    def abort(self, seq_id: str) -> ScheduledRequest:
        """Cancel a live sequence (client gone, transfer failed); its blocks are freed."""
        return self.finish(seq_id, "abort")

    def _end(self, seq: ScheduledRequest, reason: str) -> None:
        if seq.state is SeqState.WAITING:
            self._waiting.remove(seq)
        elif seq.state in (SeqState.PREFILLING, SeqState.DECODING) and seq in self._running:
            self._running.remove(seq)
        self._handed_off.pop(seq.seq_id, None)
        self._live.pop(seq.seq_id, None)
        if seq.block_table is not None:
            self.allocator.free(seq.block_table.block_ids)
            seq.block_table.block_ids = []
        seq.state = SeqState.FINISHED
        seq.finish_reason = reason


def _ends_with_any(output: list[int], stops: tuple[tuple[int, ...], ...]) -> bool:
    """Whether `output` ends with one of `stops` (compares only each stop's length of tail)."""
    return any(len(output) >= len(stop) and tuple(output[-len(stop) :]) == stop for stop in stops)
