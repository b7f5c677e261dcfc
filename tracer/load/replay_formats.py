"""Readers of the files `splitscope load --replay` takes: one reader per format, each yielding `ReplayEntry`s.

- splitscope: JSONL, `{"arrival_s": 0.5, "prompt_tokens": 512, "output_tokens": 64, "session": "a"}` or
  `[arrival_s, prompt_tokens, output_tokens, session?]`; arrivals in seconds from the start of the run.
- azure: the Azure LLM inference trace CSV (2023; the 2024 trace has the same columns): a header
  `TIMESTAMP,ContextTokens,GeneratedTokens`, rows in time order; arrival = TIMESTAMP minus the first row's.
- mooncake: the Mooncake / aiperf `mooncake_trace` JSONL: `{"timestamp": ms, "input_length": n,
  "output_length": n, "hash_ids": [...]}`; `timestamp` in milliseconds from the start of the run, and each
  hash id names one `HASH_BLOCK_TOKENS`-token block of the prompt, so equal leading ids mean a shared prefix.

Pure: reads one file, no clocks. Every problem raises `ReplayError` naming the file and the 1-based line;
no row is skipped. Arrivals here are before `--time-scale` (the workload applies it).
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import TypeGuard

from tracer.load.config import MAX_SCHEDULED_REQUESTS, ConfigError, ReplayFormat

HASH_BLOCK_TOKENS = 512  # tokens per Mooncake hash id (the traces' KV block size)
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")

_SPLITSCOPE_FIELDS = ("arrival_s", "prompt_tokens", "output_tokens", "session")
_MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length")
_AZURE_TIMESTAMP = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?(Z|[+-]\d{2}:\d{2})?", re.ASCII
)
_UNSIGNED = re.compile(r"\d+", re.ASCII)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_NS_PER_S = 1_000_000_000


class ReplayError(ConfigError):
    """A replay file that cannot be used; `line` is 1-based (0 when the problem is the whole file)."""

    def __init__(self, path: str, line: int, message: str) -> None:
        self.path = path
        self.line = line
        where = f"{path}:{line}" if line else path
        super().__init__(f"{where}: {message}")


@dataclass(frozen=True)
class ReplayEntry:
    """One request of a replay file. `arrival_s`: seconds from the start of the run, >= 0.

    `block_hash_ids`: a Mooncake line's hash ids, each standing for `HASH_BLOCK_TOKENS` tokens of the
    prompt's start (empty for the other formats).
    """

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    session: str | None = None
    block_hash_ids: tuple[int, ...] = ()


def read_replay(path: str | Path, replay_format: ReplayFormat = ReplayFormat.AUTO) -> list[ReplayEntry]:
    """Every request in `path`, in file order (blank lines ignored). AUTO tells the format from the first line.

    Raises ReplayError naming the file and line.
    """
    name = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8-sig")  # -sig: CSV exports often start with a BOM
    except (OSError, UnicodeDecodeError) as exc:
        raise ReplayError(name, 0, f"cannot read replay file ({exc})") from None
    lines = [(line_no, line) for line_no, line in enumerate(text.splitlines(), start=1) if line.strip()]
    if not lines:
        raise ReplayError(name, 0, "no requests in replay file")
    if replay_format is ReplayFormat.AUTO:
        replay_format = detect_format(name, *lines[0])
    if replay_format is ReplayFormat.AZURE:
        return _read_azure(name, lines)
    _check_count(name, lines)
    parse = _parse_mooncake_line if replay_format is ReplayFormat.MOONCAKE else _parse_splitscope_line
    return [parse(_failing(name, line_no), line) for line_no, line in lines]


def detect_format(name: str, line_no: int, line: str) -> ReplayFormat:
    """The format of a file whose first non-blank line is `line`: an Azure header, a JSON object with
    `input_length` (Mooncake), else JSON for the splitscope reader (whose errors then name the problem)."""
    text = line.strip()
    if text.startswith("{"):
        try:
            item = json.loads(text)
        except json.JSONDecodeError:
            return ReplayFormat.SPLITSCOPE
        return ReplayFormat.MOONCAKE if isinstance(item, dict) and "input_length" in item else ReplayFormat.SPLITSCOPE
    if text.startswith("["):
        return ReplayFormat.SPLITSCOPE
    if _azure_columns(text) is not None:
        return ReplayFormat.AZURE
    raise ReplayError(
        name,
        line_no,
        f"cannot tell the replay format: expected the CSV header {','.join(AZURE_COLUMNS)} or a JSON line "
        f"(got {_shown(text)}); or give --replay-format",
    )


def parse_azure_timestamp_ns(text: str) -> int:
    """Nanoseconds since the Unix epoch of an Azure trace TIMESTAMP such as `2023-11-16 18:15:46.6805900`.

    Up to 9 fractional digits are kept exactly (the traces have 7; datetime keeps only 6). No zone means
    UTC (only differences between rows matter); a trailing `Z` or `+hh:mm` is honoured. Raises ValueError.
    """
    match = _AZURE_TIMESTAMP.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"TIMESTAMP must look like 2023-11-16 18:15:46.6805900 (got {_shown(text)})")
    fraction, zone = match.group(7) or "", match.group(8)
    try:
        tz = UTC
        if zone not in (None, "Z"):
            sign = -1 if zone[0] == "-" else 1
            tz = timezone(sign * timedelta(hours=int(zone[1:3]), minutes=int(zone[4:6])))
        year, month, day, hour, minute, second = (int(group) for group in match.groups()[:6])
        moment = datetime(year, month, day, hour, minute, second, tzinfo=tz)
    except ValueError as exc:
        raise ValueError(f"TIMESTAMP {_shown(text)} is not a valid time ({exc})") from None
    whole_s = (moment - _EPOCH) // timedelta(seconds=1)
    return whole_s * _NS_PER_S + int(fraction.ljust(9, "0"))


def _read_azure(name: str, lines: list[tuple[int, str]]) -> list[ReplayEntry]:
    """`lines`: the file's non-blank lines, the header first."""
    header_no, header = lines[0]
    columns = _azure_columns(header)
    if columns is None:
        raise ReplayError(name, header_no, f"expected the header {','.join(AZURE_COLUMNS)} (got {_shown(header)})")
    rows = lines[1:]
    if not rows:
        raise ReplayError(name, 0, "no requests in replay file (only the header)")
    _check_count(name, rows)
    entries: list[ReplayEntry] = []
    first_ns: int | None = None
    for line_no, line in rows:
        fail = _failing(name, line_no)
        fields = next(csv.reader([line]))
        if len(fields) != len(columns):
            raise fail(f"expected {len(columns)} comma-separated fields like the header, got {len(fields)}")
        row = dict(zip(columns, fields))
        try:
            timestamp_ns = parse_azure_timestamp_ns(row["TIMESTAMP"])
        except ValueError as exc:
            raise fail(str(exc)) from None
        if first_ns is None:
            first_ns = timestamp_ns
        if timestamp_ns < first_ns:
            raise fail(f"TIMESTAMP {row['TIMESTAMP'].strip()} is before the first row's (rows must be in time order)")
        prompt_tokens, output_tokens = (_azure_count(fail, key, row[key]) for key in AZURE_COLUMNS[1:])
        entries.append(ReplayEntry((timestamp_ns - first_ns) / _NS_PER_S, prompt_tokens, output_tokens))
    return entries


def _azure_columns(header: str) -> list[str] | None:
    """The header's column names when it has all of AZURE_COLUMNS (in any order, extra columns allowed)."""
    columns = [column.strip() for column in next(csv.reader([header]), [])]
    return columns if set(AZURE_COLUMNS) <= set(columns) else None


def _azure_count(fail: Callable[[str], ReplayError], key: str, value: str) -> int:
    if not _UNSIGNED.fullmatch(value.strip()) or int(value) < 1:
        raise fail(f"{key} must be an integer >= 1 (got {_shown(value)})")
    return int(value)


def _parse_mooncake_line(fail: Callable[[str], ReplayError], line: str) -> ReplayEntry:
    item = _json(fail, line)
    if not isinstance(item, dict):
        raise fail("each line must be a JSON object")
    missing = [key for key in _MOONCAKE_FIELDS if key not in item]
    if missing:
        raise fail(f"missing {', '.join(missing)}")
    timestamp_ms = item["timestamp"]
    if not _is_number(timestamp_ms) or timestamp_ms < 0:
        raise fail(f"timestamp must be a number of milliseconds >= 0 (got {_shown(timestamp_ms)})")
    input_length, output_length = (_positive_int(fail, key, item[key]) for key in _MOONCAKE_FIELDS[1:])
    hash_ids = item.get("hash_ids")
    hash_ids = [] if hash_ids is None else hash_ids
    if not isinstance(hash_ids, list) or not all(_is_int(h) and h >= 0 for h in hash_ids):
        # Non-negative: block text is seeded from the id, and numpy seeds must be >= 0.
        raise fail(f"hash_ids must be a list of integers >= 0 (got {_shown(hash_ids)})")
    return ReplayEntry(timestamp_ms / 1000, input_length, output_length, None, tuple(hash_ids))


def _parse_splitscope_line(fail: Callable[[str], ReplayError], line: str) -> ReplayEntry:
    item = _json(fail, line)
    if isinstance(item, list):
        if not 3 <= len(item) <= 4:
            raise fail("an array line needs [arrival_s, prompt_tokens, output_tokens] and optionally session")
        item = dict(zip(_SPLITSCOPE_FIELDS, item))
    if not isinstance(item, dict):
        raise fail("each line must be a JSON object or array")
    missing = [key for key in _SPLITSCOPE_FIELDS[:3] if key not in item]
    if missing:
        raise fail(f"missing {', '.join(missing)}")
    arrival_s = item["arrival_s"]
    if not _is_number(arrival_s) or arrival_s < 0:
        raise fail(f"arrival_s must be a number >= 0 (got {arrival_s!r})")
    prompt_tokens, output_tokens = (_positive_int(fail, key, item[key]) for key in _SPLITSCOPE_FIELDS[1:3])
    session = item.get("session")
    if session is not None and (isinstance(session, bool) or not isinstance(session, (str, int))):
        raise fail(f"session must be a string or integer (got {session!r})")
    return ReplayEntry(float(arrival_s), prompt_tokens, output_tokens, None if session is None else str(session))


def _check_count(name: str, lines: list[tuple[int, str]]) -> None:
    if len(lines) > MAX_SCHEDULED_REQUESTS:
        raise ReplayError(name, lines[MAX_SCHEDULED_REQUESTS][0], f"more than {MAX_SCHEDULED_REQUESTS} requests")


def _failing(name: str, line_no: int) -> Callable[[str], ReplayError]:
    return lambda message: ReplayError(name, line_no, message)


def _json(fail: Callable[[str], ReplayError], line: str) -> object:
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise fail(f"not valid JSON ({exc.msg})") from None


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> TypeGuard[int | float]:
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))


def _positive_int(fail: Callable[[str], ReplayError], key: str, value: object) -> int:
    if not _is_int(value) or value < 1:
        raise fail(f"{key} must be an integer >= 1 (got {_shown(value)})")
    return value


def _shown(value: object) -> str:
    """`value` for an error message: its repr, cut so a long line or list cannot flood the terminal."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
