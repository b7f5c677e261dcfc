"""A ground-truth serving engine for the report's tests, written from first principles, token by token.

It shares no code with `tracer.report`: it is what the report's model is checked against. Each worker
runs engine iterations one after another; in every iteration each running request emits one token
(its own timestamp, kept per request), and waiting prompts are prefilled:

- colocated: whole prompts, first come first served, up to a token cap per iteration; a prompt's first
  token leaves when its prefill iteration ends, and it decodes from the next iteration on;
- chunked (Sarathi-Serve): the running requests' decode tokens first, then prompt chunks up to the token
  budget; a chunk of n tokens at offset c of its prompt attends over the c tokens before it;
- split: prefill workers run prefill-only iterations, each KV cache crosses its prefill worker's link
  (one transfer at a time, latency + bytes / bandwidth), and a decode worker admits it at the start of
  an iteration, when the first token is sent.

Iteration time is physics (`Physics.iteration_s`), optionally slowed by a periodic throttle that no cost
model sees (the self-check test). An iteration is planned at its start: a prompt arriving, or a KV cache
landing, while one runs joins the next. Requests are routed round-robin, or as the reference router does
(`Deployment.router`: least outstanding, every worker of the deployment run side by side in time order).
Blocking, pure Python; seconds.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Physics:
    """What one iteration costs on this hardware, and the link between pools."""

    iteration_base_s: float = 0.010
    per_context_token_s: float = 2e-7  # attention of every running request over its context
    per_running_request_s: float = 2e-3
    per_prefill_token_s: float = 1.2e-4
    per_attention_token2_s: float = 2e-8  # a chunk of n at offset c: (c + n)^2 - c^2 token pairs (x2)
    kv_bytes_per_token: float = 131072.0
    link_bytes_per_s: float = 12.5e9  # 100 Gb/s
    link_latency_s: float = 0.002
    # Outside any cost model: during every other `throttle_period_s`, iterations take `throttle_factor` x.
    throttle_period_s: float = 0.0
    throttle_factor: float = 1.0
    # How this hardware's spans are timed (`splitscope.timing.source`): host for these linear, CPU-like
    # costs; an accelerator's (gpu.py) by its events, as our tracer times a GPU.
    timing_source: str = "host"

    def iteration_s(
        self, now_s: float, running: int, context_tokens: int, prefill_tokens: int, attention_tokens2: int
    ) -> float:
        seconds = (
            self.iteration_base_s
            + self.per_context_token_s * context_tokens
            + self.per_running_request_s * running
            + self.per_prefill_token_s * prefill_tokens
            + self.per_attention_token2_s * attention_tokens2
        )
        if self.throttle_period_s > 0 and int(now_s // self.throttle_period_s) % 2 == 1:
            seconds *= self.throttle_factor
        return seconds

    def transfer_s(self, prompt_tokens: int) -> float:
        return self.link_latency_s + prompt_tokens * self.kv_bytes_per_token / self.link_bytes_per_s


@dataclass(frozen=True)
class Deployment:
    kind: str  # colocated | chunked | split
    workers: int = 0
    prefill_workers: int = 0
    decode_workers: int = 0
    budget_tokens: int = 0
    max_running: int = 256
    max_prefill_tokens: int = 8192  # whole prompts batched into one iteration (at least one)
    # round-robin in arrival order (a split's decode workers: in KV-ready order), or least-outstanding:
    # the reference router's fewest requests in flight (a prefill pool: fewest prompt tokens in flight).
    router: str = "round-robin"

    @property
    def gpus(self) -> int:
        return self.prefill_workers + self.decode_workers if self.kind == "split" else self.workers

    @property
    def name(self) -> str:
        if self.kind == "split":
            return f"split {self.prefill_workers}:{self.decode_workers}"
        if self.kind == "chunked":
            return f"chunked {self.budget_tokens}"
        return "colocated"


@dataclass
class Request:
    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int  # including the first token
    prefill_worker: int = -1
    decode_worker: int = -1
    prefill_start_s: float = -1.0
    prefill_end_s: float = -1.0
    chunks: int = 0
    transfer_start_s: float = -1.0
    transfer_end_s: float = -1.0
    first_token_s: float = -1.0
    token_s: list[float] = field(default_factory=list)  # every token after the first
    decode_start_s: float = -1.0
    end_s: float = -1.0
    prefilled: int = 0  # prompt tokens prefilled so far
    first_iteration: int = -1  # its worker's iteration that emits its second token
    # Positions (1 = the token after the first) whose text the front end held back until the next token
    # came (an incomplete character): the client gets both in one event, as a gap of the two steps then 0.
    held: frozenset[int] = frozenset()

    @property
    def gaps_s(self) -> np.ndarray:
        """The engine's gaps: one per token after the first."""
        return np.diff(np.array([self.first_token_s, *self.token_s])) if self.token_s else np.zeros(0)

    @property
    def client_gaps_s(self) -> np.ndarray:
        """The gaps the client saw, one per token after the first: an event carries a held token with the
        ones after it up to the first token not held (the last is never held); its first token gets the gap
        since the event before, the others 0."""
        times = [self.first_token_s, *self.token_s]
        gaps: list[float] = []
        last_event_s, waiting = times[0], 0
        for position in range(1, len(times)):
            if position in self.held and position < len(times) - 1:
                waiting += 1
                continue
            gaps += [times[position] - last_event_s] + [0.0] * waiting
            last_event_s, waiting = times[position], 0
        return np.array(gaps)

    @property
    def joined_tokens(self) -> int:
        """Tokens the client got in one event with the token before (the router's zero gaps)."""
        return sum(1 for position in self.held if position < len(self.token_s))

    def itl_s(self, stat: str, *, client: bool = True) -> float:
        """A statistic of the gaps the client saw (`client`) or of the engine's."""
        gaps = self.client_gaps_s if client else self.gaps_s
        if not len(gaps):
            return 0.0
        return float(
            {"p99": lambda g: np.percentile(g, 99), "max": np.max, "mean": np.mean, "p50": np.median}[stat](gaps)
        )

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s


@dataclass
class Iteration:
    pool: str
    worker: int
    start_s: float
    end_s: float
    running: int
    context_tokens: int
    prefill_tokens: int
    attention_tokens2: int
    # The ground truth `splitscope explain` is checked against: (request index, prompt tokens it
    # prefilled in this iteration) for every prompt or chunk the iteration ran, in batch order.
    prefills: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class Run:
    deployment: Deployment
    requests: list[Request]
    iterations: list[Iteration] | None
    kv_bytes_per_token: float
    timing_source: str = "host"  # the physics' (Physics.timing_source)

    def attainment(self, ttft_s: float, itl_s: float, itl_stat: str) -> float:
        ok = [0 <= r.ttft_s <= ttft_s and r.end_s >= 0 and r.itl_s(itl_stat) <= itl_s for r in self.requests]
        return sum(ok) / len(ok)


def serve(
    deployment: Deployment,
    arrival_s: np.ndarray,
    prompt_tokens: np.ndarray,
    output_tokens: np.ndarray,
    physics: Physics,
    noise_sigma: float = 0.0,
    seed: int = 0,
    record: bool = True,
    held_share: float = 0.0,
) -> Run:
    """Serve the requests on `deployment`; every request's token times, and (`record`) every iteration.
    `held_share`: each token after the first is held back by the front end with this probability (drawn per
    request and position from `seed` alone, so every rate of a goodput search holds the same tokens)."""
    rng = np.random.default_rng(seed)
    holds = np.random.default_rng((seed, 1))
    requests = [
        Request(i, float(a), int(p), max(1, int(o)), held=_held(holds, int(o), held_share))
        for i, (a, p, o) in enumerate(zip(arrival_s, prompt_tokens, output_tokens))
    ]
    by_arrival = sorted(requests, key=lambda r: r.arrival_s)
    iterations: list[Iteration] | None = [] if record else None

    def engines(role: str, pool: str, count: int) -> list[_Engine]:
        return [_Engine(role, pool, w, deployment, physics, rng, noise_sigma, iterations) for w in range(count)]

    if deployment.kind in ("colocated", "chunked"):
        pool = engines(deployment.kind, "colocated", deployment.workers)
        if deployment.router == "least-outstanding":
            _serve_least_outstanding(by_arrival, pool, [], physics, rng, noise_sigma)
        else:
            for turn, request in enumerate(by_arrival):
                request.prefill_worker = request.decode_worker = turn % deployment.workers
                pool[request.prefill_worker].give(request.arrival_s, request)
            for engine in pool:
                engine.run_out()
        return Run(deployment, requests, iterations, physics.kv_bytes_per_token, physics.timing_source)

    prefill = engines("prefill", "prefill", deployment.prefill_workers)
    decode = engines("decode", "decode", deployment.decode_workers)
    if deployment.router == "least-outstanding":
        _serve_least_outstanding(by_arrival, prefill, decode, physics, rng, noise_sigma)
        return Run(deployment, requests, iterations, physics.kv_bytes_per_token, physics.timing_source)
    for turn, request in enumerate(by_arrival):
        request.prefill_worker = turn % deployment.prefill_workers
        prefill[request.prefill_worker].give(request.arrival_s, request)
    for engine in prefill:
        engine.run_out()
        link = _Link()
        for request in sorted(
            (r for r in requests if r.prefill_worker == engine.worker), key=lambda r: r.prefill_end_s
        ):
            link.send(request, physics, rng, noise_sigma)
    ready = sorted(requests, key=lambda r: r.transfer_end_s)
    for turn, request in enumerate(ready):
        request.decode_worker = turn % deployment.decode_workers
        decode[request.decode_worker].give(request.transfer_end_s, request)
    for engine in decode:
        engine.run_out()
    return Run(deployment, requests, iterations, physics.kv_bytes_per_token, physics.timing_source)


def _held(rng: np.random.Generator, output_tokens: int, share: float) -> frozenset[int]:
    if share <= 0:
        return frozenset()
    draws = rng.random(max(output_tokens, 1))
    return frozenset(int(position) for position in np.flatnonzero(draws < share) if position >= 1)


@dataclass
class _Link:
    """One prefill worker's NIC: one KV transfer at a time, in the order the prefills ended."""

    free_s: float = 0.0

    def send(self, request: Request, physics: Physics, rng: np.random.Generator, noise_sigma: float) -> None:
        request.transfer_start_s = max(request.prefill_end_s, self.free_s)
        wire_s = physics.transfer_s(request.prompt_tokens) - physics.link_latency_s
        if noise_sigma > 0:
            wire_s *= float(rng.lognormal(0.0, noise_sigma))
        self.free_s = request.transfer_start_s + wire_s
        request.transfer_end_s = self.free_s + physics.link_latency_s


def _in_flight(assigned: list[Request], now_s: float, done_s) -> int:
    """How many of `assigned` have not finished by `now_s`; `done_s(request)` is when it finished (-1: not yet known)."""
    return sum(1 for r in assigned if not 0 <= done_s(r) <= now_s)


def _serve_least_outstanding(
    by_arrival: list[Request],
    first: list[_Engine],
    decode: list[_Engine],
    physics: Physics,
    rng: np.random.Generator,
    noise_sigma: float,
) -> None:
    """The reference router's placement, every pool's workers running side by side in time order.

    At each arrival the router counts what it has in flight per worker: requests on a colocated or decode
    worker until their last token, prompt tokens on a prefill worker until its KV is sent. A request goes
    to the least loaded (ties: the first worker); a split picks both workers at arrival. An iteration is
    decided at its start, so every iteration that starts before the arrival runs first; one starting at or
    after it may take the new request."""
    split = bool(decode)
    links = [_Link() for _ in first]
    assigned: dict[tuple[str, int], list[Request]] = {}
    everyone = first + decode

    def run_before(until_s: float) -> None:
        while True:
            starts = [(e.next_start_s(), i) for i, e in enumerate(everyone)]
            start, i = min(((s, i) for s, i in starts if s is not None), default=(None, -1))
            if start is None or start >= until_s:
                return
            engine = everyone[i]
            for request in engine.iterate():  # prompts whose prefill ended in this iteration
                if split:
                    links[engine.worker].send(request, physics, rng, noise_sigma)
                    decode[request.decode_worker].give(request.transfer_end_s, request)

    for request in by_arrival:
        now = request.arrival_s
        run_before(now)
        if split:
            tokens = [
                sum(r.prompt_tokens for r in assigned.get(("p", w), []) if not 0 <= r.transfer_end_s <= now)
                for w in range(len(first))
            ]
            counts = [
                _in_flight(assigned.get(("p", w), []), now, lambda r: r.transfer_end_s) for w in range(len(first))
            ]
            p = min(range(len(first)), key=lambda w: (tokens[w], counts[w]))
            d_counts = [_in_flight(assigned.get(("d", w), []), now, lambda r: r.end_s) for w in range(len(decode))]
            d = min(range(len(decode)), key=lambda w: d_counts[w])
            request.prefill_worker, request.decode_worker = p, d
            assigned.setdefault(("p", p), []).append(request)
            assigned.setdefault(("d", d), []).append(request)
        else:
            counts = [_in_flight(assigned.get(("c", w), []), now, lambda r: r.end_s) for w in range(len(first))]
            w = min(range(len(first)), key=lambda w: counts[w])
            request.prefill_worker = request.decode_worker = w
            assigned.setdefault(("c", w), []).append(request)
        first[request.prefill_worker].give(now, request)
    run_before(float("inf"))


class _Engine:
    """One worker's iterations, one at a time. role: colocated | chunked | prefill | decode.

    Every running request emits one token per iteration, at the iteration's end; a request records the
    iterations it ran in (its token times are those iterations' ends), so an iteration costs O(1) plus
    its joins and leaves, not O(batch). A request handed over (`give`) while an iteration runs waits for
    the next one: an iteration is planned at its start."""

    def __init__(
        self,
        role: str,
        pool: str,
        worker: int,
        deployment: Deployment,
        physics: Physics,
        rng: np.random.Generator,
        noise_sigma: float,
        iterations: list[Iteration] | None,
    ) -> None:
        self.role, self.pool, self.worker, self.deployment = role, pool, worker, deployment
        self.physics, self.rng, self.noise_sigma, self.iterations = physics, rng, noise_sigma, iterations
        self.inbox: list[tuple[float, int, Request]] = []  # (when it can join, index, request), a heap
        self.waiting: deque[Request] = deque()  # prompts to prefill, or (decode) KV caches to admit
        self.leaving: list[tuple[int, int, Request]] = []  # (iteration of its last token, index, request)
        self.ends: list[float] = []  # this worker's iteration end times
        self.running = 0
        self.context = 0  # tokens the running requests attend over
        self.now = 0.0

    def give(self, ready_s: float, request: Request) -> None:
        heapq.heappush(self.inbox, (ready_s, request.index, request))

    def next_start_s(self) -> float | None:
        """When its next iteration would start (None: nothing to do until something is given)."""
        if self.waiting or self.running:
            return self.now
        return max(self.now, self.inbox[0][0]) if self.inbox else None

    def run_out(self) -> None:
        """Iterate until everything given is served."""
        while self.next_start_s() is not None:
            self.iterate()

    def iterate(self) -> list[Request]:
        """Plan and run the next iteration; returns the prompts whose prefill ended in it."""
        start = self.next_start_s()
        assert start is not None
        self.now = now = start
        while self.inbox and self.inbox[0][0] <= now:
            self.waiting.append(heapq.heappop(self.inbox)[2])
        here = len(self.ends)  # index of the iteration being planned
        if self.role == "decode":
            admitted, admitted_context = _admit_decode(
                self.waiting, self.running, self.deployment, now, here, self.leaving
            )
            self.running += admitted
            self.context += admitted_context
            joined: list[Request] = []
            ran: list[tuple[int, int]] = []
            prefill_tokens = attention = 0
        elif self.role == "chunked":
            joined, ran, attention = _plan_chunks(self.waiting, self.running, self.deployment, now)
            prefill_tokens = sum(tokens for _, tokens in ran)
        else:  # whole prompts
            joined, ran, attention = _plan_whole_prompts(self.waiting, self.running, self.deployment, now)
            prefill_tokens = sum(tokens for _, tokens in ran)
        if not self.running and not prefill_tokens:  # nothing to run until the next arrival
            if self.inbox:
                self.now = max(now, self.inbox[0][0])
            return []
        seconds = self.physics.iteration_s(now, self.running, self.context, prefill_tokens, attention)
        if self.noise_sigma > 0:
            seconds *= float(self.rng.lognormal(0.0, self.noise_sigma))
        end = now + seconds
        if self.iterations is not None:
            self.iterations.append(
                Iteration(self.pool, self.worker, now, end, self.running, self.context, prefill_tokens, attention, ran)
            )
        self.ends.append(end)
        self._finish_iteration(here, end, joined)
        self.now = end
        return joined

    def _finish_iteration(self, here: int, end: float, joined: list[Request]) -> None:
        """Tokens of iteration `here` (ending at `end`): requests at their last token leave, prompts that
        finished start decoding from the next iteration (not on a prefill worker)."""
        self.context += self.running  # each running request's new token joins its context
        while self.leaving and self.leaving[0][0] == here:
            request = heapq.heappop(self.leaving)[2]
            self.running -= 1
            self.context -= request.prompt_tokens + request.output_tokens
            request.end_s = end
            request.token_s = self.ends[request.first_iteration : here + 1]
        for request in joined:
            request.prefill_end_s = end
            if self.role == "prefill":
                continue
            request.first_token_s = end
            if request.output_tokens > 1:
                request.decode_start_s = end
                _start_decoding(request, here + 1, self.leaving)
                self.running += 1
                self.context += request.prompt_tokens + 1
            else:
                request.end_s = end


def _admit_decode(
    waiting: deque[Request],
    running: int,
    deployment: Deployment,
    now: float,
    here: int,
    leaving: list[tuple[int, int, Request]],
) -> tuple[int, int]:
    """A decode worker admits transferred KV caches up to max_running; returns (requests that joined the
    running batch, context tokens they add)."""
    admitted = admitted_context = 0
    while waiting and running + admitted < deployment.max_running:
        request = waiting.popleft()
        request.first_token_s = request.decode_start_s = now  # sent by the decode worker on admission
        if request.output_tokens > 1:
            _start_decoding(request, here, leaving)
            admitted += 1
            admitted_context += request.prompt_tokens + 1
        else:
            request.end_s = now
    return admitted, admitted_context


def _plan_chunks(
    waiting: deque[Request], running: int, deployment: Deployment, now: float
) -> tuple[list[Request], list[tuple[int, int]], int]:
    """Chunked prefill: the token budget left after the running decodes, spent on the queue in order.
    Returns (requests whose prompt finishes in this iteration, (request index, chunk tokens) of every
    chunk it runs, attention tokens squared)."""
    joined: list[Request] = []
    ran: list[tuple[int, int]] = []
    attention = 0
    left = deployment.budget_tokens - running
    for request in waiting:
        if left <= 0 or running + len(joined) >= deployment.max_running:
            break
        chunk = min(left, request.prompt_tokens - request.prefilled)
        if request.chunks == 0:
            request.prefill_start_s = now
        attention += (request.prefilled + chunk) ** 2 - request.prefilled**2
        request.prefilled += chunk
        request.chunks += 1
        ran.append((request.index, chunk))
        left -= chunk
        if request.prefilled == request.prompt_tokens:
            joined.append(request)
    for _ in joined:  # first come first served: the finished prompts are the front of the queue
        waiting.popleft()
    return joined, ran, attention


def _plan_whole_prompts(
    waiting: deque[Request], running: int, deployment: Deployment, now: float
) -> tuple[list[Request], list[tuple[int, int]], int]:
    """Whole prompts (colocated, prefill workers) up to max_prefill_tokens, at least one. Returns as
    _plan_chunks."""
    joined: list[Request] = []
    ran: list[tuple[int, int]] = []
    prefill_tokens = attention = 0
    while waiting and running + len(joined) < deployment.max_running:
        request = waiting[0]
        if joined and prefill_tokens + request.prompt_tokens > deployment.max_prefill_tokens:
            break
        waiting.popleft()
        request.prefill_start_s = now
        request.chunks = 1
        request.prefilled = request.prompt_tokens
        prefill_tokens += request.prompt_tokens
        attention += request.prompt_tokens**2
        joined.append(request)
        ran.append((request.index, request.prompt_tokens))
    return joined, ran, attention


def _start_decoding(request: Request, iteration: int, leaving: list[tuple[int, int, Request]]) -> None:
    """`request` emits its second token in `iteration` and one more in each of the following ones."""
    request.first_iteration = iteration
    heapq.heappush(leaving, (iteration + request.output_tokens - 2, request.index, request))
