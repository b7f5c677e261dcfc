"""Router pieces without processes: routing choices, request validation (the /metrics join: test_metrics_join)."""

from __future__ import annotations

import pytest

from reference_server.openai_api import ApiError, Limits, parse_completion
from reference_server.router import Endpoint, least_loaded, sticky


def _pool(n: int) -> list[Endpoint]:
    return [Endpoint(f"w{i}", "colocated", f"http://w{i}") for i in range(n)]


def test_least_loaded_skips_dead_workers_and_weighs_prompt_tokens():
    pool = _pool(3)
    pool[0].inflight, pool[1].inflight, pool[2].inflight = 2, 1, 0
    pool[2].alive = False
    assert least_loaded(pool).name == "w1"
    pool[1].inflight_tokens, pool[0].inflight_tokens = 5000, 10
    assert least_loaded(pool, by_tokens=True).name == "w0"
    for endpoint in pool:
        endpoint.alive = False
    assert least_loaded(pool) is None


def test_sticky_routing_is_stable_and_moves_only_the_dead_workers_users():
    pool = _pool(4)
    users = [f"user-{i}" for i in range(200)]
    before = {u: sticky(pool, u).name for u in users}
    assert len(set(before.values())) == 4  # users spread over every worker
    assert before == {u: sticky(pool, u).name for u in users}  # same answer every time
    pool[2].alive = False
    after = {u: sticky(pool, u).name for u in users}
    moved = {u for u in users if before[u] != after[u]}
    assert moved == {u for u in users if before[u] == "w2"}


LIMITS = Limits("tiny", max_context_tokens=1024, max_tokens=1023)


def test_parse_completion_reads_the_openai_fields():
    params = parse_completion(
        {"model": "tiny", "prompt": "héllo", "max_tokens": 7, "temperature": 0.5, "stream": True,
         "stream_options": {"include_usage": True}, "user": "u", "seed": 3},
        LIMITS,
    )  # fmt: skip
    assert params.prompt_token_ids == tuple("héllo".encode())
    assert (params.max_tokens, params.temperature, params.stream, params.include_usage) == (7, 0.5, True, True)
    assert params.user == "u" and params.seed == 3 and not params.ignore_eos
    assert parse_completion({"model": "tiny", "prompt": [1, 2, 3]}, LIMITS).max_tokens == 16
    assert parse_completion({"model": "tiny", "prompt": "x", "max_tokens": 4, "min_tokens": 4}, LIMITS).ignore_eos


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x"}, "model"),
        ({"model": "tiny", "prompt": [1, 300]}, "prompt"),
        ({"model": "tiny", "prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "temperature": 3}, "temperature"),
        ({"model": "tiny", "prompt": "x", "n": 2}, "n"),
        ({"model": "tiny", "prompt": "x", "stop": ["\n"]}, "stop"),
        ({"model": "tiny", "prompt": "x", "user": 5}, "user"),
    ],
)
def test_parse_completion_names_the_bad_field(body, param):
    with pytest.raises(ApiError) as caught:
        parse_completion(body, LIMITS)
    assert caught.value.status == 400 and caught.value.param == param


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mode", "colocated", "--prefill-workers", "2"], "--mode disaggregated"),
        (["--mode", "disaggregated", "--workers", "2"], "--prefill-workers"),
        (["--preset", "huge"], "--preset must be one of"),
        (["--workers", "0"], "--workers must be at least 1"),
        (["--mode", "chunked", "--chunk-budget", "8"], "--chunk-budget"),
        (["--block-size", "7"], "--block-size"),
        (["--device", "tpu"], "--device"),
    ],
)
def test_serve_refuses_bad_flags_with_one_clear_line(args, message):
    from click.testing import CliRunner

    from reference_server.launch import serve_command

    result = CliRunner().invoke(serve_command, args)
    assert result.exit_code == 2 and message in result.output, result.output
