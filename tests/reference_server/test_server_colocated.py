"""A real 2-worker chunked-prefill server: correct tokens, sticky routing into the prefix cache, bad requests."""

from __future__ import annotations

import json
import secrets
from concurrent.futures import ThreadPoolExecutor

import pytest

from reference_server.serving.router import Endpoint, sticky
from tests.reference_server.server_harness import (
    Server,
    http,
    reference_tokens,
    sse_events,
    streamed_token_ids,
    wait_for,
)
from tracer import spans as s


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # A 64-token budget splits every prompt over 64 tokens into several chunks.
    server = Server(
        tmp_path_factory.mktemp("chunked"),
        "--mode",
        "chunked",
        "--workers",
        "2",
        "--chunk-budget",
        "64",
        "--max-batch",
        "8",
    )
    yield server
    server.close()


def test_chunked_streams_the_tokens_of_a_direct_generate_under_batching(server):
    prompts = ["Chunked prefill keeps decodes flowing. " * 6, "short", "y" * 150, "Hello world"]
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(
            pool.map(
                lambda p: server.complete(
                    {"prompt": p, "max_tokens": 10, "stream": True, "ignore_eos": True, "return_token_ids": True}
                ),
                prompts,
            )
        )
    for prompt, (status, body, _) in zip(prompts, answers):
        assert status == 200
        events = sse_events(body)
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert streamed_token_ids(events) == reference_tokens(prompt, 10), prompt


def test_long_prompts_are_prefilled_in_chunks(server):
    trace_id = secrets.token_hex(16)
    prompt = "z" * 200
    status, _, _ = server.complete(
        {"prompt": prompt, "max_tokens": 3}, headers={"traceparent": f"00-{trace_id}-{'1' * 16}-01"}
    )
    assert status == 200

    def prefill_span():
        return next((x for x in server.spans() if x.trace_id == trace_id and x.name == s.SPAN_PREFILL), None)

    span = wait_for(prefill_span, 15, "the prefill span")
    assert span.attributes[s.ATTR_PREFILL_TOKENS] == 200
    assert span.attributes[s.ATTR_PREFILL_CHUNKS] >= 4  # 200 tokens at <= 64 a step
    assert span.attributes[s.ATTR_POOL] == "colocated"


def test_sticky_routing_by_user_lands_on_the_prefix_cache(server):
    workers = [Endpoint("chunked-0", "colocated", ""), Endpoint("chunked-1", "colocated", "")]
    # A user whose sticky worker is not the one least-loaded routing would pick for sequential requests.
    user = next(f"user-{i}" for i in range(1000) if sticky(workers, f"user-{i}").name == "chunked-1")
    shared = "You are a helpful assistant. Answer briefly and precisely. " * 3  # 177 tokens: 11 full blocks
    usages = []
    questions = ("What is KV cache?", "What is prefill?")
    for question in questions:
        status, body, _ = server.complete({"prompt": shared + question, "max_tokens": 3, "user": user})
        assert status == 200
        usages.append(json.loads(body)["usage"])
    assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] >= 160  # whole shared blocks came from the cache

    def prefill_spans():
        spans = [
            x
            for x in server.spans()
            if x.name == s.SPAN_PREFILL and x.attributes[s.ATTR_PREFILL_TOKENS] in {len(shared + q) for q in questions}
        ]
        return spans if len(spans) >= 2 else None

    spans = wait_for(prefill_spans, 15, "both prefill spans")
    assert {x.attributes[s.ATTR_WORKER] for x in spans} == {"chunked-1"}
    assert max(x.attributes[s.ATTR_PREFILL_CACHED_TOKENS] for x in spans) >= 160


@pytest.mark.parametrize(
    "body, param, code",
    [
        ({"prompt": "x", "max_tokens": "5"}, "max_tokens", None),
        ({"prompt": 12, "max_tokens": 5}, "prompt", None),
        ({"prompt": "x", "temperature": "hot"}, "temperature", None),
        ({"prompt": "x", "stream": "yes"}, "stream", None),
        ({"prompt": "x" * 1100, "max_tokens": 5}, "prompt", "context_length_exceeded"),
        ({"prompt": "x" * 1000, "max_tokens": 100}, "prompt", "context_length_exceeded"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", None),
        ({"prompt": "x", "max_tokens": -3}, "max_tokens", None),
        ({"prompt": "x", "max_tokens": 5000}, "max_tokens", None),
        ({"prompt": ""}, "prompt", None),
    ],
)
def test_bad_requests_get_400_with_an_openai_error_body(server, body, param, code):
    status, raw, headers = server.complete(body)
    assert status == 400 and headers["Content-Type"].startswith("application/json")
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["code"] == code
    assert error["message"]


def test_an_unknown_model_gets_404_as_openai_and_vllm_answer(server):
    status, raw, headers = server.complete({"prompt": "x", "model": "gpt-4"})
    error = json.loads(raw)["error"]
    assert status == 404 and headers["Content-Type"].startswith("application/json")
    assert error["code"] == "model_not_found" and error["param"] == "model" and "gpt-4" in error["message"]


def test_a_chunked_chat_stream_with_a_stop_string(server):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 40,
        "stream": True,
        "ignore_eos": True,
    }
    status, raw, _ = http("POST", server.url + "/v1/chat/completions", body)
    full = "".join(
        e["choices"][0]["delta"].get("content", "") for e in sse_events(raw) if isinstance(e, dict) and e["choices"]
    )
    stop = next(full[i : i + 2] for i in range(len(full) // 3, len(full) - 2) if "\ufffd" not in full[i : i + 2])
    status, raw, _ = http("POST", server.url + "/v1/chat/completions", {**body, "stop": stop})
    events = [e for e in sse_events(raw) if isinstance(e, dict) and e["choices"]]
    assert status == 200 and events[-1]["choices"][0]["finish_reason"] == "stop"
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == full[: full.find(stop)]


def test_malformed_json_gets_400(server):
    status, raw, _ = http("POST", server.url + "/v1/completions", raw=b'{"model": "tiny", "prompt": ')
    error = json.loads(raw)["error"]
    assert status == 400 and error["code"] == "invalid_json" and "JSON" in error["message"]
    status, raw, _ = http("POST", server.url + "/v1/completions", raw=b'["not", "an", "object"]')
    assert status == 400 and json.loads(raw)["error"]["type"] == "invalid_request_error"


def test_a_body_over_the_size_limit_gets_413(server):
    status, raw, _ = server.complete({"prompt": "x" * (2 << 20)})
    assert status == 413
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "body_too_large"
    assert server.health()["status"] == "ok"  # and the server keeps serving


def test_sampling_with_a_seed_is_reproducible(server):
    def tokens(seed: int) -> list[int]:
        status, body, _ = server.complete(
            {
                "prompt": "Sample me",
                "max_tokens": 16,
                "temperature": 1.0,
                "seed": seed,
                "ignore_eos": True,
                "return_token_ids": True,
            }
        )
        assert status == 200
        return json.loads(body)["choices"][0]["token_ids"]

    first = tokens(1234)
    assert tokens(1234) == first
    assert tokens(99) != first  # 16 draws over a 258-token vocab at temperature 1: a collision is negligible
    assert first != reference_tokens("Sample me", 16)  # and it is not greedy decoding
