"""Discrete-event model of iteration-level LLM serving: colocated, chunked prefill, and P:D splits.

One engine iteration ("step") at a time per worker, the way the reference server and vLLM schedule:

- colocated: waiting prompts' whole prefills join the next step with every running decode, so that step's
  decode tokens wait for them (the interference a split removes);
- chunked: each step takes every running decode first, then prefill chunks up to a token budget
  (Sarathi-Serve's stall-free batching);
- disaggregated: prefill workers run prefill-only steps, the KV cache crosses a link (bytes / bandwidth +
  a constant; one FIFO link per prefill worker), and decode workers run decode-only steps. The first token
  reaches the client when the transfer has ended and a decode worker has admitted the request, so both
  the exposed transfer and a full decode pool count toward time to first token.

Step time follows DistServe's fitted forms, summed for a mixed step (see `StepCosts`), extended past the
largest batch the fit saw at the marginal cost of its largest batches. A step is planned at its start: a
request that arrives, or a KV cache that lands, while one runs joins the next. Requests are placed by
`EngineParams.router` (ROUTERS): least-outstanding, as the reference router, runs a pool's workers side by
side and places each arrival on what they hold then; round-robin and session placements need no worker's
state, so each worker runs on its own. The whole model is a few tight loops over steps, with no per-token
Python objects, so a goodput search of dozens of runs takes about a second.

Pure computation; no I/O, no threads. Times are seconds from the start of the workload.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from tracer.report.noise import NoiseDraws, StepNoise
from tracer.vocabulary import POOL_OF_ROLE, ROLES_OF_MODE, Mode, Role

MODES = tuple(Mode)
# How requests are placed on a pool's workers (`EngineParams.router`): least-outstanding is the reference
# router's (fewest requests in flight; a prefill pool: fewest prompt tokens in flight), round-robin in
# arrival order, session is rendezvous hashing of the request's session (the reference router's `user`
# stickiness; a split's decode worker stays least-outstanding there, as in the reference router).
ROUTERS = ("least-outstanding", "round-robin", "session")
ITL_STATS = ("p99", "max", "mean")


@dataclass(frozen=True)
class StepCosts:
    """Seconds one engine step takes (DistServe's forms, summed for a mixed step):

    step_s = base_s + context_s_per_token * context_tokens + decode_s_per_request * decode_requests
             + prefill_s_per_token * P + prefill_s_per_token2 * A

    where P is the number of prefill tokens in the step and A its attention work in tokens^2: each chunk
    of n tokens at offset c in its prompt counts (c + n)^2 - c^2, so a chunk costs what prefilling c + n
    tokens costs minus what prefilling c costs, and a prompt's chunks add up to its whole prefill. A
    prefill-only step of one prompt is DistServe's `a + b*L + c*L^2`; a decode-only step is
    `a + b*sum(context) + c*batch`. The interference of a mixed step is its prefill part over its decode part.

    Past the largest batch the fit saw (`max_batch_seen`, requests; 0: no limit known), each further request
    costs `decode_s_per_request_beyond` (never less than `decode_s_per_request`): an accelerator is
    memory-bound at small batch (a step costs nearly the same whatever the batch) and compute-bound past a
    knee, so a slope fitted mostly on small batches would extrapolate too cheap. The beyond slope is the
    one measured at the largest observed batches, the steepest the evidence shows.

    With `roofline_knee_tokens` > 0 (`--step-model roofline`, an accelerator) the batch past the largest
    seen is priced as a GPU runs it instead: the weights' read bounds a decode step until the tokens it
    runs reach the knee (the fitted per-step cost over a prefill token's cost: where the GEMMs' arithmetic
    starts to take longer than reading the weights), so each further request adds only its KV read (the
    context term) until then, and a prefill token's cost past the knee. The small-batch slope, often a
    kernel change between batch 1 and 2 on a GPU, is not carried to batches of hundreds.
    """

    base_s: float
    context_s_per_token: float
    decode_s_per_request: float
    prefill_s_per_token: float
    prefill_s_per_token2: float = 0.0
    max_batch_seen: float = 0.0  # requests (a count; a float so every field takes a fitted coefficient)
    decode_s_per_request_beyond: float = 0.0
    roofline_knee_tokens: float = 0.0  # 0: the linear extrapolation above
    # > 0: the accelerator's form, pass by pass (`fit.fit_passes`: the roofline with the model's config): the GEMMs of
    # every token the step runs (one per decode plus its prefill tokens) cost nothing beyond `base_s` up to
    # this many tokens (the weights' read bounds them) and `prefill_s_per_token` each past it; a step that
    # runs any prefill adds `prefill_floor_s` (its attention kernels' launch). Batches then need no
    # extrapolation rule: a decode past the knee costs a token's GEMMs, as any token does.
    gemm_knee_tokens: float = 0.0
    prefill_floor_s: float = 0.0

    @property
    def beyond_extra_s(self) -> float:
        """Seconds each request past `max_batch_seen` adds over the fitted slope (0: no knee; the roofline
        takes the fitted slope back: -decode_s_per_request)."""
        if self.max_batch_seen <= 0 or self.gemm_knee_tokens > 0:
            return 0.0
        if self.roofline_knee_tokens > 0:
            return -self.decode_s_per_request
        return max(0.0, self.decode_s_per_request_beyond - self.decode_s_per_request)

    @property
    def roofline_from_batch(self) -> float:
        """Past this batch (requests) each decode costs a prefill token's GEMMs (roofline only; else inf)."""
        if self.roofline_knee_tokens <= 0 or self.max_batch_seen <= 0:
            return float("inf")
        return max(self.roofline_knee_tokens, self.max_batch_seen)

    def step_s(
        self,
        decode_requests: float,
        context_tokens: float,
        prefill_tokens: float,
        prefill_attention_tokens2: float | None = None,
    ) -> float:
        """Seconds; `prefill_attention_tokens2` defaults to one prompt's whole prefill (P^2)."""
        attention = prefill_tokens * prefill_tokens if prefill_attention_tokens2 is None else prefill_attention_tokens2
        if self.gemm_knee_tokens > 0:
            return (
                self.base_s
                + self.context_s_per_token * context_tokens
                + self.decode_s_per_request * decode_requests
                + self.prefill_s_per_token * max(0.0, decode_requests + prefill_tokens - self.gemm_knee_tokens)
                + (self.prefill_floor_s if prefill_tokens > 0 else 0.0)
                + self.prefill_s_per_token2 * attention
            )
        return (
            self.beyond_extra_s * max(0.0, decode_requests - self.max_batch_seen)
            + self.prefill_s_per_token * max(0.0, decode_requests - self.roofline_from_batch)
            + self.base_s
            + self.context_s_per_token * context_tokens
            + self.decode_s_per_request * decode_requests
            + self.prefill_s_per_token * prefill_tokens
            + self.prefill_s_per_token2 * attention
        )

    def decode_part_s(self, decode_requests: int, context_tokens: int) -> float:
        return self.step_s(decode_requests, context_tokens, 0)


@dataclass(frozen=True)
class TransferCosts:
    """KV cache transfer between pools: `constant_s + prompt_tokens * kv_bytes_per_token / link_bytes_per_s`.

    The link is one per prefill worker (its NIC) and carries one transfer at a time, so a link slower than
    the KV production rate queues transfers.
    """

    kv_bytes_per_token: float
    link_bytes_per_s: float
    constant_s: float = 0.0


@dataclass(frozen=True)
class Costs:
    step: StepCosts
    transfer: TransferCosts
    # What a request spends outside the engine before its first token reaches the client (router hop,
    # tokenisation, streaming): added to TTFT and end-to-end as measured, not modelled.
    frontend_s: float = 0.0
    # The measured share of tokens the client gets in one stream event with the token before
    # (`splitscope.itl_joined_tokens`: text held back for an incomplete character, a possible stop string):
    # each such token's gap joins the gap before it, so that gap spans two steps or more. Drawn per token.
    joined_token_share: float = 0.0


@dataclass(frozen=True)
class EngineParams:
    """Scheduler limits shared by every simulated worker."""

    max_running_requests: int = 256
    # Whole prefills batched into one colocated or prefill-only step (at least one prompt always joins).
    max_prefill_tokens_per_step: int = 8192
    router: str = "least-outstanding"  # one of ROUTERS

    def __post_init__(self) -> None:
        if self.router not in ROUTERS:
            raise ValueError(f"unknown router {self.router!r}; expected one of {ROUTERS}")


@dataclass(frozen=True)
class Layout:
    """A deployment: `colocated`/`chunked` with `workers`, or `disaggregated` with prefill:decode workers."""

    mode: Mode  # a plain string naming one is accepted and made the member
    workers: int = 0
    prefill_workers: int = 0
    decode_workers: int = 0
    chunk_budget_tokens: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown layout mode {self.mode!r}; expected one of {tuple(m.value for m in MODES)}")
        object.__setattr__(self, "mode", Mode(self.mode))
        if self.mode == Mode.DISAGGREGATED:
            if self.prefill_workers < 1 or self.decode_workers < 1:
                raise ValueError("a disaggregated layout needs at least one prefill and one decode worker")
        elif self.workers < 1:
            raise ValueError(f"a {self.mode} layout needs at least one worker")
        if self.mode == Mode.CHUNKED and self.chunk_budget_tokens < 1:
            raise ValueError("a chunked layout needs a positive chunk_budget_tokens")

    @property
    def gpus(self) -> int:
        return self.prefill_workers + self.decode_workers if self.mode == Mode.DISAGGREGATED else self.workers

    @property
    def ratio(self) -> str | None:
        return f"{self.prefill_workers}:{self.decode_workers}" if self.mode == Mode.DISAGGREGATED else None

    @property
    def label(self) -> str:
        if self.mode == Mode.DISAGGREGATED:
            return f"split {self.ratio}"
        if self.mode == Mode.CHUNKED:
            return f"chunked {self.chunk_budget_tokens} x{self.workers}"
        return f"colocated x{self.workers}"


@dataclass(frozen=True)
class Workload:
    """Requests to serve, in arrival order. Arrays of equal length; times in seconds."""

    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    cached_tokens: np.ndarray
    output_tokens: np.ndarray  # including the first token, which the prefill produces
    # Session (user) of each request, for session-sticky routing; None: every request its own session.
    session: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        if not (len(self.prompt_tokens) == len(self.cached_tokens) == len(self.output_tokens) == n):
            raise ValueError("workload arrays must have equal lengths")
        if self.session is not None and len(self.session) != n:
            raise ValueError("workload arrays must have equal lengths")

    def _sessions(self, picks: np.ndarray | slice) -> np.ndarray | None:
        return None if self.session is None else self.session[picks]

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def rate_per_s(self) -> float:
        span_s = float(self.arrival_s[-1] - self.arrival_s[0]) if len(self) > 1 else 0.0
        return (len(self) - 1) / span_s if span_s > 0 else 0.0

    def head(self, n: int) -> Workload:
        """The first `n` requests."""
        return Workload(
            self.arrival_s[:n],
            self.prompt_tokens[:n],
            self.cached_tokens[:n],
            self.output_tokens[:n],
            self._sessions(slice(n)),
        )

    def scaled_to_rate(self, rate_per_s: float) -> Workload:
        """The same requests and arrival pattern, with times stretched to a mean rate of `rate_per_s`."""
        current = self.rate_per_s
        if current <= 0 or rate_per_s <= 0:
            raise ValueError("cannot rescale a workload without a positive rate")
        start = self.arrival_s[0]
        arrivals = (self.arrival_s - start) * (current / rate_per_s)
        return Workload(arrivals, self.prompt_tokens, self.cached_tokens, self.output_tokens, self.session)

    def resample(self, n_requests: int, seed: int) -> Workload:
        """`n_requests` drawn with replacement in blocks of consecutive requests (a circular block bootstrap).

        A block keeps its requests' lengths, sessions and the gaps before each of them, so a burst (long
        prompts arriving within milliseconds of each other) and a lull stay as observed instead of being
        spread over the run by independent draws; blocks start anywhere and are at least as long as the
        longest burst seen (`block_length`). Fewer than two arrivals: Poisson gaps, lengths drawn jointly.
        """
        rng = np.random.default_rng(seed)
        n = len(self)
        gaps = np.maximum(np.diff(self.arrival_s), 0.0)
        if n < 2 or gaps.sum() <= 0:
            picks = rng.integers(0, n, n_requests)
            drawn = rng.exponential(1.0, n_requests)
        else:
            length = block_length(gaps)
            starts = rng.integers(0, n, -(-n_requests // length))
            picks = ((starts[:, None] + np.arange(length)) % n).ravel()[:n_requests]
            # The gap before each request; the first request's is one drawn from the others (a block may
            # start there, after the run's last request).
            before = np.concatenate(([rng.choice(gaps)], gaps))
            drawn = before[picks]
        arrivals = np.concatenate(([0.0], np.cumsum(drawn[1:])))
        picked = self.prompt_tokens[picks], self.cached_tokens[picks], self.output_tokens[picks]
        return Workload(arrivals, *picked, self._sessions(picks))


# A gap under this share of the mean gap joins its two requests into one burst.
BURST_GAP_SHARE = 0.1


def block_length(gaps_s: np.ndarray) -> int:
    """Requests per resampling block: n^(1/3) (the usual order for a block bootstrap of n) but at least
    the longest burst seen (consecutive requests whose gaps are under BURST_GAP_SHARE of the mean gap), so
    a burst is never cut for being longer than a block; at most a quarter of the requests."""
    n = len(gaps_s) + 1
    in_burst = gaps_s < BURST_GAP_SHARE * float(gaps_s.mean())
    longest_run, run = 0, 0
    for joined in in_burst:
        run = run + 1 if joined else 0
        longest_run = max(longest_run, run)
    return int(max(1, min(max(math.ceil(n ** (1 / 3)), longest_run + 1), n // 4)))


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    itl_s: float
    itl_stat: str = "p99"
    attainment: float = 0.9

    def __post_init__(self) -> None:
        if self.itl_stat not in ITL_STATS:
            raise ValueError(f"itl_stat must be one of {ITL_STATS}, got {self.itl_stat!r}")
        if self.ttft_s <= 0 or self.itl_s <= 0:
            raise ValueError("SLO thresholds must be positive seconds")
        if not 0 < self.attainment <= 1:
            raise ValueError("attainment must be in (0, 1]")


@dataclass
class StepLog:
    """Every simulated step, for traces (filled only when recording). Parallel lists."""

    worker: list[int] = field(default_factory=list)
    start_s: list[float] = field(default_factory=list)
    duration_s: list[float] = field(default_factory=list)
    decode_requests: list[int] = field(default_factory=list)
    prefill_tokens: list[int] = field(default_factory=list)
    context_tokens: list[int] = field(default_factory=list)
    prefill_attention_tokens2: list[int] = field(default_factory=list)

    def append(
        self,
        worker: int,
        start_s: float,
        duration_s: float,
        decode_requests: int,
        prefill_tokens: int,
        context_tokens: int,
        prefill_attention_tokens2: int,
    ) -> None:
        self.worker.append(worker)
        self.start_s.append(start_s)
        self.duration_s.append(duration_s)
        self.decode_requests.append(decode_requests)
        self.prefill_tokens.append(prefill_tokens)
        self.context_tokens.append(context_tokens)
        self.prefill_attention_tokens2.append(prefill_attention_tokens2)


@dataclass
class SimResult:
    """Per-request outcome of one simulation (arrays indexed like the workload), plus recorded detail."""

    layout: Layout
    ttft_s: np.ndarray
    itl_p50_s: np.ndarray
    itl_p99_s: np.ndarray
    itl_max_s: np.ndarray
    itl_mean_s: np.ndarray
    e2e_s: np.ndarray
    attainment: float | None = None
    # The largest decode batch (requests) and context (tokens) any simulated step ran: past what the step
    # fit saw, the step costs are an extrapolation.
    max_batch: int = 0
    max_context_tokens: int = 0
    # Recorded only with `record=True` (for synthetic traces):
    timeline: dict[str, np.ndarray] | None = None
    steps: dict[str, StepLog] | None = None  # pool -> step log
    token_gaps: list[np.ndarray] | None = None

    def itl(self, stat: str) -> np.ndarray:
        return {"p99": self.itl_p99_s, "max": self.itl_max_s, "mean": self.itl_mean_s}[stat]

    def attainment_for(self, slo: SLO) -> float:
        return float(np.mean(meets_slo(self.ttft_s, self.itl(slo.itl_stat), slo)))


def meets_slo(ttft_s: np.ndarray, itl_s: np.ndarray, slo: SLO) -> np.ndarray:
    return (ttft_s <= slo.ttft_s) & (itl_s <= slo.itl_s)


# ------------------------------------------------------------------------------------------ worker loop


@dataclass
class _WorkerOut:
    prefill_start_s: dict[int, float]
    prefill_end_s: dict[int, float]
    prefill_chunks: dict[int, int]
    decode_steps: dict[int, tuple[int, int]]  # request -> (first, last) worker step index
    admitted_s: dict[int, float]  # request -> when it joined the decode batch
    step_start_s: list[float]
    step_end_s: list[float]


_NONE: list[int] = []  # no prompt finished in this step (shared, never appended to)


class _Worker:
    """One worker's engine loop, resumable so that a pool's workers can run side by side under a router.

    `add(time_s, request)` hands it a request (an arrival, or on a decode worker a KV cache that is ready);
    `advance(until_s)` runs every step that starts before `until_s` (`math.inf`: until it is idle), so the
    router can read each worker's state at an arrival. A request that becomes ready while a step is in
    flight joins at the next step boundary (the engine plans a step at its start and never changes it), so
    its TTFT and first gap include the rest of that step, as the reference server's and vLLM's loops do.
    role: colocated | chunked | prefill | decode. Times in seconds.

    Filled in as it runs: `out` (per-request stage times and each step's start and end), `left` (time,
    request) for every request whose last token was produced, in time order, and `prefilled` (time,
    request) for every prompt whose prefill ended (its consumer drains it)."""

    def __init__(self, run: _Run, role: Role, log: StepLog | None, worker_id: int) -> None:
        self.role, self.run, self.log, self.worker_id = role, run, log, worker_id
        self.out = _WorkerOut({}, {}, {}, {}, {}, [], [])
        self.pending: list[tuple[float, int]] = []  # heap of (ready time, request)
        self.waiting: deque[int] = deque()  # prompts not yet (fully) prefilled, FCFS
        self.remaining: dict[int, int] = {}  # request -> prefill tokens still to do (chunked)
        self.finish_heap: list[tuple[int, int]] = []  # (last decode step index, request)
        self.joining: list[int] = []  # requests whose first decode step is the next step
        self.decode_n = 0
        self.context_sum = 0
        self.t = 0.0
        self.k = 0  # this worker's step index
        self.left: list[tuple[float, int]] = []
        self.prefilled: list[tuple[float, int]] = []
        self.max_batch = 0  # the largest decode batch any of its steps ran
        self.max_context = 0  # the largest context (tokens) any of its steps attended over

    def add(self, time_s: float, request: int) -> None:
        heapq.heappush(self.pending, (time_s, request))

    def _take_ready(self) -> None:
        """Everything ready by the boundary `t` joins the step planned there (arrivals queue, KV caches join)."""
        pending, t = self.pending, self.t
        while pending and pending[0][0] <= t:
            request = heapq.heappop(pending)[1]
            if self.role == Role.DECODE:
                self.joining.append(request)
            else:
                self.waiting.append(request)
                self.remaining[request] = int(self.run.prefill_need[request])

    def _plan_prefill(self) -> tuple[int, int, list[int]]:
        """This step's prefill work: (tokens, attention in tokens^2, prompts it finishes)."""
        if not self.waiting:
            return 0, 0, []
        params, out = self.run.params, self.out
        max_running = params.max_running_requests
        room = max_running - self.decode_n - len(self.joining) if self.role != Role.PREFILL else max_running
        if self.role == Role.CHUNKED:
            left = self.run.chunk_budget_tokens - self.decode_n
            return _chunked_prefill(self.waiting, self.remaining, self.run.prefill_need, left, room, self.t, out)
        return _whole_prefill(self.waiting, self.remaining, room, params.max_prefill_tokens_per_step, self.t, out)

    def advance(self, until_s: float) -> None:
        """Run every step that starts before `until_s` (seconds); stop at a boundary at or past it.

        The hot loop of every simulation: state lives in locals while it runs (stored back on the way out)."""
        pending, joining, finish_heap = self.pending, self.joining, self.finish_heap
        decode_n, context_sum, t, k = self.decode_n, self.context_sum, self.t, self.k
        run, out, decode_role = self.run, self.out, self.role == Role.DECODE
        decode_need, context_at_decode = run.decode_need, run.context_at_decode
        max_running = run.params.max_running_requests
        step = run.costs.step
        base, ctx_c, req_c = step.base_s, step.context_s_per_token, step.decode_s_per_request
        pre_b, pre_c = step.prefill_s_per_token, step.prefill_s_per_token2
        knee, extra, roof = step.max_batch_seen, step.beyond_extra_s, step.roofline_from_batch
        priced_past_knee = extra != 0 or roof != float("inf")  # else a step past the knee costs as fitted
        gemm_knee, prefill_floor = step.gemm_knee_tokens, step.prefill_floor_s
        decode_gemm = 1 if gemm_knee > 0 else 0  # an accelerator's passes: a decode runs a GEMM token too
        while pending or self.waiting or decode_n or joining:
            if not (self.waiting or decode_n or joining) and pending[0][0] > t:
                if pending[0][0] >= until_s:
                    break  # idle: a request may still be routed here before its next arrival
                t = pending[0][0]
            if t >= until_s:
                break
            if pending and pending[0][0] <= t:
                self.t = t
                self._take_ready()
            if joining:
                room = max(0, max_running - decode_n) if decode_role else len(joining)
                admitted, joining[:] = joining[:room], joining[room:]
                context_sum += _admit(admitted, k, t, decode_need, context_at_decode, finish_heap, out)
                decode_n += len(admitted)
            self.decode_n, self.t = decode_n, t
            prefill_tokens, attention, done = self._plan_prefill() if self.waiting else (0, 0, _NONE)
            if not prefill_tokens and not decode_n:
                if not pending:
                    break
                t = max(t, pending[0][0])  # nothing runnable until the next arrival
                continue
            # StepCosts.step_s inline; linear costs have no GEMM knee, no decode GEMM tokens and no floor.
            gemm_tokens = max(0, decode_gemm * decode_n + prefill_tokens - gemm_knee)
            duration = (
                base
                + ctx_c * context_sum
                + req_c * decode_n
                + pre_b * gemm_tokens
                + pre_c * attention
                + prefill_floor * (prefill_tokens > 0)
            )
            if priced_past_knee and decode_n > knee:
                duration += extra * (decode_n - knee)
                if decode_n > roof:
                    duration += pre_b * (decode_n - roof)
            self.context_sum = context_sum
            t = self._step(duration, prefill_tokens, attention)
            # Every running request gained one token; those at their last token leave.
            context_sum += decode_n
            while finish_heap and finish_heap[0][0] == k:
                request = heapq.heappop(finish_heap)[1]
                decode_n -= 1
                context_sum -= int(context_at_decode[request]) + int(decode_need[request])
                self.left.append((t, request))
            if done:
                self._prefills_end(done, t)
            k += 1
        self.decode_n, self.context_sum, self.t, self.k = decode_n, context_sum, t, k

    def _step(self, duration: float, prefill_tokens: int, attention: int) -> float:
        """Run the planned step of `duration` seconds from `t` (noise, log, extremes); returns its end."""
        run, t = self.run, self.t
        if run.noise is not None:
            duration *= run.noise.step(self.worker_id, prefill_tokens, self.decode_n)
        if self.log is not None:
            self.log.append(self.worker_id, t, duration, self.decode_n, prefill_tokens, self.context_sum, attention)
        if self.decode_n > self.max_batch:
            self.max_batch = self.decode_n
        if self.context_sum > self.max_context:
            self.max_context = self.context_sum
        self.out.step_start_s.append(t)
        self.out.step_end_s.append(t + duration)
        return t + duration

    def _prefills_end(self, done: list[int], t: float) -> None:
        """Prompts whose prefill ended at `t`: they decode from the next step on (not on a prefill worker)."""
        decodes, decode_need = self.role != Role.PREFILL, self.run.decode_need
        for request in done:
            self.out.prefill_end_s[request] = t
            self.prefilled.append((t, request))
            if decodes and decode_need[request] > 0:
                self.joining.append(request)
            elif decodes:
                self.left.append((t, request))  # its one token was the prefill's

    def take_left(self) -> list[tuple[float, int]]:
        """(time, request) of every request that finished since the last call, in time order."""
        left, self.left = self.left, []
        return left

    def take_prefilled(self) -> list[tuple[float, int]]:
        """(time, request) of every prompt whose prefill ended since the last call, in time order."""
        prefilled, self.prefilled = self.prefilled, []
        return prefilled


def _admit(
    admitted: list[int],
    k: int,
    t: float,
    decode_need: np.ndarray,
    context_at_decode: np.ndarray,
    finish_heap: list[tuple[int, int]],
    out: _WorkerOut,
) -> int:
    """Start decoding `admitted` at step `k` (time `t`); returns the context tokens they add to the batch."""
    added = 0
    for request in admitted:
        need = int(decode_need[request])
        heapq.heappush(finish_heap, (k + need - 1, request))
        out.decode_steps[request] = (k, k + need - 1)
        out.admitted_s[request] = t
        added += int(context_at_decode[request])
    return added


def _chunked_prefill(
    waiting: deque[int],
    remaining: dict[int, int],
    prefill_need: np.ndarray,
    left: int,
    room: int,
    t: float,
    out: _WorkerOut,
) -> tuple[int, int, list[int]]:
    """Chunks of the waiting prompts, FCFS, up to `left` tokens and `room` requests in this step:
    (prefill tokens, attention work in tokens^2, prompts finished). Finished prompts leave `waiting`."""
    prefill_tokens = attention = 0
    done: list[int] = []
    for request in waiting:
        if left <= 0 or room <= 0:
            break
        rest = remaining[request]
        take = min(left, rest)
        if request not in out.prefill_start_s:
            out.prefill_start_s[request] = t
        out.prefill_chunks[request] = out.prefill_chunks.get(request, 0) + 1
        # The chunk attends over the part of its prompt already prefilled.
        offset = int(prefill_need[request]) - rest
        attention += (offset + take) * (offset + take) - offset * offset
        remaining[request] = rest - take
        left -= take
        prefill_tokens += take
        room -= 1
        if remaining[request] == 0:
            done.append(request)
    for _ in done:
        del remaining[waiting.popleft()]  # FCFS: finished prompts are always at the front
    return prefill_tokens, attention, done


def _whole_prefill(
    waiting: deque[int], remaining: dict[int, int], room: int, cap_tokens: int, t: float, out: _WorkerOut
) -> tuple[int, int, list[int]]:
    """Whole prompts, FCFS, up to `room` requests and `cap_tokens` (at least one prompt) in this step:
    (prefill tokens, attention work in tokens^2, prompts finished). Finished prompts leave `waiting`."""
    prefill_tokens = attention = 0
    done: list[int] = []
    for request in waiting:
        need = remaining[request]
        if room <= 0 or (done and prefill_tokens + need > cap_tokens):
            break
        out.prefill_start_s[request] = t
        out.prefill_chunks[request] = 1
        prefill_tokens += need
        attention += need * need
        room -= 1
        done.append(request)
    for _ in done:
        del remaining[waiting.popleft()]
    return prefill_tokens, attention, done


def _gap_stats(
    members: np.ndarray,
    bounds: np.ndarray,
    ends: np.ndarray,
    first_token: np.ndarray,
    p99_out: np.ndarray,
    max_out: np.ndarray,
    mean_out: np.ndarray,
    joined: np.ndarray | None = None,
) -> None:
    """Per-request gap p99 (numpy's linear interpolation), max and mean for requests decoded on one worker,
    vectorised: request r's gaps are [ends[first] - first_token[r]] + diff(ends[first..last]). `joined`
    ([requests, width] bool, `joined_tokens`): tokens the client got with the one before (gap 0)."""
    counts = bounds[:, 1] - bounds[:, 0] + 1
    width = int(counts.max())
    step_gaps = np.diff(ends, prepend=ends[0])
    offsets = np.arange(1, width)
    index = bounds[:, :1] + offsets  # [requests, width-1]
    valid = offsets < counts[:, None]
    matrix = np.empty((len(members), width))
    matrix[:, 0] = ends[bounds[:, 0]] - first_token[members]
    matrix[:, 1:] = np.where(valid, step_gaps[np.minimum(index, len(ends) - 1)], -np.inf)
    if joined is not None:
        _join_gaps(matrix, joined & np.concatenate((np.zeros((len(members), 1), bool), valid), axis=1))
    rank = 0.99 * (counts - 1)  # position of p99 in the ascending order of each request's gaps
    top = int((counts - np.floor(rank)).max())  # the p99 lies among each row's `top` largest gaps
    top = min(top, width)
    largest = np.sort(np.partition(matrix, width - top, axis=1)[:, width - top :], axis=1)  # ascending
    low = np.floor(rank).astype(np.int64) - (counts - top)  # index into `largest`
    rows = np.arange(len(members))
    below = largest[rows, low]
    above = largest[rows, np.minimum(low + 1, top - 1)]
    p99_out[members] = below + (rank - np.floor(rank)) * (above - below)
    max_out[members] = largest[:, -1]
    mean_out[members] = (ends[bounds[:, 1]] - first_token[members]) / counts


_JOINS_STREAM = 0x4A0  # seeds the joined-token draws apart from the step noise's


def joined_tokens(rng: np.random.Generator, requests: int, width: int, share: float) -> np.ndarray | None:
    """Which of each request's first `width` gaps the client saw joined to the gap before ([requests, width]
    bool, column 0 never: the first decode token's own gap), each token by itself with probability
    `share`; None when `share` is 0. Draws requests * width uniforms in one call."""
    if share <= 0 or width < 2:
        return None
    joined = rng.random((requests, width)) < share
    joined[:, 0] = False
    return joined


def _join_gaps(gaps: np.ndarray, joined: np.ndarray) -> None:
    """In place: a joined gap moves into the gap before it and becomes 0, as the router records a token that
    came with the one before; a run of joined tokens adds up into the gap that opens it. Vectorised: each
    unjoined gap opens a group (column 0 always does, so no group crosses a row), and a group's sum lands on
    its opening gap."""
    opens = ~joined
    opens[:, 0] = True
    group = np.cumsum(opens.ravel()) - 1
    sums = np.bincount(group, weights=gaps.ravel())
    gaps[:] = np.where(opens, sums[group].reshape(gaps.shape), 0.0)


# ------------------------------------------------------------------------------------------ simulation


def simulate(
    layout: Layout,
    workload: Workload,
    costs: Costs,
    slo: SLO | None = None,
    *,
    params: EngineParams = EngineParams(),
    noise_sigma: float = 0.0,
    step_noise: StepNoise | None = None,
    seed: int = 0,
    record: bool = False,
) -> SimResult:
    """Serve `workload` on `layout` under `costs`; per-request TTFT, inter-token gap statistics, end-to-end.

    `noise_sigma` > 0 multiplies every step and transfer time by a lognormal factor (synthetic traces);
    `step_noise` (measured, noise.py) then prices the steps of each kind it has residuals for instead.
    With `record`, the result also carries every step and each request's stage timeline.
    Blocking, CPU only; runs in time linear in the number of steps.
    """
    noise = NoiseDraws(np.random.default_rng(seed), noise_sigma, step_noise) if noise_sigma > 0 or step_noise else None
    run = _Run.of(workload, costs, params, layout, noise, record)
    if layout.mode != Mode.DISAGGREGATED:
        _serve_colocated(run, layout)
    else:
        _serve_disaggregated(run, layout)
    itl_p50, itl_p99, itl_max, itl_mean = (np.zeros(run.n) for _ in range(4))
    e2e = run.first_token - run.arrival
    joins_rng = np.random.default_rng((seed, _JOINS_STREAM))  # its own stream: noise draws stay as they were
    joined_of: dict[int, np.ndarray] = {}  # request -> its joined tokens, for `_record`
    for worker, ends in run.decode_step_ends.items():
        members = np.array(
            [r for r, w in enumerate(run.decode_worker) if w == worker and r in run.decode_span], dtype=np.int64
        )
        if len(members):
            bounds = np.array([run.decode_span[int(r)] for r in members], dtype=np.int64)
            width = int((bounds[:, 1] - bounds[:, 0]).max()) + 1
            joined = joined_tokens(joins_rng, len(members), width, costs.joined_token_share)
            _gap_stats(members, bounds, ends, run.first_token, itl_p99, itl_max, itl_mean, joined)
            e2e[members] = ends[bounds[:, 1]] - run.arrival[members]
            if record and joined is not None:
                joined_of.update(zip(members.tolist(), joined))
    result = SimResult(
        layout,
        run.first_token - run.arrival + costs.frontend_s,
        itl_p50,
        itl_p99,
        itl_max,
        itl_mean,
        e2e + costs.frontend_s,
        max_batch=run.max_batch,
        max_context_tokens=run.max_context,
    )
    if slo is not None:
        result.attainment = result.attainment_for(slo)
    if record:
        _record(run, result, e2e, joined_of)
    return result


@dataclass
class _Run:
    """One simulation's inputs (per-request arrays) and what the workers fill in."""

    arrival: np.ndarray
    prompt: np.ndarray
    prefill_need: np.ndarray
    decode_need: np.ndarray
    context_at_decode: np.ndarray
    order: np.ndarray  # requests by arrival
    session: np.ndarray  # session-sticky routing's key per request
    costs: Costs
    params: EngineParams
    chunk_budget_tokens: int
    noise: NoiseDraws | None
    steps: dict[str, StepLog] | None  # pool -> steps, when recording
    first_token: np.ndarray = field(init=False)
    prefill_start: np.ndarray = field(init=False)
    prefill_end: np.ndarray = field(init=False)
    prefill_chunks: np.ndarray = field(init=False)
    prefill_worker: np.ndarray = field(init=False)
    decode_worker: np.ndarray = field(init=False)
    transfer_start: np.ndarray = field(init=False)
    transfer_end: np.ndarray = field(init=False)
    decode_span: dict[int, tuple[int, int]] = field(default_factory=dict)  # request -> (first, last) step
    decode_step_ends: dict[int, np.ndarray] = field(default_factory=dict)  # decode worker -> step end times
    decode_step_starts: dict[int, list[float]] = field(default_factory=dict)
    max_batch: int = 0
    max_context: int = 0

    @classmethod
    def of(
        cls,
        workload: Workload,
        costs: Costs,
        params: EngineParams,
        layout: Layout,
        noise: NoiseDraws | None,
        record: bool,
    ) -> _Run:
        arrival = np.asarray(workload.arrival_s, dtype=float)
        prompt = np.asarray(workload.prompt_tokens, dtype=np.int64)
        cached = np.minimum(np.asarray(workload.cached_tokens, dtype=np.int64), prompt - 1)
        output = np.maximum(np.asarray(workload.output_tokens, dtype=np.int64), 1)
        return cls(
            arrival,
            prompt,
            np.maximum(prompt - cached, 1),
            output - 1,
            prompt + 1,
            np.argsort(arrival, kind="stable"),
            np.arange(len(arrival)) if workload.session is None else np.asarray(workload.session, dtype=np.int64),
            costs,
            params,
            layout.chunk_budget_tokens,
            noise,
            {} if record else None,
        )

    def __post_init__(self) -> None:
        n = self.n
        self.first_token, self.prefill_start, self.prefill_end = np.zeros(n), np.zeros(n), np.zeros(n)
        self.prefill_chunks = np.ones(n, dtype=np.int64)
        self.prefill_worker, self.decode_worker = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        self.transfer_start, self.transfer_end = np.full(n, np.nan), np.full(n, np.nan)

    @property
    def n(self) -> int:
        return len(self.arrival)

    def pool(self, role: Role, count: int) -> list[_Worker]:
        """The `count` workers of one pool, sharing its step log when recording."""
        log = StepLog() if self.steps is not None else None
        if self.steps is not None and log is not None:
            self.steps[POOL_OF_ROLE[role]] = log
        return [_Worker(self, role, log, w) for w in range(count)]

    def keep_decode_steps(self, workers: list[_Worker]) -> None:
        for w, worker in enumerate(workers):
            self.decode_span.update(worker.out.decode_steps)
            self.decode_step_ends[w] = np.asarray(worker.out.step_end_s)
            self.decode_step_starts[w] = worker.out.step_start_s
            self.max_batch = max(self.max_batch, worker.max_batch)
            self.max_context = max(self.max_context, worker.max_context)


class _Load:
    """What the router counts per worker: requests (and prompt tokens) routed there and not yet finished.

    The reference router keeps this count itself (it is the only client of its workers): a request counts
    from its arrival until its stream ends on a colocated or decode worker, and until its prefill (KV sent
    included) returns on a prefill worker."""

    def __init__(self, count: int) -> None:
        self.requests = [0] * count
        self.tokens = [0] * count
        self.leaving: list[tuple[float, int, int, int]] = []  # heap of (time, request, worker, tokens)

    def assign(self, worker: int, tokens: int = 0) -> None:
        self.requests[worker] += 1
        self.tokens[worker] += tokens

    def leave(self, time_s: float, request: int, worker: int, tokens: int = 0) -> None:
        heapq.heappush(self.leaving, (time_s, request, worker, tokens))

    def settle(self, now_s: float) -> None:
        """Forget every request that finished by `now_s` (seconds)."""
        leaving = self.leaving
        while leaving and leaving[0][0] <= now_s:
            _, _, worker, tokens = heapq.heappop(leaving)
            self.requests[worker] -= 1
            self.tokens[worker] -= tokens

    def least(self, by_tokens: bool = False) -> int:
        """The worker with the least outstanding (fewest tokens, then requests; ties: the first)."""
        if by_tokens:
            return min(range(len(self.requests)), key=lambda w: (self.tokens[w], self.requests[w]))
        return min(range(len(self.requests)), key=self.requests.__getitem__)


def _sticky(session: np.ndarray, workers: int) -> np.ndarray:
    """Rendezvous hashing, as the reference router's `user` stickiness: each session goes to the worker
    with the highest hash of (session, worker), so a session's requests meet their prefix cache."""
    with np.errstate(over="ignore"):
        key: np.ndarray = np.multiply(session.astype(np.uint64)[:, None], np.uint64(0x9E3779B97F4A7C15))
        key = np.add(key, np.arange(1, workers + 1, dtype=np.uint64))
        # splitmix64's finaliser: neighbouring keys get unrelated hashes.
        for shift, factor in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
            key = np.multiply(np.bitwise_xor(key, np.right_shift(key, np.uint64(shift))), np.uint64(factor))
        key = np.bitwise_xor(key, np.right_shift(key, np.uint64(31)))
    return np.argmax(key, axis=1)


def _fixed_placement(run: _Run, count: int) -> np.ndarray:
    """Round-robin in arrival order, or session-sticky: placements that need no worker's state."""
    if run.params.router == "session":
        return _sticky(run.session, count)
    placement = np.empty(run.n, dtype=np.int64)
    placement[run.order] = np.arange(run.n) % count
    return placement


def _serve_colocated(run: _Run, layout: Layout) -> None:
    """Colocated or chunked workers: each request prefills and decodes on the worker its router picks."""
    count = layout.workers
    (role,) = ROLES_OF_MODE[layout.mode]
    workers = run.pool(role, count)
    if run.params.router == "least-outstanding" and count > 1:
        load = _Load(count)
        for request in run.order:
            now = float(run.arrival[request])
            for w, worker in enumerate(workers):
                worker.advance(now)
                for end, leaving in worker.take_left():
                    load.leave(end, leaving, w)
            load.settle(now)
            w = load.least()
            load.assign(w)
            workers[w].add(now, int(request))
            run.prefill_worker[request] = run.decode_worker[request] = w
    else:
        placement = _fixed_placement(run, count)
        for request in run.order:
            workers[int(placement[request])].add(float(run.arrival[request]), int(request))
        run.prefill_worker[:] = run.decode_worker[:] = placement
    for worker in workers:
        worker.advance(math.inf)
    for worker in workers:
        out = worker.out
        for request, end in out.prefill_end_s.items():
            run.prefill_end[request] = run.first_token[request] = end
            run.prefill_start[request] = out.prefill_start_s[request]
            run.prefill_chunks[request] = out.prefill_chunks[request]
    run.keep_decode_steps(workers)


def _ship(run: _Run, w: int, worker: _Worker, link_free: list[float], load: _Load) -> list[tuple[float, int]]:
    """KV caches of the prompts prefill worker `w` finished since last time cross its link (FIFO), one at a
    time; returns (ready time, request) for each. A prompt counts on `load` until its KV is sent."""
    transfer = run.costs.transfer
    shipped: list[tuple[float, int]] = []
    for end, request in worker.take_prefilled():
        run.prefill_start[request] = worker.out.prefill_start_s[request]
        run.prefill_end[request] = end
        wire_s = float(run.prompt[request]) * transfer.kv_bytes_per_token / transfer.link_bytes_per_s
        if run.noise is not None:
            wire_s *= run.noise.wire()
        start = max(end, link_free[w])
        link_free[w] = start + wire_s
        ready = link_free[w] + transfer.constant_s
        run.transfer_start[request], run.transfer_end[request] = start, ready
        run.first_token[request] = ready
        load.leave(ready, request, w, int(run.prompt[request]))
        shipped.append((ready, request))
    return shipped


def _deliver(run: _Run, shipped: list[tuple[float, int]], decode: list[_Worker], load: _Load) -> None:
    """KV caches become ready on the decode workers picked at their arrival; a request whose first token
    was its last ends there (its stream closes with it)."""
    for ready, request in shipped:
        d = int(run.decode_worker[request])
        if run.decode_need[request] > 0:
            decode[d].add(ready, request)
        else:
            load.leave(ready, request, d)


def _route_split(run: _Run, prefill: list[_Worker], decode: list[_Worker], link_free: list[float]) -> None:
    """Each arrival, in time order, goes to the prefill worker with the fewest prompt tokens in flight (or
    its session's) and the decode worker with the fewest requests in flight, both read at its arrival,
    as the reference router does: it opens the decode stream first, then posts the prompt."""
    prefill_load, decode_load = _Load(len(prefill)), _Load(len(decode))
    sticky = _sticky(run.session, len(prefill)) if run.params.router == "session" else None
    for request in run.order:
        now = float(run.arrival[request])
        for w, worker in enumerate(prefill):
            worker.advance(now)
            _deliver(run, _ship(run, w, worker, link_free, prefill_load), decode, decode_load)
        for w, worker in enumerate(decode):
            worker.advance(now)
            for end, leaving in worker.take_left():
                decode_load.leave(end, leaving, w)
        prefill_load.settle(now)
        decode_load.settle(now)
        p = int(sticky[request]) if sticky is not None else prefill_load.least(by_tokens=True)
        d = decode_load.least()
        prefill_load.assign(p, int(run.prompt[request]))
        decode_load.assign(d)
        prefill[p].add(now, int(request))
        run.prefill_worker[request], run.decode_worker[request] = p, d
    for w, worker in enumerate(prefill):
        worker.advance(math.inf)
        _deliver(run, _ship(run, w, worker, link_free, prefill_load), decode, decode_load)


def _serve_disaggregated(run: _Run, layout: Layout) -> None:
    """Prefill workers, a FIFO link per prefill worker, then decode workers. Under round-robin, decode
    workers take KV caches in ready order; else the router picks both workers at arrival (`_route_split`)."""
    p_count, d_count = layout.prefill_workers, layout.decode_workers
    prefill = run.pool(Role.PREFILL, p_count)
    decode = run.pool(Role.DECODE, d_count)
    link_free = [0.0] * p_count
    if run.params.router == "round-robin":
        placement = _fixed_placement(run, p_count)
        for request in run.order:
            prefill[int(placement[request])].add(float(run.arrival[request]), int(request))
        run.prefill_worker[:] = placement
        ignored = _Load(p_count)
        for w, worker in enumerate(prefill):
            worker.advance(math.inf)
            _ship(run, w, worker, link_free, ignored)
        for position, request in enumerate(np.argsort(run.first_token, kind="stable")):
            run.decode_worker[request] = position % d_count
            if run.decode_need[request] > 0:
                decode[position % d_count].add(float(run.first_token[request]), int(request))
    else:
        _route_split(run, prefill, decode, link_free)
    for worker in decode:
        worker.advance(math.inf)
        # The decode worker streams the first token when it admits the request (as vLLM's and Dynamo's
        # decode engines do), so a full decode pool shows in TTFT rather than as one hidden gap.
        for request, admitted in worker.out.admitted_s.items():
            run.first_token[request] = max(run.first_token[request], admitted)
    run.keep_decode_steps(decode)


def _record(run: _Run, result: SimResult, e2e: np.ndarray, joined_of: dict[int, np.ndarray]) -> None:
    """Exact per-request gaps, medians, steps and stage timelines for the trace writer; slow, once per trace."""
    gaps_all = [np.empty(0)] * run.n
    for request, span in run.decode_span.items():
        ends = run.decode_step_ends[int(run.decode_worker[request])][span[0] : span[1] + 1]
        gaps_all[request] = np.diff(ends, prepend=run.first_token[request])
        if request in joined_of:
            gaps = gaps_all[request][None, :]
            _join_gaps(gaps, joined_of[request][None, : gaps.shape[1]])
        result.itl_p50_s[request] = np.median(gaps_all[request])
    decode_start = np.array(
        [
            run.decode_step_starts[int(run.decode_worker[r])][run.decode_span[r][0]]
            if r in run.decode_span
            else run.first_token[r]
            for r in range(run.n)
        ]
    )
    result.timeline = {
        "arrival_s": run.arrival,
        "prefill_start_s": run.prefill_start,
        "prefill_end_s": run.prefill_end,
        "prefill_chunks": run.prefill_chunks,
        "prefill_worker": run.prefill_worker,
        "decode_worker": run.decode_worker,
        "transfer_start_s": run.transfer_start,
        "transfer_end_s": run.transfer_end,
        "first_token_s": run.first_token,
        "decode_start_s": np.maximum(decode_start, run.first_token),
        "end_s": run.arrival + e2e,
    }
    result.steps = run.steps
    result.token_gaps = gaps_all
