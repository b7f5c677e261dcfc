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

Step time follows DistServe's fitted forms, summed for a mixed step (see `StepCosts`). Requests are routed
round-robin, which lets each worker be simulated on its own: the whole model is a few tight loops over
steps, with no per-token Python objects, so a goodput search of dozens of runs takes well under a second.

Pure computation; no I/O, no threads. Times are seconds from the start of the workload.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

import numpy as np

MODES = ("colocated", "chunked", "disaggregated")
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
    """

    base_s: float
    context_s_per_token: float
    decode_s_per_request: float
    prefill_s_per_token: float
    prefill_s_per_token2: float = 0.0

    def step_s(self, decode_requests: int, context_tokens: int, prefill_tokens: int,
               prefill_attention_tokens2: float | None = None) -> float:
        """Seconds; `prefill_attention_tokens2` defaults to one prompt's whole prefill (P^2)."""
        attention = prefill_tokens * prefill_tokens if prefill_attention_tokens2 is None else prefill_attention_tokens2
        return (
            self.base_s
            + self.context_s_per_token * context_tokens
            + self.decode_s_per_request * decode_requests
            + self.prefill_s_per_token * prefill_tokens
            + self.prefill_s_per_token2 * attention
        )

    def chunk_s(self, offset_tokens: int, chunk_tokens: int) -> float:
        """The prefill part of one chunk of `chunk_tokens` at `offset_tokens` in its prompt (seconds)."""
        return self.prefill_s_per_token * chunk_tokens + self.prefill_s_per_token2 * (
            (offset_tokens + chunk_tokens) ** 2 - offset_tokens**2
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


@dataclass(frozen=True)
class EngineParams:
    """Scheduler limits shared by every simulated worker."""

    max_running_requests: int = 256
    # Whole prefills batched into one colocated or prefill-only step (at least one prompt always joins).
    max_prefill_tokens_per_step: int = 8192


@dataclass(frozen=True)
class Layout:
    """A deployment: `colocated`/`chunked` with `workers`, or `disaggregated` with prefill:decode workers."""

    mode: str
    workers: int = 0
    prefill_workers: int = 0
    decode_workers: int = 0
    chunk_budget_tokens: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown layout mode {self.mode!r}; expected one of {MODES}")
        if self.mode == "disaggregated":
            if self.prefill_workers < 1 or self.decode_workers < 1:
                raise ValueError("a disaggregated layout needs at least one prefill and one decode worker")
        elif self.workers < 1:
            raise ValueError(f"a {self.mode} layout needs at least one worker")
        if self.mode == "chunked" and self.chunk_budget_tokens < 1:
            raise ValueError("a chunked layout needs a positive chunk_budget_tokens")

    @property
    def gpus(self) -> int:
        return self.prefill_workers + self.decode_workers if self.mode == "disaggregated" else self.workers

    @property
    def ratio(self) -> str | None:
        return f"{self.prefill_workers}:{self.decode_workers}" if self.mode == "disaggregated" else None

    @property
    def label(self) -> str:
        if self.mode == "disaggregated":
            return f"split {self.ratio}"
        if self.mode == "chunked":
            return f"chunked {self.chunk_budget_tokens} x{self.workers}"
        return f"colocated x{self.workers}"


@dataclass(frozen=True)
class Workload:
    """Requests to serve, in arrival order. Arrays of equal length; times in seconds."""

    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    cached_tokens: np.ndarray
    output_tokens: np.ndarray  # including the first token, which the prefill produces

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        if not (len(self.prompt_tokens) == len(self.cached_tokens) == len(self.output_tokens) == n):
            raise ValueError("workload arrays must have equal lengths")

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def rate_per_s(self) -> float:
        span_s = float(self.arrival_s[-1] - self.arrival_s[0]) if len(self) > 1 else 0.0
        return (len(self) - 1) / span_s if span_s > 0 else 0.0

    def head(self, n: int) -> Workload:
        """The first `n` requests."""
        return Workload(self.arrival_s[:n], self.prompt_tokens[:n], self.cached_tokens[:n], self.output_tokens[:n])

    def scaled_to_rate(self, rate_per_s: float) -> Workload:
        """The same requests and arrival pattern, with times stretched to a mean rate of `rate_per_s`."""
        current = self.rate_per_s
        if current <= 0 or rate_per_s <= 0:
            raise ValueError("cannot rescale a workload without a positive rate")
        start = self.arrival_s[0]
        arrivals = (self.arrival_s - start) * (current / rate_per_s)
        return Workload(arrivals, self.prompt_tokens, self.cached_tokens, self.output_tokens)

    def resample(self, n_requests: int, seed: int) -> Workload:
        """`n_requests` drawn with replacement: lengths jointly, inter-arrival gaps independently (bootstrap).

        Gaps keep the observed burstiness; with fewer than two arrivals they are Poisson.
        """
        rng = np.random.default_rng(seed)
        picks = rng.integers(0, len(self), n_requests)
        gaps = np.diff(self.arrival_s)
        gaps = gaps[gaps >= 0]
        if len(gaps) >= 1 and gaps.sum() > 0:
            drawn = rng.choice(gaps, n_requests)
        else:
            drawn = rng.exponential(1.0, n_requests)
        arrivals = np.concatenate(([0.0], np.cumsum(drawn[1:])))
        return Workload(arrivals, self.prompt_tokens[picks], self.cached_tokens[picks], self.output_tokens[picks])


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


def _run_worker(
    role: str,
    entries: list[tuple[float, int]],
    prefill_need: np.ndarray,
    context_at_decode: np.ndarray,
    decode_need: np.ndarray,
    step: StepCosts,
    params: EngineParams,
    chunk_budget_tokens: int,
    noise: np.random.Generator | None,
    noise_sigma: float,
    log: StepLog | None,
    worker_id: int,
) -> _WorkerOut:
    """Simulate one worker. `entries` are (time, request) in time order: arrivals, or KV-ready times for
    a decode worker. role: colocated | chunked | prefill | decode."""
    out = _WorkerOut({}, {}, {}, {}, {}, [], [])
    step_end = out.step_end_s
    pending = deque(entries)
    waiting: deque[int] = deque()  # prompts not yet (fully) prefilled, FCFS
    remaining: dict[int, int] = {}  # request -> prefill tokens still to do (chunked)
    finish_heap: list[tuple[int, int]] = []  # (last decode step index, request)
    joining: list[int] = []  # requests whose first decode step is the next step
    decode_n = 0
    context_sum = 0
    t = 0.0
    k = 0  # this worker's step index
    decodes = role != "prefill"
    budget = chunk_budget_tokens
    max_running = params.max_running_requests
    cap_tokens = params.max_prefill_tokens_per_step
    base, ctx_c, req_c = step.base_s, step.context_s_per_token, step.decode_s_per_request
    pre_b, pre_c = step.prefill_s_per_token, step.prefill_s_per_token2

    while pending or waiting or decode_n or joining:
        if not (waiting or decode_n or joining) and pending and pending[0][0] > t:
            t = pending[0][0]
        while pending and pending[0][0] <= t:
            request = pending.popleft()[1]
            if role == "decode":
                joining.append(request)
            else:
                waiting.append(request)
                remaining[request] = int(prefill_need[request])
        # Requests whose prefill just ended (or whose KV arrived) start decoding in this step.
        if joining:
            admitted = joining[: max(0, max_running - decode_n)] if role == "decode" else joining
            for request in admitted:
                need = int(decode_need[request])
                heapq.heappush(finish_heap, (k + need - 1, request))
                out.decode_steps[request] = (k, k + need - 1)
                out.admitted_s[request] = t
                context_sum += int(context_at_decode[request])
            decode_n += len(admitted)
            joining = joining[len(admitted):]
        # Prefill work in this step.
        prefill_tokens = 0
        attention = 0  # tokens^2: sum over chunks of (offset + n)^2 - offset^2
        done: list[int] = []
        if waiting:
            room = max_running - decode_n - len(joining) if decodes else max_running
            if role == "chunked":
                left = budget - decode_n
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
            else:
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
                del remaining[waiting.popleft()]  # FCFS: finished prompts are always at the front
        if not prefill_tokens and not decode_n:
            # Nothing runnable (e.g. decode pool full with nothing finishing cannot happen; arrivals later).
            if pending:
                t = max(t, pending[0][0])
                continue
            break
        duration = base + ctx_c * context_sum + req_c * decode_n + pre_b * prefill_tokens + pre_c * attention
        if noise is not None:
            duration *= float(noise.lognormal(0.0, noise_sigma))
        if log is not None:
            log.worker.append(worker_id)
            log.start_s.append(t)
            log.duration_s.append(duration)
            log.decode_requests.append(decode_n)
            log.prefill_tokens.append(prefill_tokens)
            log.context_tokens.append(context_sum)
            log.prefill_attention_tokens2.append(attention)
        out.step_start_s.append(t)
        t += duration
        step_end.append(t)
        # Every running request gained one token; those at their last token leave.
        context_sum += decode_n
        while finish_heap and finish_heap[0][0] == k:
            request = heapq.heappop(finish_heap)[1]
            decode_n -= 1
            context_sum -= int(context_at_decode[request]) + int(decode_need[request])
        for request in done:
            out.prefill_end_s[request] = t
            if decodes and decode_need[request] > 0:
                joining.append(request)
        k += 1
    return out


def _gap_stats(
    members: np.ndarray,
    bounds: np.ndarray,
    ends: np.ndarray,
    first_token: np.ndarray,
    p99_out: np.ndarray,
    max_out: np.ndarray,
    mean_out: np.ndarray,
) -> None:
    """Per-request gap p99 (numpy's linear interpolation), max and mean for requests decoded on one worker,
    vectorised: request r's gaps are [ends[first] - first_token[r]] + diff(ends[first..last])."""
    counts = bounds[:, 1] - bounds[:, 0] + 1
    width = int(counts.max())
    step_gaps = np.diff(ends, prepend=ends[0])
    offsets = np.arange(1, width)
    index = bounds[:, :1] + offsets  # [requests, width-1]
    valid = offsets < counts[:, None]
    matrix = np.empty((len(members), width))
    matrix[:, 0] = ends[bounds[:, 0]] - first_token[members]
    matrix[:, 1:] = np.where(valid, step_gaps[np.minimum(index, len(ends) - 1)], -np.inf)
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


# ------------------------------------------------------------------------------------------ simulation


def simulate(
    layout: Layout,
    workload: Workload,
    costs: Costs,
    slo: SLO | None = None,
    *,
    params: EngineParams = EngineParams(),
    noise_sigma: float = 0.0,
    seed: int = 0,
    record: bool = False,
) -> SimResult:
    """Serve `workload` on `layout` under `costs`; per-request TTFT, inter-token gap statistics, end-to-end.

    `noise_sigma` > 0 multiplies every step and transfer time by a lognormal factor (synthetic traces).
    With `record`, the result also carries every step and each request's stage timeline.
    Blocking, CPU only; runs in time linear in the number of steps.
    """
    n = len(workload)
    arrival = np.asarray(workload.arrival_s, dtype=float)
    prompt = np.asarray(workload.prompt_tokens, dtype=np.int64)
    cached = np.minimum(np.asarray(workload.cached_tokens, dtype=np.int64), prompt - 1)
    output = np.maximum(np.asarray(workload.output_tokens, dtype=np.int64), 1)
    prefill_need = np.maximum(prompt - cached, 1)
    decode_need = output - 1
    context_at_decode = prompt + 1
    rng = np.random.default_rng(seed) if noise_sigma > 0 else None
    order = np.argsort(arrival, kind="stable")

    first_token = np.zeros(n)
    prefill_start = np.zeros(n)
    prefill_end = np.zeros(n)
    prefill_chunks = np.ones(n, dtype=np.int64)
    prefill_worker = np.zeros(n, dtype=np.int64)
    decode_worker = np.zeros(n, dtype=np.int64)
    transfer_start = np.full(n, np.nan)
    transfer_end = np.full(n, np.nan)
    decode_span: dict[int, tuple[int, int]] = {}
    decode_step_ends: dict[int, np.ndarray] = {}
    decode_step_starts: dict[int, list[float]] = {}
    steps: dict[str, StepLog] | None = {} if record else None

    def run(role: str, workers: int, entries_by_worker: list[list[tuple[float, int]]], pool: str) -> list[_WorkerOut]:
        log = StepLog() if record else None
        if steps is not None and log is not None:
            steps[pool] = log
        return [
            _run_worker(
                role, entries_by_worker[w], prefill_need, context_at_decode, decode_need, costs.step, params,
                layout.chunk_budget_tokens, rng, noise_sigma, log, w,
            )
            for w in range(workers)
        ]

    if layout.mode in ("colocated", "chunked"):
        w_count = layout.workers
        entries: list[list[tuple[float, int]]] = [[] for _ in range(w_count)]
        for position, request in enumerate(order):
            entries[position % w_count].append((float(arrival[request]), int(request)))
            prefill_worker[request] = decode_worker[request] = position % w_count
        outs = run(layout.mode, w_count, entries, "colocated")
        for w, out in enumerate(outs):
            for request, end in out.prefill_end_s.items():
                prefill_end[request] = first_token[request] = end
                prefill_start[request] = out.prefill_start_s[request]
                prefill_chunks[request] = out.prefill_chunks[request]
            decode_span.update(out.decode_steps)
            decode_step_ends[w] = np.asarray(out.step_end_s)
            decode_step_starts[w] = out.step_start_s
    else:
        p_count, d_count = layout.prefill_workers, layout.decode_workers
        entries = [[] for _ in range(p_count)]
        for position, request in enumerate(order):
            entries[position % p_count].append((float(arrival[request]), int(request)))
            prefill_worker[request] = position % p_count
        outs = run("prefill", p_count, entries, "prefill")
        transfer = costs.transfer
        for w, out in enumerate(outs):
            link_free = 0.0
            for request, end in sorted(out.prefill_end_s.items(), key=lambda item: item[1]):
                prefill_end[request] = end
                prefill_start[request] = out.prefill_start_s[request]
                wire_s = float(prompt[request]) * transfer.kv_bytes_per_token / transfer.link_bytes_per_s
                if rng is not None:
                    wire_s *= float(rng.lognormal(0.0, noise_sigma))
                start = max(end, link_free)
                link_free = start + wire_s
                transfer_start[request] = start
                transfer_end[request] = first_token[request] = link_free + transfer.constant_s
        ready_order = np.argsort(first_token, kind="stable")
        entries = [[] for _ in range(d_count)]
        for position, request in enumerate(ready_order):
            if decode_need[request] > 0:
                entries[position % d_count].append((float(first_token[request]), int(request)))
            decode_worker[request] = position % d_count
        outs = run("decode", d_count, entries, "decode")
        for w, out in enumerate(outs):
            # The decode worker streams the first token when it admits the request (as vLLM's and Dynamo's
            # decode engines do), so a full decode pool shows in TTFT rather than as one hidden gap.
            for request, admitted in out.admitted_s.items():
                first_token[request] = max(first_token[request], admitted)
            decode_span.update(out.decode_steps)
            decode_step_ends[w] = np.asarray(out.step_end_s)
            decode_step_starts[w] = out.step_start_s

    itl_p50, itl_p99, itl_max, itl_mean = (np.zeros(n) for _ in range(4))
    e2e = first_token - arrival
    for worker, ends in decode_step_ends.items():
        members = np.array([r for r, w in enumerate(decode_worker) if w == worker and r in decode_span], dtype=np.int64)
        if len(members):
            bounds = np.array([decode_span[int(r)] for r in members], dtype=np.int64)
            _gap_stats(members, bounds, ends, first_token, itl_p99, itl_max, itl_mean)
            e2e[members] = ends[bounds[:, 1]] - arrival[members]
    gaps_all: list[np.ndarray] | None = None
    if record:  # exact per-request gaps and medians for the trace writer; slow, but only once per trace
        gaps_all = [np.empty(0)] * n
        for request, span in decode_span.items():
            ends = decode_step_ends[int(decode_worker[request])][span[0] : span[1] + 1]
            gaps_all[request] = np.diff(ends, prepend=first_token[request])
            itl_p50[request] = np.median(gaps_all[request])

    result = SimResult(
        layout, first_token - arrival + costs.frontend_s, itl_p50, itl_p99, itl_max, itl_mean, e2e + costs.frontend_s
    )
    if slo is not None:
        result.attainment = result.attainment_for(slo)
    if record:
        decode_start = np.array(
            [decode_step_starts[int(decode_worker[r])][decode_span[r][0]] if r in decode_span else first_token[r] for r in range(n)]
        )
        result.timeline = {
            "arrival_s": arrival,
            "prefill_start_s": prefill_start,
            "prefill_end_s": prefill_end,
            "prefill_chunks": prefill_chunks,
            "prefill_worker": prefill_worker,
            "decode_worker": decode_worker,
            "transfer_start_s": transfer_start,
            "transfer_end_s": transfer_end,
            "first_token_s": first_token,
            "decode_start_s": np.maximum(decode_start, first_token),
            "end_s": arrival + e2e,
        }
        result.steps = steps
        result.token_gaps = gaps_all
    return result
