"""The open-loop scheduler: sends every planned request at its arrival time, never waiting on responses.

`run_load(config)` (async) and `run_load_sync(config)` (blocking, runs its own event loop) are the
Python API the CLI, the demo and tests use. Arrivals are independent of responses: each request is its
own task; if `max_inflight` requests are already in flight when one is due, that one is not sent and is
counted (`skipped_inflight_cap`), so the schedule never slips because the server is slow. How far the
client itself fell behind (event-loop or CPU saturation) is measured per request as `lag_s`. A run can be
stopped early (`stop`: nothing more is sent) and told not to wait for the answers still streaming
(`cancel`: requests in flight are cancelled and recorded as `cancelled`).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

import aiohttp

from tracer.load.client import CANCELLED, INFLIGHT_CAP, OK, CompletionClient, RequestMeasurement
from tracer.load.config import LoadConfig
from tracer.load.prompts import PromptFactory
from tracer.load.results import LoadResult
from tracer.load.stats import summarize
from tracer.load.workload import PlannedRequest, build_schedule

# Seconds a finished request's connection is kept for the next one. Under the 5 s after which uvicorn (vLLM's
# and SGLang's API servers) closes an idle connection: reusing one the server is closing fails the request as
# "Server disconnected" before a byte of it was sent. Seen with a real vLLM beside a busy core: the three long
# prompts, sent after the short requests' connections had idled about 5 s, failed so while vLLM was healthy.
IDLE_CONNECTION_S = 2.0


@dataclass
class RunProgress:
    """Live counters of a run. Written only by the runner's event loop; a display thread may read them
    at any time (plain numbers: a read between updates is stale by one event, never inconsistent in type).
    """

    scheduled: int = 0
    last_arrival_s: float = 0.0
    started_perf_s: float | None = None  # time.perf_counter() at the run's time zero
    sent: int = 0
    finished: int = 0
    ok: int = 0
    errors: int = 0
    skipped: int = 0
    cancelled: int = 0
    max_lag_s: float = 0.0
    recent_ttft_s: deque[float] = field(default_factory=lambda: deque(maxlen=256))

    @property
    def elapsed_s(self) -> float:
        return 0.0 if self.started_perf_s is None else time.perf_counter() - self.started_perf_s

    @property
    def inflight(self) -> int:
        return self.sent - self.finished

    def on_finished(self, record: RequestMeasurement) -> None:
        self.finished += 1
        if record.status == OK:
            self.ok += 1
            if record.ttft_s is not None:
                self.recent_ttft_s.append(record.ttft_s)
        elif record.status == CANCELLED:
            self.cancelled += 1
        else:
            self.errors += 1
        if record.lag_s is not None:
            self.max_lag_s = max(self.max_lag_s, record.lag_s)


async def run_load(
    config: LoadConfig,
    *,
    progress: RunProgress | None = None,
    stop: asyncio.Event | None = None,
    cancel: asyncio.Event | None = None,
) -> LoadResult:
    """Run the load described by `config` to completion; returns every request's record and the summary.

    Raises ConfigError (before sending anything) for an invalid config or replay file. Failed requests do
    not raise: they are records with an error kind. Returns after the last response (each bounded by
    `config.timeout_s`) and, for a `duration_s` run, not before the duration has elapsed.
    Setting `stop` (e.g. from a SIGINT handler) ends the schedule early: nothing more is sent, requests in
    flight finish, and the result covers the requests whose arrival came before the stop.
    Setting `cancel` (with `stop`, or alone to cut the wait once the schedule has ended) cancels the
    requests still in flight instead of waiting for them: each closes its connection, and its record says
    status `cancelled` (neither ok nor an error: the run ended it, not the server).
    """
    config = config.with_seed()
    config.validate()
    schedule = build_schedule(config)
    assert config.seed is not None
    text_seed = config.seed if config.text_seed is None else config.text_seed
    prompts = PromptFactory(
        seed=text_seed, chars_per_token=config.chars_per_token, shared_prefix_tokens=config.shared_prefix_tokens
    )
    progress = progress if progress is not None else RunProgress()
    progress.scheduled = len(schedule)
    progress.last_arrival_s = schedule[-1].arrival_s if schedule else 0.0
    records = [RequestMeasurement.planned(planned) for planned in schedule]

    # The connector's limit matches the cap, so aiohttp never queues a due request behind a busy pool; idle
    # connections are closed before servers close them, so a pooled one is never reused as it closes.
    connector = aiohttp.TCPConnector(limit=config.max_inflight, keepalive_timeout=IDLE_CONNECTION_S)
    # No session-wide timeout: the client bounds each request with config.timeout_s itself.
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        started_perf_s = time.perf_counter()
        started_unix_s = time.time()
        progress.started_perf_s = started_perf_s

        def clock() -> float:
            return time.perf_counter() - started_perf_s

        client = CompletionClient(
            session, endpoint=config.endpoint, model=config.model, timeout_s=config.timeout_s, clock=clock
        )

        async def send(planned: PlannedRequest) -> None:
            record = records[planned.index]
            try:
                await client.fill(record, prompts.prompt(planned))
            finally:
                progress.on_finished(record)

        inflight: set[asyncio.Task[None]] = set()
        reached = 0  # schedule entries whose arrival time came before any stop
        for planned in schedule:
            delay_s = planned.arrival_s - clock()
            if delay_s > 0 and await _stopped_within(stop, delay_s):
                break
            if stop is not None and stop.is_set():
                break
            reached += 1
            if len(inflight) >= config.max_inflight:
                records[planned.index].fail(INFLIGHT_CAP, f"{config.max_inflight} requests already in flight")
                progress.skipped += 1
                continue
            task = asyncio.create_task(send(planned))
            inflight.add(task)
            task.add_done_callback(inflight.discard)
            progress.sent += 1

        stopped_early = reached < len(schedule)
        remaining_s = 0.0 if config.duration_s is None or stopped_early else config.duration_s - clock()
        await asyncio.gather(_drain(set(inflight), cancel), _stopped_within(stop, remaining_s))
        wall_s = clock()
    records = records[:reached]
    for record in records:
        if record.status == OK and record.sent_s is None:  # its task was cancelled before it ever ran
            record.cancel()
            progress.on_finished(record)
    return LoadResult(
        config=config,
        started_unix_s=started_unix_s,
        records=records,
        summary=summarize(records, config.slo, wall_s),
        stopped_early=stopped_early,
    )


async def _drain(inflight: set[asyncio.Task[None]], cancel: asyncio.Event | None) -> None:
    """Wait until every task of `inflight` has ended; once `cancel` is set, cancel those still running.

    A task's exception is re-raised (a bug: a request records its own failures); a cancellation is not.
    """
    if cancel is not None and inflight:
        all_ended = asyncio.create_task(asyncio.wait(inflight))
        cancelled = asyncio.create_task(cancel.wait())
        await asyncio.wait({all_ended, cancelled}, return_when=asyncio.FIRST_COMPLETED)
        all_ended.cancel()
        cancelled.cancel()
        for task in inflight:
            task.cancel()  # a no-op for the tasks that already ended
    # A cancelled request ends at its next await (a socket read), so this wait is short.
    for outcome in await asyncio.gather(*inflight, return_exceptions=True):
        if isinstance(outcome, Exception):
            raise outcome


async def _stopped_within(stop: asyncio.Event | None, seconds: float) -> bool:
    """Wait up to `seconds` (none if <= 0); True as soon as `stop` is set, False when the time ran out."""
    if stop is None:
        await asyncio.sleep(max(0.0, seconds))
        return False
    try:
        async with asyncio.timeout(max(0.0, seconds)):
            await stop.wait()
    except TimeoutError:
        return False
    return True


def run_load_sync(config: LoadConfig, *, progress: RunProgress | None = None) -> LoadResult:
    """Blocking `run_load` on a fresh event loop; call from a thread with no running loop."""
    return asyncio.run(run_load(config, progress=progress))
