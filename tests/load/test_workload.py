"""Schedules, lengths, sessions, prompts and replay files: pure functions, no network."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tracer.load.config import BurstSpec, ConfigError, LengthSpec, LoadConfig
from tracer.load.prompts import PromptFactory, synth_text
from tracer.load.workload import (
    BURST,
    POISSON,
    ReplayError,
    build_schedule,
    burst_arrivals_s,
    load_replay,
    sample_lengths,
)

URL = "http://127.0.0.1:9"


def _config(**kw: object) -> LoadConfig:
    return LoadConfig(url=URL, model="m", **kw)  # type: ignore[arg-type]


def test_poisson_schedule_is_reproducible_with_a_seed_and_changes_with_it() -> None:
    config = _config(rate_rps=20.0, requests=200, prompt=LengthSpec(100, 0.5), output=LengthSpec(50, 0.3), seed=7)
    first, again = build_schedule(config), build_schedule(config)
    assert first == again
    other = build_schedule(
        _config(rate_rps=20.0, requests=200, prompt=LengthSpec(100, 0.5), output=LengthSpec(50, 0.3), seed=8)
    )
    assert [p.arrival_s for p in first] != [p.arrival_s for p in other]


def test_poisson_gaps_have_the_asked_rate_and_respect_the_bounds() -> None:
    rate_rps = 50.0
    by_count = build_schedule(_config(rate_rps=rate_rps, requests=20_000, seed=1))
    arrivals_s = np.array([p.arrival_s for p in by_count])
    gaps_s = np.diff(arrivals_s)
    assert len(by_count) == 20_000
    assert np.all(gaps_s >= 0)
    # Mean gap of 20k exponential draws: standard error 0.7%, so 3% is a wide margin.
    assert gaps_s.mean() == pytest.approx(1 / rate_rps, rel=0.03)
    # Exponential gaps: the standard deviation equals the mean (not fixed spacing).
    assert gaps_s.std() == pytest.approx(1 / rate_rps, rel=0.05)

    by_duration = build_schedule(_config(rate_rps=rate_rps, duration_s=40.0, seed=1))
    assert all(p.arrival_s < 40.0 for p in by_duration)
    assert len(by_duration) == pytest.approx(rate_rps * 40, rel=0.05)
    assert [p.index for p in by_duration] == list(range(len(by_duration)))


def test_lognormal_lengths_have_the_asked_median_and_stay_within_the_cap() -> None:
    rng = np.random.default_rng(3)
    lengths = sample_lengths(LengthSpec(200, sigma=1.0, max_tokens=1000), rng, 50_000)
    assert np.median(lengths) == pytest.approx(200, rel=0.03)
    assert lengths.min() >= 1 and lengths.max() == 1000  # sigma 1 reaches 5x median often enough
    assert np.all(sample_lengths(LengthSpec(64), rng, 10) == 64)
    default_cap = sample_lengths(LengthSpec(10, sigma=3.0), rng, 10_000)
    assert default_cap.max() == 100


def test_bursts_arrive_every_period_with_long_prompts() -> None:
    config = _config(
        burst=BurstSpec(every_s=0.5, count=3, prompt_tokens=4000), duration_s=2.0, seed=0, prompt=LengthSpec(10)
    )
    schedule = build_schedule(config)
    assert [p.arrival_s for p in schedule] == [0.5] * 3 + [1.0] * 3 + [1.5] * 3
    assert all(p.source == BURST and p.prompt_tokens == 4000 for p in schedule)

    mixed = build_schedule(
        _config(rate_rps=10.0, burst=BurstSpec(1.0, 2, 3000), duration_s=3.0, seed=0, prompt=LengthSpec(10))
    )
    bursts = [p for p in mixed if p.source == BURST]
    assert [p.arrival_s for p in bursts] == [1.0, 1.0, 2.0, 2.0]
    assert all(p.prompt_tokens == 10 for p in mixed if p.source == POISSON)
    assert [p.arrival_s for p in mixed] == sorted(p.arrival_s for p in mixed)


def test_burst_times_stop_strictly_before_the_horizon() -> None:
    assert burst_arrivals_s(0.5, 2, until_s=1.5).tolist() == [0.5, 0.5, 1.0, 1.0]
    assert burst_arrivals_s(0.5, 1, until_s=1.51).tolist() == [0.5, 1.0, 1.5]
    assert burst_arrivals_s(2.0, 1, until_s=1.0).tolist() == []


def test_request_bound_with_bursts_only_takes_the_first_n_arrivals() -> None:
    schedule = build_schedule(_config(burst=BurstSpec(0.25, 4, 100), requests=10, seed=0))
    assert [p.arrival_s for p in schedule] == [0.25] * 4 + [0.5] * 4 + [0.75] * 2


def test_sessions_share_a_literal_prefix_and_prompt_lengths_are_exact_in_bytes() -> None:
    config = _config(
        rate_rps=100.0, requests=60, sessions=3, shared_prefix_tokens=40, prompt=LengthSpec(120, 0.4, 400), seed=5
    )
    schedule = build_schedule(config)
    assert {p.session for p in schedule} == {"session-0", "session-1", "session-2"}
    factory = PromptFactory(seed=5, chars_per_token=1.0, shared_prefix_tokens=40)
    prompts = {p.index: factory.prompt(p) for p in schedule}
    for planned in schedule:
        text = prompts[planned.index]
        assert len(text.encode("ascii")) == planned.prompt_tokens
    by_session: dict[str, set[str]] = {}
    for planned in schedule:
        by_session.setdefault(planned.session or "", set()).add(prompts[planned.index][:40])
    assert all(len(prefixes) == 1 for prefixes in by_session.values())
    assert len({next(iter(prefixes)) for prefixes in by_session.values()}) == 3
    # Beyond the shared prefix, prompts of one session differ.
    same_session = [prompts[p.index] for p in schedule if p.session == "session-0"]
    assert len({text[40:80] for text in same_session}) == len(same_session)


def test_chars_per_token_scales_prompt_text() -> None:
    factory = PromptFactory(seed=1, chars_per_token=4.0, shared_prefix_tokens=0)
    planned = build_schedule(_config(rate_rps=1.0, requests=1, prompt=LengthSpec(250), seed=1))[0]
    assert len(factory.prompt(planned)) == 1000
    assert len(synth_text(1, np.random.default_rng(0))) == 1
    assert synth_text(0, np.random.default_rng(0)) == ""


def test_replay_file_objects_and_arrays_sorted_by_arrival(tmp_path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text(
        json.dumps({"arrival_s": 0.5, "prompt_tokens": 30, "output_tokens": 4, "session": "a", "extra": 1}) + "\n"
        "\n" + json.dumps([0.1, 20, 3]) + "\n" + json.dumps([0.3, 10, 2, 7]) + "\n"
    )
    schedule = build_schedule(_config(replay_path=str(path), seed=0))
    assert [(p.arrival_s, p.prompt_tokens, p.output_tokens, p.session) for p in schedule] == [
        (0.1, 20, 3, None),
        (0.3, 10, 2, "7"),
        (0.5, 30, 4, "a"),
    ]
    truncated = build_schedule(_config(replay_path=str(path), seed=0, duration_s=0.4))
    assert [p.arrival_s for p in truncated] == [0.1, 0.3]
    assert len(build_schedule(_config(replay_path=str(path), seed=0, requests=1))) == 1


@pytest.mark.parametrize(
    ("third_line", "message"),
    [
        ("{not json", "not valid JSON"),
        ('{"arrival_s": 1, "prompt_tokens": 3}', "missing output_tokens"),
        ('{"arrival_s": -1, "prompt_tokens": 3, "output_tokens": 2}', "arrival_s must be a number >= 0"),
        ("[1, true, 2]", "prompt_tokens must be an integer >= 1"),
        ("[1, 2, 0]", "output_tokens must be an integer >= 1"),
        ("[1, 2]", "an array line needs"),
        ('"text"', "must be a JSON object or array"),
        ('[1, 2, 3, {"s": 1}]', "session must be a string or integer"),
    ],
)
def test_bad_replay_lines_name_their_line(tmp_path, third_line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("[0, 1, 1]\n[0.1, 1, 1]\n" + third_line + "\n")
    with pytest.raises(ReplayError, match=message) as info:
        load_replay(path)
    assert info.value.line == 3
    assert str(info.value).startswith(f"{path}:3: ")


def test_empty_or_missing_replay_file_is_one_clear_error(tmp_path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(ReplayError, match="no requests"):
        load_replay(empty)
    with pytest.raises(ReplayError, match="cannot read replay file"):
        load_replay(tmp_path / "absent.jsonl")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"rate_rps": 1.0}, "--duration or --requests"),
        ({"requests": 3}, "--rate"),
        ({"rate_rps": -1.0, "requests": 3}, "--rate must be >= 0"),
        ({"rate_rps": math.inf, "duration_s": 1.0}, "--rate inf"),
        ({"rate_rps": 1.0, "requests": 0}, "--requests must be at least 1"),
        ({"rate_rps": 1.0, "requests": 3, "prompt": LengthSpec(0)}, "--prompt-tokens"),
        ({"rate_rps": 1.0, "requests": 3, "output": LengthSpec(10, 0.5, 5)}, "--output-max-tokens"),
        ({"rate_rps": 1.0, "requests": 3, "shared_prefix_tokens": 5}, "needs --sessions"),
        ({"rate_rps": 1.0, "requests": 3, "replay_path": "x.jsonl"}, "--replay takes"),
        ({"rate_rps": 1.0, "requests": 3, "max_inflight": 0}, "--max-inflight"),
        ({"rate_rps": 1.0, "requests": 3, "timeout_s": 0.0}, "--timeout"),
    ],
)
def test_invalid_configs_raise_one_clear_error(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _config(**changes).validate()


def test_url_is_checked_and_completions_path_added_once() -> None:
    with pytest.raises(ConfigError, match="--url"):
        LoadConfig(url="localhost:8000", model="m", rate_rps=1.0, requests=1).validate()
    assert _config().endpoint == URL + "/v1/completions"
    assert LoadConfig(url=URL + "/v1/completions/", model="m").endpoint == URL + "/v1/completions"


def test_burst_spec_parsing() -> None:
    assert BurstSpec.parse("10:4:8192") == BurstSpec(10.0, 4, 8192)
    for bad in ("10:4", "a:b:c", "0:1:1", "5:0:10"):
        with pytest.raises(ConfigError, match="--burst"):
            BurstSpec.parse(bad)
