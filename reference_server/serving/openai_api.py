"""The OpenAI surface: request validation and response bodies. Pure functions, no I/O.

`parse_completion(body, limits)` and `parse_chat(body, limits)` turn a decoded JSON body into
`CompletionParams` or raise `ApiError` (an OpenAI-style error: {"error": {"message", "type", "param",
"code"}}; 400, or 404 for a model this server does not serve, as OpenAI and vLLM answer). A completion's
prompt is a string (byte-tokenized here, as every worker would) or a list of token ids; a chat's messages
are rendered by `render_chat` (a plain-text template) and byte-tokenized.

Sampling fields are implemented or refused, never ignored: temperature (0..2, default 0: greedy), top_p
(0 < p <= 1), seed, stop (a string or up to 4; the text stops before the first occurrence and the stop
string is not returned), max_tokens / max_completion_tokens, plus vLLM's min_tokens / ignore_eos (a
min_tokens >= max_tokens, or ignore_eos, disables the EOS stop) and return_token_ids. Refused with 400
unless at their neutral value: n, best_of, presence/frequency/repetition penalties, logit_bias, logprobs,
top_logprobs, echo, suffix, top_k, min_p, tools, response_format other than text. Fields that do not
change the tokens (user, metadata, store, ...) are accepted, as OpenAI-compatible servers do.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any

from reference_server.tokenizer import VOCAB_SIZE, encode
from tracer.spans import OPERATION_CHAT, OPERATION_TEXT_COMPLETION

OPERATION_COMPLETION = OPERATION_TEXT_COMPLETION  # gen_ai.operation.name (GenAI semantic conventions)

DEFAULT_MAX_TOKENS = 16
MAX_TEMPERATURE = 2.0
MAX_USER_CHARS = 256
MAX_STOP_SEQUENCES = 4  # OpenAI's bound
MAX_STOP_CHARS = 256
CHAT_ROLES = ("system", "developer", "user", "assistant")
OWNED_BY = "splitscope"


class ApiError(Exception):
    """An answer other than 200, with an OpenAI-style error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        error_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
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


def model_not_found(model: str, served: str) -> ApiError:
    return ApiError(
        404, f"model {model!r} does not exist; this server serves {served!r}", param="model", code="model_not_found"
    )


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
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    operation: str = OPERATION_COMPLETION  # text_completion | chat


def _is_int(value: Any) -> bool:
    return type(value) is int


def _is_number(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def _bad(message: str, param: str, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _zero(value: Any) -> bool:
    return _is_number(value) and value == 0


def _empty(value: Any) -> bool:
    return value in ([], {}, "")


def _never(value: Any) -> bool:
    return False


# Fields refused unless absent (None) or at their neutral value, the one that leaves sampling unchanged.
_NEUTRAL = {
    "best_of": lambda v: _is_int(v) and v == 1,
    "presence_penalty": _zero,
    "frequency_penalty": _zero,
    "repetition_penalty": lambda v: _is_number(v) and v == 1,
    "logit_bias": _empty,
    "echo": lambda v: v is False,
    "suffix": _empty,
    "top_logprobs": lambda v: _is_int(v) and v == 0,
    "top_k": lambda v: _is_int(v) and v in (-1, 0),
    "min_p": _zero,
    "tools": _empty,
    "functions": _empty,
    "tool_choice": lambda v: v == "none",
    "stop_token_ids": _empty,
    "guided_json": _never,
    "guided_regex": _never,
    "guided_choice": _never,
}


def _refuse_unsupported(body: dict[str, Any], names: tuple[str, ...]) -> None:
    for name in names:
        value = body.get(name)
        if value is not None and not _NEUTRAL[name](value):
            raise _bad(f"'{name}' is not supported by this server (only its default is accepted)", name)


def _parse_model(body: Any, limits: Limits) -> str:
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str):
        raise _bad("'model' is required and must be a string", "model")
    if model != limits.model:
        raise model_not_found(model, limits.model)
    return model


def _parse_stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(x, str) and 0 < len(x) <= MAX_STOP_CHARS for x in stops):
        raise _bad(
            f"'stop' must be a non-empty string or a list of them (each at most {MAX_STOP_CHARS} characters)", "stop"
        )
    if len(stops) > MAX_STOP_SEQUENCES:
        raise _bad(f"'stop' takes at most {MAX_STOP_SEQUENCES} sequences, got {len(stops)}", "stop")
    return tuple(dict.fromkeys(stops))


def _parse_max_tokens(
    body: dict[str, Any], limits: Limits, prompt_ids: tuple[int, ...], *, max_tokens_key: str, operation: str
) -> int:
    """The requested output length: `max_tokens_key` first, then 'max_tokens', then the default; it must fit
    the context together with the prompt."""
    if not prompt_ids:
        raise _bad("'prompt' must not be empty", "prompt" if operation == OPERATION_COMPLETION else "messages")
    max_tokens = body.get(max_tokens_key)
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
        max_tokens_key = "max_tokens"
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if not _is_int(max_tokens):
        raise _bad(f"'{max_tokens_key}' must be an integer", max_tokens_key)
    if max_tokens <= 0:
        raise _bad(f"'{max_tokens_key}' must be at least 1, got {max_tokens}", max_tokens_key)
    if max_tokens > limits.max_tokens:
        raise _bad(f"'{max_tokens_key}' must be at most {limits.max_tokens}, got {max_tokens}", max_tokens_key)
    prompt_param = "prompt" if operation == OPERATION_COMPLETION else "messages"
    if len(prompt_ids) + max_tokens > limits.max_context_tokens:
        raise _bad(
            f"this model's maximum context length is {limits.max_context_tokens} tokens; the request has "
            f"{len(prompt_ids)} prompt tokens and asks for {max_tokens} more",
            prompt_param,
            "context_length_exceeded",
        )
    return max_tokens


def _parse_sampling(body: dict[str, Any]) -> tuple[float, float]:
    """(temperature, top_p), each defaulted when absent or null."""
    temperature = body.get("temperature", 0.0)
    if temperature is None:
        temperature = 0.0
    if not _is_number(temperature) or not 0 <= temperature <= MAX_TEMPERATURE:
        raise _bad(f"'temperature' must be a number in [0, {MAX_TEMPERATURE:g}]", "temperature")
    top_p = body.get("top_p", 1.0)
    if top_p is None:
        top_p = 1.0
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise _bad("'top_p' must be a number in (0, 1]", "top_p")
    return float(temperature), float(top_p)


def _parse_stream(body: dict[str, Any]) -> tuple[bool, bool]:
    """(stream, include_usage): whether to answer with server-sent events, and whether they end with usage."""
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict) or not isinstance(stream_options.get("include_usage", False), bool):
        raise _bad("'stream_options' must be an object with a boolean 'include_usage'", "stream_options")
    return stream, stream_options.get("include_usage", False)


def _parse_common(
    body: dict[str, Any],
    limits: Limits,
    model: str,
    prompt_ids: tuple[int, ...],
    *,
    max_tokens_key: str,
    operation: str,
) -> CompletionParams:
    """The fields completions and chat share, checked in the order a reader meets them."""
    max_tokens = _parse_max_tokens(body, limits, prompt_ids, max_tokens_key=max_tokens_key, operation=operation)
    temperature, top_p = _parse_sampling(body)
    stream, include_usage = _parse_stream(body)
    user = body.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > MAX_USER_CHARS):
        raise _bad(f"'user' must be a string of at most {MAX_USER_CHARS} characters", "user")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise _bad("'seed' must be an integer", "seed")
    n = body.get("n", 1)
    if n not in (None, 1) or isinstance(n, bool):
        raise _bad("only n = 1 is supported", "n")
    stop = _parse_stop(body.get("stop"))
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
        temperature=temperature,
        stream=stream,
        include_usage=include_usage,
        user=user,
        seed=seed,
        # The EOS stop is all or nothing here: min_tokens up to max_tokens means "never stop early".
        ignore_eos=ignore_eos or min_tokens >= max_tokens,
        return_token_ids=return_token_ids,
        top_p=top_p,
        stop=stop,
        operation=operation,
    )


_COMPLETION_REFUSED = (
    "best_of",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "echo",
    "suffix",
    "top_k",
    "min_p",
    "stop_token_ids",
    "guided_json",
    "guided_regex",
    "guided_choice",
)
_CHAT_REFUSED = (
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "top_logprobs",
    "top_k",
    "min_p",
    "tools",
    "functions",
    "tool_choice",
    "stop_token_ids",
    "guided_json",
    "guided_regex",
    "guided_choice",
)


def parse_completion(body: Any, limits: Limits) -> CompletionParams:
    """Validate a /v1/completions body. Raises ApiError (400, 404 for another model) naming the field."""
    model = _parse_model(body, limits)
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
    _refuse_unsupported(body, _COMPLETION_REFUSED)
    if body.get("logprobs") is not None:  # an int here: how many alternatives per token
        raise _bad("'logprobs' is not supported by this server", "logprobs")
    return _parse_common(body, limits, model, prompt_ids, max_tokens_key="max_tokens", operation=OPERATION_COMPLETION)


def _message_text(message: Any, index: int) -> tuple[str, str]:
    """(role, text) of one chat message; text parts are joined, anything else is refused."""
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise _bad(f"{param} must be an object with 'role' and 'content'", param)
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise _bad(
            f"{param}.role must be one of {', '.join(CHAT_ROLES)} (tools are not supported), got {str(role)[:40]!r}",
            f"{param}.role",
        )
    content = message.get("content")
    if isinstance(content, str):
        return role, content
    if isinstance(content, list) and content:
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"{param}.content: only text parts are supported", f"{param}.content")
            texts.append(part["text"])
        return role, "".join(texts)
    raise _bad(f"{param}.content must be a string or a list of text parts", f"{param}.content")


def render_chat(messages: list[tuple[str, str]]) -> str:
    """The chat template: each message as `<|role|>\\n{content}\\n`, then `<|assistant|>\\n` for the reply.

    A plain-text template (Zephyr's shape) over the byte tokenizer, which has no special role tokens.
    `developer` is OpenAI's newer name for `system` and renders as it.
    """
    parts = [f"<|{'system' if role == 'developer' else role}|>\n{text}\n" for role, text in messages]
    parts.append("<|assistant|>\n")
    return "".join(parts)


def parse_chat(body: Any, limits: Limits) -> CompletionParams:
    """Validate a /v1/chat/completions body. Raises ApiError (400, 404 for another model) naming the field."""
    model = _parse_model(body, limits)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list", "messages")
    rendered = render_chat([_message_text(m, i) for i, m in enumerate(messages)])
    _refuse_unsupported(body, _CHAT_REFUSED)
    if body.get("logprobs") not in (None, False):
        raise _bad("'logprobs' is not supported by this server", "logprobs")
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise _bad('\'response_format\' supports only {"type": "text"}', "response_format")
    return _parse_common(
        body, limits, model, tuple(encode(rendered)), max_tokens_key="max_completion_tokens", operation=OPERATION_CHAT
    )


# --------------------------------------------------------------------------------------- responses


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _sse(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"


@dataclass(frozen=True)
class ResponseShape:
    """How the answers of one operation look: id prefix, object names, where the text goes."""

    operation: str
    id_prefix: str
    object_name: str  # the non-streamed answer's `object`
    chunk_object: str  # each streamed event's `object`

    def _choice(
        self, text: str, finish_reason: str | None, token_ids: list[int] | None, *, streamed: bool, first: bool = False
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.operation == OPERATION_COMPLETION:
            choice["text"] = text
        elif streamed:  # the role comes with the first delta; the last may carry no text at all
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text or first:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["message"] = {"role": "assistant", "content": text}
        choice["logprobs"] = None
        choice["finish_reason"] = finish_reason
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return choice

    def chunk_event(
        self,
        completion_id: str,
        created_s: int,
        model: str,
        text: str,
        finish_reason: str | None,
        token_ids: list[int] | None = None,
        *,
        first: bool = False,
    ) -> bytes:
        """One SSE event of a streamed answer (`first`: the chat delta also names the role)."""
        choice = self._choice(text, finish_reason, token_ids, streamed=True, first=first)
        return _sse(
            {
                "id": completion_id,
                "object": self.chunk_object,
                "created": created_s,
                "model": model,
                "choices": [choice],
            }
        )

    def usage_event(self, completion_id: str, created_s: int, model: str, usage_body: dict[str, Any]) -> bytes:
        return _sse(
            {
                "id": completion_id,
                "object": self.chunk_object,
                "created": created_s,
                "model": model,
                "choices": [],
                "usage": usage_body,
            }
        )

    def body(
        self,
        completion_id: str,
        created_s: int,
        model: str,
        text: str,
        finish_reason: str | None,
        usage_body: dict[str, Any],
        token_ids: list[int] | None = None,
    ) -> dict[str, Any]:
        """The non-streamed answer."""
        choice = self._choice(text, finish_reason, token_ids, streamed=False)
        return {
            "id": completion_id,
            "object": self.object_name,
            "created": created_s,
            "model": model,
            "choices": [choice],
            "usage": usage_body,
        }


# Keyed by operation; the object names are OpenAI's wire format (that one equals an operation name is OpenAI's).
SHAPES = {
    OPERATION_COMPLETION: ResponseShape(OPERATION_COMPLETION, "cmpl-", "text_completion", "text_completion"),
    OPERATION_CHAT: ResponseShape(OPERATION_CHAT, "chatcmpl-", "chat.completion", "chat.completion.chunk"),
}


def error_event(message: str, error_type: str, code: str | None = None) -> bytes:
    return b"data: " + json.dumps(error_body(message, error_type, None, code)).encode() + b"\n\n"


DONE_EVENT = b"data: [DONE]\n\n"


def model_card(model: str, created_s: int) -> dict[str, Any]:
    """One entry of GET /v1/models (and the answer of GET /v1/models/{id})."""
    return {"id": model, "object": "model", "created": created_s, "owned_by": OWNED_BY}


def model_list(model: str, created_s: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(model, created_s)]}


def now_s() -> int:
    return int(time.time())
