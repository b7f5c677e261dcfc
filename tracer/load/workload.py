"""The schedule of a load run: when each request arrives, how long its prompt and output are, its session.

`build_schedule(config)` is a pure function of the config (its seed included): the same config gives the
same schedule, request for request. Draw order is fixed (arrivals, prompt lengths, output lengths,
sessions) so changing one distribution does not reshuffle the others' draws for the same seed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tracer.load.config import MAX_SCHEDULED_REQUESTS, ConfigError, LengthSpec, LoadConfig

POISSON = "poisson"
BURST = "burst"
REPLAY = "replay"


@dataclass(frozen=True)
class PlannedRequest:
    """One request to send: `arrival_s` is the offset from the start of the run, in seconds."""

    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    session: str | None
    source: str  # POISSON, BURST or REPLAY


class ReplayError(ConfigError):
    """A replay file that cannot be used; `line` is 1-based (0 when the problem is the whole file)."""

    def __init__(self, path: str, line: int, message: str) -> None:
        self.path = path
        self.line = line
        where = f"{path}:{line}" if line else path
        super().__init__(f"{where}: {message}")


def build_schedule(config: LoadConfig) -> list[PlannedRequest]:
    """Every request of the run, sorted by arrival. `config.seed` must be set (see `LoadConfig.with_seed`).

    Raises ConfigError (ReplayError for a bad replay file, with its line number).
    """
    if config.seed is None:
        raise ValueError("build_schedule needs a concrete seed; call config.with_seed() first")
    if config.replay_path is not None:
        return _bounded_replay(load_replay(config.replay_path), config)
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

_REPLAY_FIELDS = ("arrival_s", "prompt_tokens", "output_tokens", "session")


@dataclass(frozen=True)
class ReplayEntry:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    session: str | None


def load_replay(path: str | Path) -> list[ReplayEntry]:
    """Read a JSONL replay file: one request per line, blank lines ignored.

    A line is an object {"arrival_s": 0.5, "prompt_tokens": 512, "output_tokens": 64, "session": "a"}
    (extra keys ignored, session optional) or an array [arrival_s, prompt_tokens, output_tokens, session?].
    Arrivals are offsets in seconds from the start of the run, >= 0, in any order (they are sorted).
    Raises ReplayError naming the line.
    """
    name = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ReplayError(name, 0, f"cannot read replay file ({exc})") from None
    entries: list[ReplayEntry] = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if len(entries) >= MAX_SCHEDULED_REQUESTS:
            raise ReplayError(name, line_no, f"more than {MAX_SCHEDULED_REQUESTS} requests")
        entries.append(_parse_replay_line(name, line_no, line))
    if not entries:
        raise ReplayError(name, 0, "no requests in replay file")
    return entries


def _parse_replay_line(name: str, line_no: int, line: str) -> ReplayEntry:
    def fail(message: str) -> ReplayError:
        return ReplayError(name, line_no, message)

    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise fail(f"not valid JSON ({exc.msg})") from None
    if isinstance(item, list):
        if not 3 <= len(item) <= 4:
            raise fail("an array line needs [arrival_s, prompt_tokens, output_tokens] and optionally session")
        item = dict(zip(_REPLAY_FIELDS, item))
    if not isinstance(item, dict):
        raise fail("each line must be a JSON object or array")
    missing = [key for key in _REPLAY_FIELDS[:3] if key not in item]
    if missing:
        raise fail(f"missing {', '.join(missing)}")
    arrival_s = item["arrival_s"]
    if (
        isinstance(arrival_s, bool)
        or not isinstance(arrival_s, (int, float))
        or not math.isfinite(arrival_s)
        or arrival_s < 0
    ):
        raise fail(f"arrival_s must be a number >= 0 (got {arrival_s!r})")
    lengths = []
    for key in ("prompt_tokens", "output_tokens"):
        value = item[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise fail(f"{key} must be an integer >= 1 (got {value!r})")
        lengths.append(value)
    session = item.get("session")
    if session is not None and (isinstance(session, bool) or not isinstance(session, (str, int))):
        raise fail(f"session must be a string or integer (got {session!r})")
    return ReplayEntry(float(arrival_s), lengths[0], lengths[1], None if session is None else str(session))


def _bounded_replay(entries: list[ReplayEntry], config: LoadConfig) -> list[PlannedRequest]:
    ordered = sorted(entries, key=lambda entry: entry.arrival_s)
    if config.duration_s is not None:
        ordered = [entry for entry in ordered if entry.arrival_s < config.duration_s]
    ordered = ordered[: config.requests]
    return [
        PlannedRequest(i, entry.arrival_s, entry.prompt_tokens, entry.output_tokens, entry.session, REPLAY)
        for i, entry in enumerate(ordered)
    ]
