"""Replay files in the public trace formats (Azure LLM inference CSV, Mooncake JSONL): pure, no network."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from tracer.cli.main import main
from tracer.load.config import ConfigError, LoadConfig, ReplayFormat
from tracer.load.prompts import PromptFactory
from tracer.load.replay_formats import HASH_BLOCK_TOKENS, parse_azure_timestamp_ns
from tracer.load.workload import REPLAY, ReplayError, build_schedule, load_replay

URL = "http://127.0.0.1:9"

# The shape of AzureLLMInferenceTrace_conv.csv: 7 fractional digits, rows in time order.
AZURE_CSV = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.2100000,879,41
2023-11-16 18:15:51.2100001,1024,1
"""

MOONCAKE_JSONL = "\n".join(
    json.dumps(line)
    for line in [
        {"timestamp": 0, "input_length": 1200, "output_length": 52, "hash_ids": [0, 1, 2]},
        {"timestamp": 105, "input_length": 1800, "output_length": 26, "hash_ids": [0, 1, 3, 4]},
        {"timestamp": 2500, "input_length": 300, "output_length": 3},
    ]
)

SPLITSCOPE_JSONL = '{"arrival_s": 0.25, "prompt_tokens": 8, "output_tokens": 2}\n[1.5, 16, 4, "a"]\n'


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _config(path: Path, **kw: object) -> LoadConfig:
    return LoadConfig(url=URL, model="m", replay_path=str(path), seed=0, **kw)  # type: ignore[arg-type]


def test_azure_timestamps_keep_all_seven_fractional_digits() -> None:
    assert parse_azure_timestamp_ns("1970-01-01 00:00:01.0000001") == 1_000_000_100
    first = parse_azure_timestamp_ns("2023-11-16 18:15:46.6805900")
    assert parse_azure_timestamp_ns("2023-11-16 18:15:50.9951690") - first == 4_314_579_000
    assert parse_azure_timestamp_ns("2023-11-16 18:15:46.6805901") - first == 100  # below datetime's microsecond
    assert parse_azure_timestamp_ns("2023-11-16 18:15:46") == first - 680_590_000
    assert parse_azure_timestamp_ns("2023-11-16 19:15:46.6805900+01:00") == first  # a zone, when given, counts


def test_azure_rows_arrive_relative_to_the_first_row(tmp_path: Path) -> None:
    entries = load_replay(_write(tmp_path, "azure.csv", AZURE_CSV))
    assert [(e.prompt_tokens, e.output_tokens, e.session, e.block_hash_ids) for e in entries] == [
        (374, 44, None, ()),
        (396, 109, None, ()),
        (879, 41, None, ()),
        (1024, 1, None, ()),
    ]
    assert [e.arrival_s for e in entries] == pytest.approx([0.0, 4.314579, 4.52941, 4.5294101], abs=1e-9)


def test_mooncake_lines_give_milliseconds_lengths_and_hash_ids(tmp_path: Path) -> None:
    entries = load_replay(_write(tmp_path, "mooncake.jsonl", MOONCAKE_JSONL))
    assert [(e.arrival_s, e.prompt_tokens, e.output_tokens, e.block_hash_ids) for e in entries] == [
        (0.0, 1200, 52, (0, 1, 2)),
        (0.105, 1800, 26, (0, 1, 3, 4)),
        (2.5, 300, 3, ()),
    ]
    schedule = build_schedule(_config(tmp_path / "mooncake.jsonl"))
    assert [p.block_hash_ids for p in schedule] == [(0, 1, 2), (0, 1, 3, 4), ()]
    assert {p.source for p in schedule} == {REPLAY}


def test_equal_leading_hash_ids_share_exactly_their_blocks(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "m.jsonl",
        MOONCAKE_JSONL
        + "\n"
        + json.dumps({"timestamp": 3000, "input_length": 1200, "output_length": 1, "hash_ids": [9, 1, 2]}),
    )
    first, second, unblocked, other_root = build_schedule(_config(path))
    factory = PromptFactory(seed=7, chars_per_token=1.0, shared_prefix_tokens=0)  # bytes: 1 token = 1 char
    a, b, c, d = (factory.prompt(p) for p in (first, second, unblocked, other_root))
    assert (len(a), len(b), len(c), len(d)) == (1200, 1800, 300, 1200)
    assert len(os.path.commonprefix([a, b])) == 2 * HASH_BLOCK_TOKENS == 1024  # ids 0, 1 shared; 2 vs 3 differ
    assert a[: 2 * HASH_BLOCK_TOKENS] == b[: 2 * HASH_BLOCK_TOKENS]
    # A different first id shares no prefix, whatever ids follow it.
    assert len(os.path.commonprefix([a, d])) < HASH_BLOCK_TOKENS
    assert factory.prompt(first) == a  # deterministic per (seed, id)
    fresh = PromptFactory(seed=8, chars_per_token=1.0, shared_prefix_tokens=0).prompt(first)
    assert fresh[:HASH_BLOCK_TOKENS] != a[:HASH_BLOCK_TOKENS]  # another text seed: blocks no cache has seen

    bpe = PromptFactory(seed=7, chars_per_token=4.0, shared_prefix_tokens=0)
    shared_chars = len(os.path.commonprefix([bpe.prompt(first), bpe.prompt(second)]))
    assert shared_chars == 2 * HASH_BLOCK_TOKENS * 4


@pytest.mark.parametrize(("name", "text"), [("a.csv", AZURE_CSV), ("m.jsonl", MOONCAKE_JSONL)])
def test_time_scale_multiplies_every_arrival(tmp_path: Path, name: str, text: str) -> None:
    path = _write(tmp_path, name, text)
    plain = build_schedule(_config(path))
    faster = build_schedule(_config(path, time_scale=0.5))
    assert [p.arrival_s for p in faster] == pytest.approx([0.5 * p.arrival_s for p in plain], abs=1e-12)
    assert [p.prompt_tokens for p in faster] == [p.prompt_tokens for p in plain]
    # --duration bounds the scaled run: at 2x speed the last rows (~4.5 s, 2.5 s) arrive before 2.4 s.
    assert len(build_schedule(_config(path, duration_s=2.4))) < len(plain)
    assert len(build_schedule(_config(path, time_scale=0.5, duration_s=2.4))) == len(plain)


@pytest.mark.parametrize("time_scale", [0.0, -1.0, float("nan"), float("inf")])
def test_time_scale_must_be_positive(tmp_path: Path, time_scale: float) -> None:
    with pytest.raises(ConfigError, match="--time-scale must be a number > 0"):
        _config(tmp_path / "x.csv", time_scale=time_scale).validate()
    with pytest.raises(ConfigError, match="apply to a --replay file"):
        LoadConfig(url=URL, model="m", rate_rps=1.0, requests=1, time_scale=0.5).validate()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (AZURE_CSV, ReplayFormat.AZURE),
        (MOONCAKE_JSONL, ReplayFormat.MOONCAKE),
        (SPLITSCOPE_JSONL, ReplayFormat.SPLITSCOPE),
    ],
)
def test_auto_detection_reads_each_format_as_its_explicit_reader_does(
    tmp_path: Path, text: str, expected: ReplayFormat
) -> None:
    path = _write(tmp_path, "trace", "\n" + text)  # a leading blank line does not hide the format
    assert load_replay(path) == load_replay(path, expected)
    if expected is not ReplayFormat.AZURE:
        with pytest.raises(ReplayError, match=r":2: expected the header TIMESTAMP,ContextTokens,GeneratedTokens"):
            load_replay(path, ReplayFormat.AZURE)


def test_an_unknown_first_line_asks_for_the_format(tmp_path: Path) -> None:
    path = _write(tmp_path, "x.csv", "time,prompt,output\n1,2,3\n")
    with pytest.raises(ReplayError, match="cannot tell the replay format.*give --replay-format") as info:
        load_replay(path)
    assert info.value.line == 1
    with pytest.raises(ReplayError, match=r":1: not valid JSON"):
        load_replay(_write(tmp_path, "a.csv", AZURE_CSV), ReplayFormat.MOONCAKE)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("2023-11-16 18:15:52,12", "expected 3 comma-separated fields like the header, got 2"),
        ("16/11/2023 18:15:52,12,3", "TIMESTAMP must look like 2023-11-16 18:15:46.6805900"),
        ("2023-11-16 25:15:52.1,12,3", "is not a valid time"),
        ("2023-11-16 18:15:52.1,12.5,3", "ContextTokens must be an integer >= 1"),
        ("2023-11-16 18:15:52.1,12,0", "GeneratedTokens must be an integer >= 1"),
        ("2023-11-16 18:15:40.0,12,3", "is before the first row's"),
    ],
)
def test_a_bad_azure_row_names_its_line(tmp_path: Path, row: str, message: str) -> None:
    path = _write(tmp_path, "bad.csv", AZURE_CSV.replace("2023-11-16 18:15:51.2100000,879,41", row))
    with pytest.raises(ReplayError, match=message) as info:
        load_replay(path)
    assert info.value.line == 4
    assert str(info.value).startswith(f"{path}:4: ")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"timestamp": 10, "input_length": 5}', "missing output_length"),
        ('{"timestamp": -1, "input_length": 5, "output_length": 1}', "timestamp must be a number of milliseconds"),
        ('{"timestamp": 1, "input_length": 0, "output_length": 1}', "input_length must be an integer >= 1"),
        ('{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": [1, "a"]}', "hash_ids must be a list"),
        ('{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": [-3]}', "integers >= 0"),
        ("[1, 5, 1]", "each line must be a JSON object"),
    ],
)
def test_a_bad_mooncake_line_names_its_line(tmp_path: Path, line: str, message: str) -> None:
    path = _write(tmp_path, "bad.jsonl", MOONCAKE_JSONL.replace(MOONCAKE_JSONL.splitlines()[1], line))
    with pytest.raises(ReplayError, match=message) as info:
        load_replay(path)
    assert str(info.value).startswith(f"{path}:2: ")


def test_the_cli_exits_non_zero_on_a_malformed_trace(tmp_path: Path) -> None:
    path = _write(tmp_path, "bad.csv", AZURE_CSV.replace("2023-11-16 18:15:51.2100000,879,41", "x,879,41"))
    args = ["load", "--url", URL, "--model", "m", "--no-progress", "--replay", str(path)]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 1
    assert f"{path}:4: TIMESTAMP must look like 2023-11-16 18:15:46.6805900 (got 'x')" in result.output

    result = CliRunner().invoke(main, [*args, "--time-scale", "0"], catch_exceptions=False)
    assert result.exit_code == 2
    assert "--time-scale must be a number > 0" in result.output
