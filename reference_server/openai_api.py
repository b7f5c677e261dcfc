"""The OpenAI completions surface: request validation and response bodies. Pure functions, no I/O.

`parse_completion(body, limits)` turns a decoded JSON body into `CompletionParams` or raises `ApiError`
(status 400 with an OpenAI-style error: {"error": {"message", "type", "param", "code"}}). The
prompt is a string (byte-tokenized here, as every worker would) or a list of token ids.

Accepted fields: model, prompt, max_tokens (default 16), temperature (0..2, default 0: greedy), stream,
stream_options.include_usage, user, seed, n (1 only), echo/logprobs/stop (only their empty values),
plus vLLM's min_tokens / ignore_eos (a min_tokens >= max_tokens, or ignore_eos, disables the EOS stop)
and return_token_ids (adds each choice's token ids). Other fields are ignored, as OpenAI-compatible
servers do.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any

from reference_server.tokenizer import VOCAB_SIZE, encode

DEFAULT_MAX_TOKENS = 16
MAX_TEMPERATURE = 2.0
MAX_USER_CHARS = 256


class ApiError(Exception):
    """An answer other than 200, with an OpenAI-style error body."""

    def __init__(self, status: int, message: str, *, error_type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, self.code)


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


@dataclass(frozen=True)
class Limits:
    model: str  # the one model name served
    max_context_tokens: int  # prompt + max_tokens must fit
    max_tokens: int  # upper bound of max_tokens alone


@dataclass(frozen=True)
class CompletionParams:
    model: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    temperature: float
    stream: bool
    include_usage: bool
    user: str | None
    seed: int | None
    ignore_eos: bool
    return_token_ids: bool


def _is_int(value: Any) -> bool:
    return type(value) is int


def _is_number(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def _bad(message: str, param: str, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def parse_completion(body: Any, limits: Limits) -> CompletionParams:
    """Validate a /v1/completions body. Raises ApiError(400) naming the first offending field."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str):
        raise _bad("'model' is required and must be a string", "model")
    if model != limits.model:
        raise _bad(f"model {model!r} does not exist; this server serves {limits.model!r}", "model", "model_not_found")

    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        prompt_ids = tuple(encode(prompt))
    elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        prompt_ids = tuple(prompt)
        if any(not 0 <= t < VOCAB_SIZE for t in prompt_ids):
            raise _bad(f"prompt token ids must be in [0, {VOCAB_SIZE})", "prompt")
    else:
        raise _bad("'prompt' must be a string or a list of token ids", "prompt")
    if not prompt_ids:
        raise _bad("'prompt' must not be empty", "prompt")

    max_tokens = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if not _is_int(max_tokens):
        raise _bad("'max_tokens' must be an integer", "max_tokens")
    if max_tokens <= 0:
        raise _bad(f"'max_tokens' must be at least 1, got {max_tokens}", "max_tokens")
    if max_tokens > limits.max_tokens:
        raise _bad(f"'max_tokens' must be at most {limits.max_tokens}, got {max_tokens}", "max_tokens")
    if len(prompt_ids) + max_tokens > limits.max_context_tokens:
        raise _bad(
            f"this model's maximum context length is {limits.max_context_tokens} tokens; the request has "
            f"{len(prompt_ids)} prompt tokens and asks for {max_tokens} more",
            "prompt",
            "context_length_exceeded",
        )

    temperature = body.get("temperature", 0.0)
    if temperature is None:
        temperature = 0.0
    if not _is_number(temperature) or not 0 <= temperature <= MAX_TEMPERATURE:
        raise _bad(f"'temperature' must be a number in [0, {MAX_TEMPERATURE:g}]", "temperature")

    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict) or not isinstance(stream_options.get("include_usage", False), bool):
        raise _bad("'stream_options' must be an object with a boolean 'include_usage'", "stream_options")

    user = body.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > MAX_USER_CHARS):
        raise _bad(f"'user' must be a string of at most {MAX_USER_CHARS} characters", "user")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise _bad("'seed' must be an integer", "seed")
    n = body.get("n", 1)
    if n not in (None, 1) or isinstance(n, bool):
        raise _bad("only n = 1 is supported", "n")
    for name in ("echo", "logprobs", "stop", "suffix"):
        if body.get(name) not in (None, False, [], ""):
            raise _bad(f"'{name}' is not supported by this server", name)
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise _bad("'ignore_eos' must be a boolean", "ignore_eos")
    min_tokens = body.get("min_tokens", 0)
    if min_tokens is None:
        min_tokens = 0
    if not _is_int(min_tokens) or min_tokens < 0:
        raise _bad("'min_tokens' must be a non-negative integer", "min_tokens")
    return_token_ids = body.get("return_token_ids", False)
    if not isinstance(return_token_ids, bool):
        raise _bad("'return_token_ids' must be a boolean", "return_token_ids")

    return CompletionParams(
        model=model,
        prompt_token_ids=prompt_ids,
        max_tokens=max_tokens,
        temperature=float(temperature),
        stream=stream,
        include_usage=stream_options.get("include_usage", False),
        user=user,
        seed=seed,
        # The EOS stop is all or nothing here: min_tokens up to max_tokens means "never stop early".
        ignore_eos=ignore_eos or min_tokens >= max_tokens,
        return_token_ids=return_token_ids,
    )


# --------------------------------------------------------------------------------------- responses


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def chunk_event(completion_id: str, created_s: int, model: str, text: str, finish_reason: str | None,
                token_ids: list[int] | None = None) -> bytes:  # fmt: skip
    """One SSE event of a streamed completion."""
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    body = {"id": completion_id, "object": "text_completion", "created": created_s, "model": model, "choices": [choice]}
    return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"


def usage_event(completion_id: str, created_s: int, model: str, usage_body: dict[str, Any]) -> bytes:
    body = {"id": completion_id, "object": "text_completion", "created": created_s, "model": model, "choices": [],
            "usage": usage_body}  # fmt: skip
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def error_event(message: str, error_type: str, code: str | None = None) -> bytes:
    return b"data: " + json.dumps(error_body(message, error_type, None, code)).encode() + b"\n\n"


DONE_EVENT = b"data: [DONE]\n\n"


def completion_body(completion_id: str, created_s: int, model: str, text: str, finish_reason: str | None,
                    usage_body: dict[str, Any], token_ids: list[int] | None = None) -> dict[str, Any]:  # fmt: skip
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": completion_id, "object": "text_completion", "created": created_s, "model": model,
            "choices": [choice], "usage": usage_body}  # fmt: skip


def now_s() -> int:
    return int(time.time())
