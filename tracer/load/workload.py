"""The schedule of a load run: when each request arrives, how long its prompt and output are, its session.

`build_schedule(config)` is a pure function of the config (its seed included): the same config gives the
same schedule, request for request. Draw order is fixed (arrivals, prompt lengths, output lengths,
sessions) so changing one distribution does not reshuffle the others' draws for the same seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from tracer.load.config import MAX_SCHEDULED_REQUESTS, ConfigError, LengthSpec, LoadConfig, ReplayFormat
from tracer.load.replay_formats import ReplayEntry, read_replay
from tracer.load.replay_formats import ReplayError as ReplayError  # re-exported: the load API raises it from here

POISSON = "poisson"
BURST = "burst"
REPLAY = "replay"


@dataclass(frozen=True)
class PlannedRequest:
    """One request to send: `arrival_s` is the offset from the start of the run, in seconds.

    `block_hash_ids` (Mooncake replays only): the prompt starts with one block of
    `replay_formats.HASH_BLOCK_TOKENS` tokens per id, the same text for the same id (see PromptFactory).
    """

    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    session: str | None
    source: str  # POISSON, BURST or REPLAY
    block_hash_ids: tuple[int, ...] = ()


def build_schedule(config: LoadConfig) -> list[PlannedRequest]:
    """Every request of the run, sorted by arrival. `config.seed` must be set (see `LoadConfig.with_seed`).

    Raises ConfigError (ReplayError for a bad replay file, with its line number).
    """
    if config.seed is None:
        raise ValueError("build_schedule needs a concrete seed; call config.with_seed() first")
    if config.replay_path is not None:
        entries = load_replay(config.replay_path, config.replay_format, time_scale=config.time_scale)
        return _bounded_replay(entries, config)
    return _generated(config, np.random.default_rng(config.seed))


def poisson_arrivals_s(
    rate_rps: float, rng: np.random.Generator, *, duration_s: float | None, count: int | None
) -> np.ndarray:
    """Arrival offsets of a Poisson process (exponential gaps, first arrival after one gap).

    Bounded by `count` arrivals and/or arrivals before `duration_s`; `rate_rps` inf puts all `count` at 0.
    """
    if rate_rps == math.inf:
        return np.zeros(count or 0)
    mean_gap_s = 1.0 / rate_rps
    if count is not None:
        times = np.cumsum(rng.exponential(mean_gap_s, size=count))
        return times if duration_s is None else times[times < duration_s]
    assert duration_s is not None
    expected = rate_rps * duration_s
    if expected > MAX_SCHEDULED_REQUESTS:
        raise ConfigError(f"--rate x --duration asks for ~{expected:.0f} requests; at most {MAX_SCHEDULED_REQUESTS}")
    chunks: list[np.ndarray] = []
    last_s = 0.0
    while last_s < duration_s:
        # Draw in batches a little larger than the expected count, so one batch usually suffices.
        batch = last_s + np.cumsum(rng.exponential(mean_gap_s, size=int(expected * 1.2) + 16))
        chunks.append(batch)
        last_s = float(batch[-1])
    times = np.concatenate(chunks)
    return times[times < duration_s]


def burst_arrivals_s(every_s: float, count: int, *, until_s: float) -> np.ndarray:
    """`count` arrivals at every_s, 2*every_s, ... strictly before `until_s`."""
    n_bursts = int(until_s // every_s) + 1  # candidates; the filter below drops any at or past until_s
    if n_bursts * count > MAX_SCHEDULED_REQUESTS:
        raise ConfigError(f"--burst asks for {n_bursts * count} requests; at most {MAX_SCHEDULED_REQUESTS}")
    times = every_s * np.arange(1, n_bursts + 1)
    return np.repeat(times[times < until_s], count)


def sample_lengths(spec: LengthSpec, rng: np.random.Generator, size: int) -> np.ndarray:
    """`size` token lengths from `spec` (see LengthSpec for rounding and clamping)."""
    if spec.sigma == 0:
        return np.full(size, spec.median_tokens, dtype=np.int64)
    draws = rng.lognormal(mean=math.log(spec.median_tokens), sigma=spec.sigma, size=size)
    return np.clip(np.rint(draws), 1, spec.cap_tokens).astype(np.int64)


def _generated(config: LoadConfig, rng: np.random.Generator) -> list[PlannedRequest]:
    poisson_s = np.zeros(0)
    if config.rate_rps:
        poisson_s = poisson_arrivals_s(config.rate_rps, rng, duration_s=config.duration_s, count=config.requests)
    burst_s = np.zeros(0)
    if config.burst is not None:
        burst_s = burst_arrivals_s(
            config.burst.every_s, config.burst.count, until_s=_burst_horizon_s(config, poisson_s)
        )
    arrivals_s = np.concatenate([poisson_s, burst_s])
    is_burst = np.concatenate([np.zeros(len(poisson_s), bool), np.ones(len(burst_s), bool)])
    order = np.argsort(arrivals_s, kind="stable")[: config.requests]  # ties: Poisson first
    arrivals_s, is_burst = arrivals_s[order], is_burst[order]
    n = len(arrivals_s)

    prompt_tokens = sample_lengths(config.prompt, rng, n)
    if config.burst is not None:
        prompt_tokens[is_burst] = config.burst.prompt_tokens
    output_tokens = sample_lengths(config.output, rng, n)
    session_ids = rng.integers(config.sessions, size=n) if config.sessions else None
    return [
        PlannedRequest(
            index=i,
            arrival_s=float(arrivals_s[i]),
            prompt_tokens=int(prompt_tokens[i]),
            output_tokens=int(output_tokens[i]),
            session=f"session-{session_ids[i]}" if session_ids is not None else None,
            source=BURST if is_burst[i] else POISSON,
        )
        for i in range(n)
    ]


def _burst_horizon_s(config: LoadConfig, poisson_s: np.ndarray) -> float:
    """How far to lay bursts: the duration, else far enough to fill `requests` (with or without Poisson)."""
    if config.duration_s is not None:
        return config.duration_s
    assert config.burst is not None and config.requests is not None
    if len(poisson_s):
        return float(poisson_s[-1]) + 1e-9  # bursts up to and including the last Poisson arrival
    return config.burst.every_s * (math.ceil(config.requests / config.burst.count) + 1)


# --- replay -------------------------------------------------------------------------------------------


def load_replay(
    path: str | Path, replay_format: ReplayFormat = ReplayFormat.AUTO, *, time_scale: float = 1.0
) -> list[ReplayEntry]:
    """Read a replay file (the formats: tracer.load.replay_formats), every arrival multiplied by `time_scale`.

    `time_scale` > 0: 0.5 replays twice as fast, 2 half as fast; lengths and sessions are untouched.
    Arrivals may come in any order (the schedule sorts them). Raises ReplayError naming the file and line.
    """
    if not math.isfinite(time_scale) or time_scale <= 0:
        raise ConfigError(f"--time-scale must be a number > 0 (got {time_scale})")
    entries = read_replay(path, replay_format)
    if time_scale == 1.0:
        return entries
    return [replace(entry, arrival_s=entry.arrival_s * time_scale) for entry in entries]


def _bounded_replay(entries: list[ReplayEntry], config: LoadConfig) -> list[PlannedRequest]:
    ordered = sorted(entries, key=lambda entry: entry.arrival_s)
    if config.duration_s is not None:
        ordered = [entry for entry in ordered if entry.arrival_s < config.duration_s]
    ordered = ordered[: config.requests]
    return [
        PlannedRequest(
            i, entry.arrival_s, entry.prompt_tokens, entry.output_tokens, entry.session, REPLAY, entry.block_hash_ids
        )
        for i, entry in enumerate(ordered)
    ]
