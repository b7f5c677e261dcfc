"""A real disaggregated server stays healthy when clients misbehave: mid-stream disconnects, and more
concurrent requests than its KV cache holds.

What the server holds is read from its own merged /metrics (each worker's gauges, the router's counter),
parsed with prometheus_client's parser.
"""

from __future__ import annotations

import json
import socket
from concurrent.futures import ThreadPoolExecutor
from http.client import HTTPConnection, HTTPResponse

from prometheus_client.parser import text_string_to_metric_families

from tests.reference_server.server_harness import Server, http, sse_events, streamed_token_ids, wait_for
from tracer.metrics import ABORT_CLIENT_DISCONNECTED, REQUESTS_ABORTED

DISCONNECTING_CLIENTS = 24
EARLY_LEAVERS = 12


def _samples(server: Server) -> dict[tuple[str, tuple], float]:
    status, body, _ = http("GET", server.url + "/metrics")
    assert status == 200
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }


def _worker_value(samples: dict, name: str, pool: str) -> float:
    return sum(v for (n, labels), v in samples.items() if n == name and ("pool", pool) in labels)


def _aborted(samples: dict) -> float:
    return samples.get((REQUESTS_ABORTED + "_total", (("reason", ABORT_CLIENT_DISCONNECTED),)), 0.0)


def _open_stream(server: Server, body: dict) -> tuple[HTTPConnection, HTTPResponse]:
    connection = HTTPConnection("127.0.0.1", server.port, timeout=120)
    connection.request(
        "POST", "/v1/completions", json.dumps({"model": "tiny", **body}), {"Content-Type": "application/json"}
    )
    return connection, connection.getresponse()


def test_clients_that_disconnect_mid_stream_are_aborted_everywhere_and_counted(tmp_path):
    # Room for every client's KV (57 blocks each): 16 decode, the rest wait in the decode queue with theirs.
    server = Server(tmp_path, "--mode", "disaggregated", "--kv-blocks", str(57 * DISCONNECTING_CLIENTS))
    try:
        assert _aborted(_samples(server)) == 0

        def start_and_read_first_event(i: int):
            body = {"prompt": f"client {i} " * 20, "max_tokens": 700, "stream": True, "ignore_eos": True}
            connection, response = _open_stream(server, body)
            assert response.status == 200 and response.readline().startswith(b"data: {")
            return connection

        with ThreadPoolExecutor(DISCONNECTING_CLIENTS) as pool:
            connections = list(pool.map(start_and_read_first_event, range(DISCONNECTING_CLIENTS)))
        # Every client is mid-stream (700 tokens each, far from done): all of them hang up now.
        for connection in connections:
            connection.sock.close()
            connection.close()

        def all_released(aborts: int):
            samples = _samples(server)
            held = {
                pool: (
                    _worker_value(samples, "splitscope_requests_running", pool),
                    _worker_value(samples, "splitscope_requests_waiting", pool),
                    _worker_value(samples, "splitscope_kv_cache_usage_ratio", pool),
                )
                for pool in ("prefill", "decode")
            }
            done = _aborted(samples) == aborts and all(v == (0, 0, 0) for v in held.values())
            return done or None

        wait_for(
            lambda: all_released(DISCONNECTING_CLIENTS),
            20,
            f"{DISCONNECTING_CLIENTS} aborts counted and no request or KV block left on any worker",
        )
        assert server.health()["inflight"] == 0

        # Clients that leave before their first token: their requests are queued for prefill, prefilling,
        # or moving their KV to the decode worker when the connections close.
        early = []
        for i in range(EARLY_LEAVERS):
            sock = socket.create_connection(("127.0.0.1", server.port))
            body = json.dumps(
                {
                    "model": "tiny",
                    "prompt": f"{i:02d} long prompt " * 40,
                    "max_tokens": 200,
                    "stream": True,
                    "ignore_eos": True,
                }
            ).encode()
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            early.append(sock)
        wait_for(lambda: server.health()["inflight"] == EARLY_LEAVERS, 20, "every early request inside the router")
        for sock in early:
            sock.close()
        total = DISCONNECTING_CLIENTS + EARLY_LEAVERS
        wait_for(lambda: all_released(total), 20, f"{total} aborts counted and nothing left on any worker")

        # A new request is served at once: no 503 while the workers shed the aborted ones.
        status, body, _ = server.complete(
            {"prompt": "after the storm", "max_tokens": 8, "stream": True, "ignore_eos": True, "return_token_ids": True}
        )
        assert status == 200 and len(streamed_token_ids(sse_events(body))) == 8
        samples = _samples(server)
        assert _aborted(samples) == total  # a finished request is not an abort
        # A transfer cut because its client left is not a KV transfer failure.
        assert sum(v for (name, _), v in samples.items() if name == "splitscope_kv_transfer_failures_total") == 0

        log = server.log_file.read_text(errors="replace")
        assert "Traceback" not in log and "Cannot write to closing transport" not in log
    finally:
        server.close()


def test_kv_exhaustion_answers_503_with_retry_after_never_500(tmp_path):
    # 40 blocks of 16 tokens: a request below needs 17 on the decode worker, so two fit at a time; the
    # short wait for room makes most of a 64-request burst refuse rather than queue.
    server = Server(tmp_path, "--mode", "disaggregated", "--kv-blocks", "40", "--kv-wait-s", "0.2")
    try:

        def one(i: int) -> tuple[int, dict, dict]:
            body = {
                "prompt": f"burst {i:03d} " * 20,
                "max_tokens": 60,
                "ignore_eos": True,
                "stream": i % 2 == 0,
                "return_token_ids": True,
            }
            status, raw, headers = server.complete(body, timeout_s=120)
            if status == 200 and body["stream"]:
                events = sse_events(raw)
                return status, {"tokens": len(streamed_token_ids(events)), "done": events[-1] == "[DONE]"}, headers
            if status == 200:
                return status, {"tokens": len(json.loads(raw)["choices"][0]["token_ids"]), "done": True}, headers
            return status, json.loads(raw), headers

        with ThreadPoolExecutor(64) as pool:
            results = list(pool.map(one, range(64)))

        statuses = [status for status, _, _ in results]
        assert set(statuses) <= {200, 503}, statuses
        assert statuses.count(503) > 0 and statuses.count(200) > 0, statuses  # the burst did exhaust the cache
        for status, body, headers in results:
            if status == 503:
                assert int(headers["Retry-After"]) >= 1
                assert body["error"]["type"] == "server_overloaded" and body["error"]["message"]
            else:
                assert body == {"tokens": 60, "done": True}

        def released():
            samples = _samples(server)
            return _worker_value(samples, "splitscope_kv_cache_usage_ratio", "decode") == 0 or None

        wait_for(released, 20, "the decode worker's KV blocks back")
        status, raw, _ = server.complete({"prompt": "after the burst", "max_tokens": 4, "ignore_eos": True})
        assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 4
        assert "Traceback" not in server.log_file.read_text(errors="replace")
    finally:
        server.close()


def test_requests_beyond_kv_capacity_wait_for_room_within_the_bound_and_complete(tmp_path):
    # The same cache (two requests' worth) with a long wait for room: a burst of eight queues -- arrived
    # prompts wait, holding their KV, until they can grow to their whole length -- and every one completes.
    server = Server(tmp_path, "--mode", "disaggregated", "--kv-blocks", "40", "--kv-wait-s", "60")
    try:

        def one(i: int) -> tuple[int, bytes]:
            # A one-block prompt always finds room to arrive; growing to 17 blocks for 250 tokens does not.
            status, raw, _ = server.complete(
                {"prompt": f"patient {i:02d} ", "max_tokens": 250, "ignore_eos": True}, timeout_s=120
            )
            return status, raw

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(one, range(8)))
        assert [status for status, _ in results] == [200] * 8, results
        assert all(json.loads(raw)["usage"]["completion_tokens"] == 250 for _, raw in results)
        samples = _samples(server)
        assert sum(v for (name, _), v in samples.items() if name == "splitscope_kv_transfer_failures_total") == 0
    finally:
        server.close()
