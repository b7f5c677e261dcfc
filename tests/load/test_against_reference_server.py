"""`splitscope load` against the real reference server: replay honoured, statistics recomputable from the
records, and the client's time to first token agreeing with the server's root span."""

from __future__ import annotations

import json

import numpy as np
import pytest

from reference_server.launch.process import ServerProcess
from tests.reference_server.server_harness import wait_for
from tracer.load import ClientSLO, LoadConfig, run_load_sync
from tracer.load.stats import meets_slo
from tracer.otlp import iter_spans

# Client TTFT runs from the client's send to the first SSE chunk it parses; the server's from the router
# receiving the request to handing the first chunk to aiohttp. The difference is loopback HTTP plus two
# event loops on a shared 2-core machine: allow 30 ms plus 10%.
TTFT_TOLERANCE_ABS_S = 0.030
TTFT_TOLERANCE_REL = 0.10
ARRIVAL_TOLERANCE_S = 0.050  # the router sees a request this soon after its scheduled arrival

REPLAY = [
    {"arrival_s": 0.0, "prompt_tokens": 40, "output_tokens": 6, "session": "alice"},
    {"arrival_s": 0.15, "prompt_tokens": 200, "output_tokens": 12},
    {"arrival_s": 0.3, "prompt_tokens": 40, "output_tokens": 6, "session": "alice"},
    {"arrival_s": 0.6, "prompt_tokens": 120, "output_tokens": 20, "session": "bob"},
    {"arrival_s": 0.61, "prompt_tokens": 300, "output_tokens": 8},
    {"arrival_s": 1.0, "prompt_tokens": 64, "output_tokens": 16},
    {"arrival_s": 1.4, "prompt_tokens": 500, "output_tokens": 10, "session": "bob"},
    {"arrival_s": 1.8, "prompt_tokens": 32, "output_tokens": 24},
]


@pytest.fixture(scope="module")
def server_and_traces(tmp_path_factory):
    traces = tmp_path_factory.mktemp("load-ref") / "traces.jsonl"
    with ServerProcess(
        ["--preset", "tiny", "--mode", "colocated", "--workers", "1", "--traces-file", str(traces)]
    ) as server:
        yield server, traces


def test_replay_against_the_reference_server(server_and_traces, tmp_path):
    server, traces = server_and_traces
    replay = tmp_path / "replay.jsonl"
    replay.write_text("\n".join(json.dumps(line) for line in REPLAY) + "\n")
    slo = ClientSLO(ttft_s=0.5, itl_s=0.2)
    result = run_load_sync(
        LoadConfig(url=server.url, model="tiny", replay_path=str(replay), slo=slo, seed=1, shared_prefix_tokens=32)
    )

    records = result.records
    assert [r.status for r in records] == ["ok"] * len(REPLAY)
    assert [r.scheduled_s for r in records] == [line["arrival_s"] for line in REPLAY]
    assert [r.usage_prompt_tokens for r in records] == [line["prompt_tokens"] for line in REPLAY]
    assert [r.output_tokens for r in records] == [line["output_tokens"] for line in REPLAY]

    summary = result.summary
    assert summary.ok == len(REPLAY) and summary.errors == 0
    ttfts = [r.ttft_s for r in records]
    assert summary.latency["ttft_s"].p50 == pytest.approx(float(np.percentile(ttfts, 50)))
    assert summary.latency["ttft_s"].p99 == pytest.approx(float(np.percentile(ttfts, 99)))
    gaps = [g for r in records for g in r.itl_s]
    assert summary.latency["itl_s"].p90 == pytest.approx(float(np.percentile(gaps, 90)))
    met = sum(meets_slo(r, slo) for r in records)
    assert summary.slo_met == met
    assert summary.goodput_rps == pytest.approx(met / summary.wall_s)

    # The server's view of the same requests, joined by the trace id the client propagated.
    def roots():
        spans = [s for s in iter_spans([traces], skip_bad=True) if s.name == "text_completion tiny"]
        mine = {s.trace_id: s for s in spans if s.trace_id in {r.trace_id for r in records}}
        return mine if len(mine) == len(records) else None

    by_trace = wait_for(roots, 30.0, "the router's root spans of every request")
    for record in records:
        root = by_trace[record.trace_id]
        server_ttft = root.attributes["splitscope.ttft_s"]
        allowed = TTFT_TOLERANCE_ABS_S + TTFT_TOLERANCE_REL * server_ttft
        assert abs(record.ttft_s - server_ttft) <= allowed, (
            f"request {record.index}: client TTFT {record.ttft_s * 1e3:.1f} ms vs server {server_ttft * 1e3:.1f} ms"
        )
        arrived_s = root.start_ns / 1e9 - result.started_unix_s
        assert arrived_s - record.scheduled_s == pytest.approx(0, abs=ARRIVAL_TOLERANCE_S), record.index
        assert root.attributes["gen_ai.usage.input_tokens"] == record.usage_prompt_tokens
    # A session's requests share a prompt prefix: alice's second request hits the prefix cache.
    prefills = {s.trace_id: s for s in iter_spans([traces], skip_bad=True) if s.name == "splitscope.prefill"}
    assert prefills[records[2].trace_id].attributes["splitscope.prefill.cached_tokens"] > 0
    assert prefills[records[1].trace_id].attributes["splitscope.prefill.cached_tokens"] == 0
