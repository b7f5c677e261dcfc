"""Router pieces without processes: routing choices, request validation (the /metrics join: test_metrics_join)."""

from __future__ import annotations

import pytest

from reference_server.serving.openai_api import ApiError, Limits, parse_chat, parse_completion
from reference_server.serving.router import Endpoint, least_loaded, sticky
from tracer.spans import OPERATION_CHAT


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
        {
            "model": "tiny",
            "prompt": "héllo",
            "max_tokens": 7,
            "temperature": 0.5,
            "stream": True,
            "stream_options": {"include_usage": True},
            "user": "u",
            "seed": 3,
        },
        LIMITS,
    )
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
        ({"model": "tiny", "prompt": "x", "stop": [""]}, "stop"),
        ({"model": "tiny", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"model": "tiny", "prompt": "x", "stop": 7}, "stop"),
        ({"model": "tiny", "prompt": "x", "top_p": 0}, "top_p"),
        ({"model": "tiny", "prompt": "x", "top_p": 1.5}, "top_p"),
        ({"model": "tiny", "prompt": "x", "user": 5}, "user"),
        # Sampling fields this server does not implement are refused, never silently ignored.
        ({"model": "tiny", "prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
        ({"model": "tiny", "prompt": "x", "frequency_penalty": -1}, "frequency_penalty"),
        ({"model": "tiny", "prompt": "x", "logit_bias": {"65": 10}}, "logit_bias"),
        ({"model": "tiny", "prompt": "x", "best_of": 2}, "best_of"),
        ({"model": "tiny", "prompt": "x", "logprobs": 1}, "logprobs"),
        ({"model": "tiny", "prompt": "x", "logprobs": 0}, "logprobs"),
        ({"model": "tiny", "prompt": "x", "echo": True}, "echo"),
        ({"model": "tiny", "prompt": "x", "top_k": 5}, "top_k"),
    ],
)
def test_parse_completion_names_the_bad_field(body, param):
    with pytest.raises(ApiError) as caught:
        parse_completion(body, LIMITS)
    assert caught.value.status == 400 and caught.value.param == param


def test_neutral_values_of_unimplemented_fields_are_accepted():
    params = parse_completion(
        {
            "model": "tiny",
            "prompt": "x",
            "presence_penalty": 0,
            "frequency_penalty": 0.0,
            "logit_bias": {},
            "best_of": 1,
            "echo": False,
            "top_k": -1,
        },
        LIMITS,
    )
    assert params.top_p == 1.0 and params.stop == ()


def test_parse_completion_reads_stop_and_top_p():
    params = parse_completion({"model": "tiny", "prompt": "x", "stop": "\n\n", "top_p": 0.9}, LIMITS)
    assert params.stop == ("\n\n",) and params.top_p == 0.9
    assert parse_completion({"model": "tiny", "prompt": "x", "stop": ["a", "bc", "a"]}, LIMITS).stop == ("a", "bc")


def test_an_unknown_model_is_404_model_not_found():
    with pytest.raises(ApiError) as caught:
        parse_completion({"model": "gpt-4", "prompt": "x"}, LIMITS)
    assert caught.value.status == 404 and caught.value.code == "model_not_found" and "gpt-4" in caught.value.message
    with pytest.raises(ApiError) as caught:
        parse_chat({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, LIMITS)
    assert caught.value.status == 404


def test_parse_chat_renders_the_template_and_reads_max_completion_tokens():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
    ]
    params = parse_chat(
        {
            "model": "tiny",
            "messages": messages,
            "max_completion_tokens": 9,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        LIMITS,
    )
    assert bytes(params.prompt_token_ids).decode() == "<|system|>\nBe brief.\n<|user|>\nHi there\n<|assistant|>\n"
    assert params.max_tokens == 9 and params.stream and params.include_usage and params.operation == OPERATION_CHAT


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content",
        ),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
        (
            {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
            "response_format",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ],
)
def test_parse_chat_names_the_bad_field(body, param):
    with pytest.raises(ApiError) as caught:
        parse_chat({"model": "tiny", **body}, LIMITS)
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
        (["--slo-ttft", "0"], "--slo-ttft"),
        (["--step-sample", "0"], "--step-sample"),
    ],
)
def test_serve_refuses_bad_flags_with_one_clear_line(args, message):
    from click.testing import CliRunner

    from reference_server.launch.serve import serve_command

    result = CliRunner().invoke(serve_command, args)
    assert result.exit_code == 2 and message in result.output, result.output
