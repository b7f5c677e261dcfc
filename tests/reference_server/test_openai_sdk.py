"""The official `openai` SDK against a real 1 prefill + 1 decode server: what real clients speak.

The oracle for generated text is an in-process greedy `generate` of the same model (`reference_tokens`),
decoded with the byte tokenizer; the chat prompt is the documented template, rendered here by hand.
"""

from __future__ import annotations

import openai
import pytest

from reference_server.tokenizer import decode
from tests.reference_server.server_harness import Server, http, reference_tokens, wait_for
from tracer import spans as s

NO_EOS = {"ignore_eos": True}  # the tiny model's random weights may draw EOS early; the oracle never stops


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = Server(tmp_path_factory.mktemp("sdk"), "--mode", "disaggregated", "--kv-streams", "2")
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(server):
    # No retries: a test must see the server's first answer, not the SDK's second attempt.
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat_prompt(system: str, user: str) -> str:
    return f"<|system|>\n{system}\n<|user|>\n{user}\n<|assistant|>\n"


def test_models_list_and_retrieve(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"] and models.data[0].owned_by == "splitscope"
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-4o")
    assert "gpt-4o" in caught.value.message and caught.value.body["code"] == "model_not_found"


def test_chat_non_streaming_answers_the_templates_greedy_tokens_with_usage(client, server):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, extra_body=NO_EOS)
    prompt = _chat_prompt("You are terse.", "Name a colour.")
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-")
    choice = answer.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert choice.message.content == decode(reference_tokens(prompt, 12))
    assert answer.usage.prompt_tokens == len(prompt.encode()) and answer.usage.completion_tokens == 12

    def chat_root_span():
        return next((x for x in server.spans() if x.attributes.get(s.ATTR_REQUEST_ID) == answer.id), None)

    root = wait_for(chat_root_span, 15, "the chat request's root span")
    assert root.name == f"{s.CHAT_SPAN_PREFIX} tiny" and root.attributes[s.ATTR_OPERATION] == s.OPERATION_CHAT
    assert root.attributes[s.ATTR_OUTPUT_TOKENS] == 12


def test_chat_streaming_with_usage_never_sends_an_empty_delta(client):
    messages = [{"role": "user", "content": "Tell me a story about a fox."}]
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_completion_tokens=40,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=NO_EOS,
    )
    chunks = list(stream)
    content_chunks = [c for c in chunks if c.choices and c.choices[0].finish_reason is None]
    assert content_chunks and all(c.choices[0].delta.content for c in content_chunks)  # no empty text events
    assert content_chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    prompt = f"<|user|>\n{messages[0]['content']}\n<|assistant|>\n"
    assert text == decode(reference_tokens(prompt, 40))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40
    assert chunks[-1].usage.prompt_tokens == len(prompt.encode())


def test_streamed_completion_holds_incomplete_utf8_and_every_token_is_delivered(client):
    # return_token_ids (vLLM's extension) shows which tokens each event carries.
    stream = client.completions.create(
        model="tiny",
        prompt="Grüße aus Köln",
        max_tokens=48,
        stream=True,
        extra_body={**NO_EOS, "return_token_ids": True},
    )
    chunks = list(stream)
    middle = [c for c in chunks if c.choices[0].finish_reason is None]
    assert all(c.choices[0].text for c in middle)
    token_ids = [t for c in chunks for t in c.choices[0].model_extra["token_ids"]]
    assert token_ids == reference_tokens("Grüße aus Köln", 48)
    assert "".join(c.choices[0].text for c in chunks) == decode(token_ids)


def _stop_for(text: str) -> tuple[str, int]:
    """A two-character stop string from the middle of `text` (no U+FFFD, so the worker's byte-level stop
    fires too), and where it first occurs."""
    for start in range(len(text) // 3, len(text) - 2):
        candidate = text[start : start + 2]
        if "\ufffd" not in candidate:
            return candidate, text.find(candidate)
    pytest.skip("the greedy text has no stop candidate")  # never seen: the text has 60 bytes


@pytest.mark.parametrize("stream", [False, True])
def test_completion_with_stop_ends_before_the_stop_string(client, stream):
    prompt = "Once upon a time"
    full = decode(reference_tokens(prompt, 60))
    stop, at = _stop_for(full)
    kwargs = {"model": "tiny", "prompt": prompt, "max_tokens": 60, "stop": ["never-there", stop], "extra_body": NO_EOS}
    if stream:
        chunks = list(client.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].text for c in chunks)
        finish_reason = chunks[-1].choices[0].finish_reason
    else:
        answer = client.completions.create(**kwargs)
        text, finish_reason = answer.choices[0].text, answer.choices[0].finish_reason
        assert answer.usage.completion_tokens < 60
    assert text == full[:at] and finish_reason == "stop"


def test_top_p_is_applied(client):
    prompt = "Sample me"
    greedy = decode(reference_tokens(prompt, 24))

    def text(top_p: float, seed: int) -> str:
        answer = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=24, temperature=1.0, top_p=top_p, seed=seed, extra_body=NO_EOS
        )
        return answer.choices[0].text

    # A nucleus holding only the most probable token is greedy decoding, whatever the seed.
    assert text(1e-9, 1) == greedy and text(1e-9, 2) == greedy
    assert text(1.0, 1) != greedy  # without it, temperature 1 draws something else (24 draws over 258 tokens)


def test_errors_surface_as_the_sdks_exceptions_with_the_servers_message(client, server):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert "gpt-4o" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt="x", presence_penalty=0.5)
    assert "presence_penalty" in caught.value.message and caught.value.body["param"] == "presence_penalty"
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt="x", logprobs=2)
    assert "logprobs" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * 2000}], max_tokens=8)
    assert caught.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError) as caught:
        openai.OpenAI(base_url=server.url + "/v2", api_key="unused", max_retries=0).models.list()
    assert "no route GET /v2/models" in caught.value.message
    status, _, headers = http("GET", server.url + "/v1/completions")
    assert status == 405 and "POST" in headers["Allow"]
