"""Property-based fuzzing of the router's /v1/completions over real HTTP: malformed bodies get 400 with an
OpenAI-style error naming the problem (404 for a model not served, as OpenAI answers), oversized ones 413,
and the rare valid one 200; never a 5xx."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.reference_server.server_harness import Server, http
from tests.tracer.test_traces_fuzz import json_values

FUZZ_CASES = 150
FIELDS = [
    "model",
    "prompt",
    "max_tokens",
    "temperature",
    "stream",
    "stream_options",
    "user",
    "seed",
    "n",
    "echo",
    "logprobs",
    "stop",
    "ignore_eos",
    "min_tokens",
    "return_token_ids",
]
plausible = {
    "model": st.just("tiny") | json_values,
    "prompt": st.text(max_size=8) | st.lists(st.integers(-5, 300), max_size=4) | json_values,
    "max_tokens": st.integers(-2, 4) | json_values,
    "stream": st.booleans() | json_values,
}
bodies = st.one_of(
    st.binary(max_size=200),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({}, optional={f: plausible.get(f, json_values) for f in FIELDS}).map(
        lambda d: json.dumps(d).encode()
    ),
)


def test_router_answers_fuzzed_completions_with_400_or_200(server: Server) -> None:
    """150 fuzzed bodies (FUZZ_CASES) over real HTTP; the router serves a valid request afterwards."""
    statuses: list[int] = []

    @settings(max_examples=FUZZ_CASES, deadline=None, database=None)
    @given(body=bodies)
    def case(body: bytes) -> None:
        status, answer, _ = http("POST", server.url + "/v1/completions", raw=body, timeout_s=60)
        assert status in (200, 400, 404), (status, answer[:300])
        if status in (400, 404):
            error = json.loads(answer)["error"]
            assert error["message"] and error["type"] == "invalid_request_error", error
            assert status == 400 or error["code"] == "model_not_found", error  # 404: a model not served
        statuses.append(status)

    case()
    assert len(statuses) >= FUZZ_CASES and 400 in statuses
    status, _, _ = server.complete({"prompt": "after the fuzz", "max_tokens": 2})
    assert status == 200
