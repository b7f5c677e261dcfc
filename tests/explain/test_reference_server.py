"""The acceptance point of `splitscope explain`: a real colocated reference server, short requests
decoding, one long prompt injected while they do; explain names that prompt as the cause of the short
request's stall, the stall lies inside its decode span, the decode span's stall links (built by the
worker's pipeline and shipped over the sidecar wire to the exporter that writes the traces file) point
at that prompt's prefill span, and its TTFT parts add up to its TTFT.

Starts a server (slow by path, tests/conftest.py) and times nothing of this machine's: the stall is
whatever the long prefill took here, so the test runs beside other work.
"""

from __future__ import annotations

import json
import secrets
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from click.testing import CliRunner

from tests.reference_server.server_harness import Server, http
from tracer import spans as s
from tracer.cli.main import main
from tracer.otlp import iter_spans

MODEL = "small"  # the preset names the served model
SHORT_REQUESTS = 3
SHORT_OUTPUT_TOKENS = 96  # long enough to be decoding when the long prompt arrives
LONG_PROMPT_TOKENS = 1600  # the byte tokenizer: one token per character


def _traceparent(trace_id: str) -> dict[str, str]:
    return {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}


def _open_stream(server: Server, trace_id: str):  # type: ignore[no-untyped-def]
    """Start a streamed completion and return the open response once its first token has arrived."""
    body = {"model": MODEL, "prompt": "Say something long. ", "max_tokens": SHORT_OUTPUT_TOKENS}
    body |= {"stream": True, "ignore_eos": True}
    request = urllib.request.Request(
        server.url + "/v1/completions",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", **_traceparent(trace_id)},
    )
    response = urllib.request.urlopen(request, timeout=120)
    for line in response:  # blocks on the server, not on a guess: the first token's event
        if line.startswith(b"data: {"):
            return response
    raise AssertionError("the stream ended before its first token")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    server = Server(
        tmp_path_factory.mktemp("explain"),
        "--preset",
        "small",
        "--mode",
        "colocated",
        "--workers",
        "1",
        "--max-batch",
        "8",
        "--step-sample",
        "1",
        # Every process ships its spans to the exporter (a sidecar) over the Unix-socket wire, which
        # writes the traces file: the stall links cross that wire and its JSON encoder on the way.
        "--exporter-port",
        "0",
    )
    try:
        short_ids = [secrets.token_hex(16) for _ in range(SHORT_REQUESTS)]
        long_id = secrets.token_hex(16)
        with ThreadPoolExecutor(SHORT_REQUESTS) as pool:
            streams = list(pool.map(lambda trace_id: _open_stream(server, trace_id), short_ids))
        # Every short request is decoding now; the long prompt's prefill runs in their steps.
        status, _, _ = http(
            "POST",
            server.url + "/v1/completions",
            {"model": MODEL, "prompt": "x" * LONG_PROMPT_TOKENS, "max_tokens": 2},
            headers=_traceparent(long_id),
            timeout_s=120,
        )
        assert status == 200
        for stream in streams:
            rest = stream.read()
            stream.close()
            assert rest.rstrip().endswith(b"data: [DONE]")
        assert server.stop() == 0  # the launcher flushes every worker's spans before it exits
        yield server, short_ids, long_id
    finally:
        server.close()


def _explain(traces_file, trace_id: str) -> dict:
    result = CliRunner().invoke(main, ["explain", str(traces_file), "--trace-id", trace_id, "--format", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_the_long_prompt_is_named_as_the_cause_of_a_short_requests_stall(run):
    server, short_ids, long_id = run
    spans = list(iter_spans([server.traces_file]))
    long_prefill = next(x for x in spans if x.trace_id == long_id and x.name == s.SPAN_PREFILL)
    # Only the short requests whose decode spanned the long prefill can have been stalled by it.
    overlapped = [
        trace_id
        for trace_id in short_ids
        for d in spans
        if d.trace_id == trace_id
        and d.name == s.SPAN_DECODE
        and d.start_ns < long_prefill.start_ns
        and d.end_ns > long_prefill.end_ns
    ]
    assert overlapped, "no short request was decoding across the long prefill"
    for trace_id in overlapped:
        decode = next(x for x in spans if x.trace_id == trace_id and x.name == s.SPAN_DECODE)
        (request,) = _explain(server.traces_file, trace_id)["requests"]
        assert request["trace_id"] == trace_id
        named = [
            stall
            for stall in request["stalls"]
            if any(c["kind"] == "prefill" and c["trace_id"] == long_id for c in stall["causes"])
        ]
        assert named, request["stalls"]
        for stall in named:
            assert decode.start_ns <= stall["start_unix_ns"] < stall["end_unix_ns"] <= decode.end_ns
            assert not stall["estimated"]  # measured token times, not an estimate
            (cause,) = [c for c in stall["causes"] if c["trace_id"] == long_id]
            assert cause["prefill_tokens"] == long_prefill.attributes[s.ATTR_PREFILL_TOKENS]
            # The long prefill is most of the gap: the decode step beside it is short on this model.
            assert cause["share"] > 0.5, stall
        # At the source: the worker's pipeline linked the decode span to the long prompt's prefill span
        # (from its step records), and those links name every prefill explain computed by overlap.
        assert request["stall_links"][0]["trace_id"] == long_id, request["stall_links"]
        assert request["stall_links"][0]["span_id"] == long_prefill.span_id
        assert len(decode.links) <= 32
        linked = {link["trace_id"] for link in request["stall_links"]}
        computed = {c["trace_id"] for stall in request["stalls"] for c in stall["causes"] if c["kind"] == "prefill"}
        assert computed <= linked, (computed, linked)
        stalled_ns = decode.attributes[s.ATTR_DECODE_STALLED_NS]
        assert 0 < sum(link["stalled_s"] for link in request["stall_links"]) * 1e9 <= stalled_ns + 1


def test_ttft_parts_add_up_to_the_ttft(run):
    server, short_ids, long_id = run
    for trace_id in [*short_ids, long_id]:
        (request,) = _explain(server.traces_file, trace_id)["requests"]
        parts = request["ttft_parts_s"]
        assert request["ttft_s"] > 0
        assert abs(sum(parts.values()) - request["ttft_s"]) <= 0.05 * request["ttft_s"]
        # The stage spans explain the TTFT: what no span covers is a small part of it.
        assert parts["prefill"] > 0 and parts["queue"] >= 0
        assert abs(parts["unexplained"]) <= 0.5 * request["ttft_s"], parts
