"""Process lifecycle of `splitscope serve`: clean stops, no orphans, a dying worker fails only its request."""

from __future__ import annotations

import http.client
import json
import os
import signal

from reference_server.serving.router import Endpoint, sticky
from tests.reference_server.server_harness import (
    Server,
    pid_alive,
    reference_tokens,
    sse_events,
    streamed_token_ids,
    wait_for,
)


def test_colocated_streams_correct_tokens_and_sigterm_stops_every_child(tmp_path):
    server = Server(tmp_path, "--mode", "colocated", "--workers", "1")
    try:
        pids = server.worker_pids
        assert len(pids) == 1 and all(pid_alive(pid) for pid in pids)
        for prompt in ("Colocated mode: the whole prefill joins the step.", "ok"):
            status, body, _ = server.complete(
                {"prompt": prompt, "max_tokens": 12, "stream": True, "ignore_eos": True, "return_token_ids": True}
            )
            assert status == 200
            assert streamed_token_ids(sse_events(body)) == reference_tokens(prompt, 12)
        assert server.stop(signal.SIGTERM) == 0
        wait_for(lambda: not any(pid_alive(pid) for pid in pids), 15, "every worker to exit")
        # The workers flushed their spans on the way out.
        names = {x.name for x in server.spans()}
        assert {"text_completion tiny", "splitscope.prefill", "splitscope.decode", "splitscope.step"} <= names
    finally:
        server.close()


def _open_stream(server: Server, body: dict) -> http.client.HTTPResponse:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    connection.request(
        "POST", "/v1/completions", json.dumps({"model": "tiny", **body}), {"Content-Type": "application/json"}
    )
    return connection.getresponse()


def test_a_dying_worker_fails_its_request_only_and_a_killed_launcher_takes_its_workers_along(tmp_path):
    server = Server(tmp_path, "--mode", "colocated", "--workers", "2")
    try:
        workers = {w["name"]: w["pid"] for w in server.health()["workers"]}
        endpoints = [Endpoint(name, "colocated", "") for name in sorted(workers)]
        user = next(f"u{i}" for i in range(1000) if sticky(endpoints, f"u{i}").name == "colocated-1")

        response = _open_stream(
            server, {"prompt": "doomed", "max_tokens": 1000, "stream": True, "ignore_eos": True, "user": user}
        )
        assert response.status == 200
        first = response.readline()
        assert first.startswith(b"data: {")  # the first token arrived: the request is decoding on colocated-1
        os.kill(workers["colocated-1"], signal.SIGKILL)
        events = sse_events(response.read())  # the router ends the stream after an error event
        assert events and "error" in events[-1], events[-3:]
        assert "[DONE]" not in events
        assert events[-1]["error"]["type"] == "server_error"

        def colocated_1_down():
            health = server.health()
            return health if not next(w for w in health["workers"] if w["name"] == "colocated-1")["alive"] else None

        health = wait_for(colocated_1_down, 15, "the router to drop the dead worker")
        assert health["status"] == "ok"  # the pool still has a live worker
        status, body, _ = server.complete({"prompt": "still serving", "max_tokens": 4, "user": user})
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 4

        server.stop(signal.SIGKILL)  # no cleanup runs in the launcher: the kernel tells the workers
        wait_for(lambda: not pid_alive(workers["colocated-0"]), 15, "the orphaned worker to exit")
    finally:
        server.close()


def test_a_refused_kv_transfer_is_a_retryable_503_and_frees_blocks_on_both_sides(tmp_path):
    # 48 blocks of 16 tokens on each worker: one long-running request leaves the decode worker too little
    # room; --kv-wait-s 0 refuses at once instead of waiting for room.
    server = Server(tmp_path, "--mode", "disaggregated", "--kv-blocks", "48", "--kv-wait-s", "0")
    try:
        hog = _open_stream(
            server,
            {"prompt": "a" * 300, "max_tokens": 400, "stream": True, "ignore_eos": True, "return_token_ids": True},
        )
        first_event = hog.readline()
        assert hog.status == 200 and first_event.startswith(b"data: {")  # decoding, holding 44 of 48 blocks

        status, raw, headers = server.complete({"prompt": "b" * 300, "max_tokens": 4})
        assert status == 503 and int(headers["Retry-After"]) >= 1
        error = json.loads(raw)["error"]
        assert error["type"] == "server_overloaded" and "refused" in error["message"]

        events = sse_events(first_event + hog.read())  # the other request was never disturbed
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert len(streamed_token_ids(events)) == 400

        # Both sides got their blocks back: the same request now fits.
        status, raw, _ = server.complete({"prompt": "b" * 300, "max_tokens": 4})
        assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 4

        def failed_transfer():
            return next((x for x in server.spans() if x.name == "splitscope.kv_transfer" and x.status_code == 2), None)

        span = wait_for(failed_transfer, 15, "the failed kv_transfer span")
        assert span.attributes["error.type"] == "refused" and span.attributes["splitscope.kv.dst"] == "decode-0"
    finally:
        server.close()


def test_a_kv_transfer_short_of_room_waits_for_it_and_completes(tmp_path):
    # The same squeeze with the default wait: the second request's transfer waits until the hog's blocks
    # come back, then completes (the hog's 400 steps take well under the 60 s wait given here).
    server = Server(tmp_path, "--mode", "disaggregated", "--kv-blocks", "48", "--kv-wait-s", "60")
    try:
        hog = _open_stream(server, {"prompt": "a" * 300, "max_tokens": 400, "stream": True, "ignore_eos": True})
        assert hog.status == 200 and hog.readline().startswith(b"data: {")
        status, raw, _ = server.complete({"prompt": "b" * 300, "max_tokens": 4, "ignore_eos": True})
        assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 4
        assert sse_events(hog.read())[-1] == "[DONE]"
        assert not any(x.name == "splitscope.kv_transfer" and x.status_code == 2 for x in server.spans())
    finally:
        server.close()
