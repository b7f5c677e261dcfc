"""A real server started with latency objectives marks each root span with the request's outcome."""

from __future__ import annotations

import secrets

import pytest

from tests.reference_server.server_harness import Server, wait_for
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
