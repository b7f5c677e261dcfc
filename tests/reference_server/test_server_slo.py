"""A real server started with latency objectives marks each root span with the request's outcome."""

from __future__ import annotations

import secrets

import pytest

from tests.reference_server.server_harness import Server, sse_events, wait_for
from tracer import spans as s
from tracer.vocabulary import SloObjective

SLO_TTFT_S = 60.0  # no request of the tiny model on this box comes near it
SLO_ITL_S = 1e-6  # every request with two tokens or more misses it


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = Server(tmp_path_factory.mktemp("slo"), "--slo-ttft", str(SLO_TTFT_S), "--slo-itl", str(SLO_ITL_S))
    yield server
    server.close()


def _root(server: Server, trace_id: str):
    def find():
        return next((x for x in server.spans() if x.trace_id == trace_id and x.kind == s.KIND_SERVER), None)

    return wait_for(find, 15, "the root span")


@pytest.mark.parametrize("stream", [True, False])
def test_the_router_marks_a_request_that_missed_an_objective_and_one_that_met_both(server, stream):
    missing, meeting = secrets.token_hex(16), secrets.token_hex(16)
    for trace_id, max_tokens in ((missing, 6), (meeting, 1)):
        status, _, _ = server.complete(
            {"prompt": "hello there", "max_tokens": max_tokens, "stream": stream, "ignore_eos": True},
            headers={"traceparent": f"00-{trace_id}-{'1' * 16}-01"},
        )
        assert status == 200
    late = _root(server, missing).attributes
    # The outcome agrees with the span's own measurements, read against the flags.
    assert late[s.ATTR_ITL_P99_S] > SLO_ITL_S and late[s.ATTR_TTFT_S] < SLO_TTFT_S
    assert late[s.ATTR_SLO_VIOLATED] is True and late[s.ATTR_SLO_MISSED] == SloObjective.ITL
    on_time = _root(server, meeting).attributes
    assert on_time[s.ATTR_SLO_VIOLATED] is False and s.ATTR_SLO_MISSED not in on_time
    assert on_time[s.ATTR_OUTPUT_TOKENS] == 1


def test_the_root_span_counts_the_tokens_the_client_got_in_one_event_with_the_one_before(server):
    # A byte-level tokenizer's text: a sampled lead byte of a multi-byte character is held back until the
    # next byte, so the client gets both in one event. The client counts them from the token ids each event
    # carries; the root span must say the same number.
    trace_id = secrets.token_hex(16)
    status, body, _ = server.complete(
        {
            "prompt": "hello there",
            "max_tokens": 64,
            "stream": True,
            "ignore_eos": True,
            "temperature": 1.0,
            "seed": 7,
            "return_token_ids": True,
        },
        headers={"traceparent": f"00-{trace_id}-{'1' * 16}-01"},
    )
    assert status == 200
    per_event = [len(ids) for ids in _token_ids_per_event(sse_events(body)) if ids]
    assert sum(per_event) == 64
    joined_by_client = sum(count - 1 for count in per_event)
    assert joined_by_client > 0, "no held text in 64 sampled bytes: the test proves nothing"
    root = _root(server, trace_id).attributes
    assert root[s.ATTR_ITL_JOINED_TOKENS] == joined_by_client


def _token_ids_per_event(events: list) -> list[list[int]]:
    return [e["choices"][0].get("token_ids") or [] for e in events if isinstance(e, dict) and e.get("choices")]
