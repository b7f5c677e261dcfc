"""A decode worker killed while a KV transfer into it is under way (architecture.md §9: a worker that dies
mid-request fails that request cleanly, frees its KV blocks, and leaves the rest serving).

The race is made deterministic with signals: the prefill worker is stopped while the router sets the
request up, then the decode worker is stopped and the prefill worker resumed, so the transfer starts and
hangs on a receiver that reads nothing; /proc/net/tcp shows its bytes waiting unread in the decode
worker's socket. Only then is the decode worker SIGKILLed.
"""

from __future__ import annotations

import http.client
import inspect
import json
import os
import signal
import threading
import time

from reference_server.kv_transfer import KVSender
from tests.conftest import wait_for
from tests.faults.fault_harness import metric_value, unread_bytes_sent_by
from tests.reference_server.server_harness import Server, sse_events, streamed_token_ids

# The sender gives up on a silent receiver after its socket timeout: the request's error must come by then.
KV_IO_TIMEOUT_S = inspect.signature(KVSender).parameters["io_timeout_s"].default
ERROR_MARGIN_S = 10.0  # the router, the event loops and a loaded 2-core machine
BYSTANDER_TOKENS = 900


def _stream(server: Server, body: dict) -> http.client.HTTPResponse:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    connection.request(
        "POST", "/v1/completions", json.dumps({"model": "tiny", **body}), {"Content-Type": "application/json"}
    )
    return connection.getresponse()


def test_killing_a_decode_worker_mid_transfer_fails_only_that_request_and_frees_prefill_blocks(tmp_path):
    server = Server(tmp_path, "--mode", "disaggregated", "--prefill-workers", "1", "--decode-workers", "2")
    stopped: list[int] = []
    try:
        pids = {w["name"]: w["pid"] for w in server.health()["workers"]}

        # A bystander decoding on decode-0 the whole time (the router picks the least loaded decode worker).
        bystander = _stream(
            server,
            {
                "prompt": "bystander",
                "max_tokens": BYSTANDER_TOKENS,
                "stream": True,
                "ignore_eos": True,
                "return_token_ids": True,
            },
        )
        bystander_first_event = bystander.readline()
        assert bystander.status == 200 and bystander_first_event.startswith(b"data: {")

        # The doomed request: decode-1 accepts its stream and waits for KV; the prefill worker is held.
        os.kill(pids["prefill-0"], signal.SIGSTOP)
        stopped.append(pids["prefill-0"])
        answer: dict = {}

        def doomed() -> None:
            answer["reply"] = server.complete({"prompt": "doomed " * 100, "max_tokens": 8}, timeout_s=120.0)
            answer["at"] = time.monotonic()

        client = threading.Thread(target=doomed, daemon=True)
        client.start()
        wait_for(
            lambda: metric_value(server, "splitscope_requests_waiting", worker="decode-1") == 1,
            30,
            "decode-1 to expect the request's KV",
        )

        os.kill(pids["decode-1"], signal.SIGSTOP)
        stopped.append(pids["decode-1"])
        os.kill(pids["prefill-0"], signal.SIGCONT)
        stopped.remove(pids["prefill-0"])
        wait_for(
            lambda: unread_bytes_sent_by(pids["prefill-0"], pids["decode-1"]) > 0,
            30,
            "the KV transfer's first bytes to wait in the stopped decode worker's socket",
        )
        assert metric_value(server, "splitscope_kv_cache_usage_ratio", worker="prefill-0") > 0  # held by the transfer

        killed_at = time.monotonic()
        os.kill(pids["decode-1"], signal.SIGKILL)
        stopped.remove(pids["decode-1"])
        client.join(KV_IO_TIMEOUT_S + ERROR_MARGIN_S)
        assert "reply" in answer, f"no answer within {KV_IO_TIMEOUT_S + ERROR_MARGIN_S:g} s of the kill"
        status, body, _ = answer["reply"]
        error = json.loads(body)["error"]
        assert status == 500 and error["type"] == "server_error", body
        assert error["code"] in ("kv_transfer", "worker_failed"), error
        assert answer["at"] - killed_at < KV_IO_TIMEOUT_S, f"error came {answer['at'] - killed_at:.1f} s after the kill"

        # The prefill side got its blocks back.
        wait_for(
            lambda: metric_value(server, "splitscope_kv_cache_usage_ratio", worker="prefill-0") == 0,
            30,
            "prefill-0's KV cache to be empty again",
        )

        # The bystander never noticed.
        events = sse_events(bystander_first_event + bystander.read())
        assert events[-1] == "[DONE]"
        # Count tokens, not events: an event may carry several (the bytes of one character).
        assert len(streamed_token_ids(events)) == BYSTANDER_TOKENS

        # The router dropped decode-1, and the next request is served by the survivors.
        def decode_1_down() -> bool:
            return not next(w for w in server.health()["workers"] if w["name"] == "decode-1")["alive"]

        wait_for(decode_1_down, 30, "the router to drop decode-1")
        status, body, _ = server.complete({"prompt": "after the fault", "max_tokens": 6, "ignore_eos": True})
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 6

        # The trace marks the failed transfer, under the failed request's root span.
        def failed_transfer():
            spans = server.spans()
            transfer = next((x for x in spans if x.name == "splitscope.kv_transfer" and x.status_code == 2), None)
            root = next((x for x in spans if x.name == "text_completion tiny" and x.status_code == 2), None)
            return (transfer, root) if transfer and root else None

        transfer, root = wait_for(failed_transfer, 30, "the failed kv_transfer span and its request's root span")
        assert transfer.attributes["error.type"] == "connection"
        assert (
            transfer.attributes["splitscope.kv.dst"] == "decode-1"
            and transfer.attributes["splitscope.worker"] == "prefill-0"
        )
        assert transfer.trace_id == root.trace_id
        assert root.attributes["error.type"] in ("kv_transfer", "worker_failed")
    finally:
        for pid in stopped:  # never leave a stopped process behind a failed assertion
            os.kill(pid, signal.SIGCONT)
        server.close()
