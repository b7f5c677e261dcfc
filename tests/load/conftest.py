"""A small real OpenAI-compatible streaming server for the load generator's tests.

It runs on its own event loop in a thread, on a real socket. Per request it picks a behaviour from the
OpenAI `user` field (the load generator's session), so a replay file scripts faults request by request:

  (none)/other  stream `max_tokens` chunks: the first `ttft_s` after receipt, then one every `itl_s`,
                a usage event, then `data: [DONE]`
  "slow"        as the default, but the first chunk comes `slow_ttft_s` after receipt
  "http500"     answer 500           "http400"   answer 400
  "close"       two chunks, then the connection is cut (no [DONE])
  "stall"       one chunk, then nothing until the server stops (the client's timeout fires)
  "badjson"     one chunk, then an event that is not JSON
  "error"       one chunk, then an OpenAI-style error event
  "hugeline"    one chunk, then a 1 MiB event line (beyond what a client should buffer)
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from aiohttp import web


@dataclass(frozen=True)
class Received:
    unix_s: float  # time.time() when the server read the request
    headers: dict[str, str]
    body: dict


class FakeCompletionsServer:
    def __init__(self, port: int, *, ttft_s: float = 0.02, itl_s: float = 0.01, slow_ttft_s: float = 0.2) -> None:
        self.port = port
        self.ttft_s = ttft_s
        self.slow_ttft_s = slow_ttft_s
        self.itl_s = itl_s
        self.received: list[Received] = []  # appended on the server loop; read after a run has finished
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._serve(),), daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(timeout=10):
            raise RuntimeError("fake completions server did not start")

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)
        assert not self._thread.is_alive(), "fake completions server did not stop"

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        received_s = time.monotonic()
        body = await request.json()
        self.received.append(Received(time.time(), dict(request.headers), body))
        behaviour = body.get("user")
        if behaviour == "http500":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        if behaviour == "http400":
            return web.json_response({"error": {"message": "bad request"}}, status=400)

        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        n_tokens = int(body["max_tokens"])
        if behaviour in ("close", "stall", "badjson", "error", "hugeline"):
            n_tokens = {"close": 2}.get(behaviour, 1)
        ttft_s = self.slow_ttft_s if behaviour == "slow" else self.ttft_s
        for i in range(n_tokens):
            # Sleep to an absolute deadline so gaps do not accumulate the server's own delays.
            await asyncio.sleep(max(0.0, received_s + ttft_s + i * self.itl_s - time.monotonic()))
            await _event(response, {"choices": [{"index": 0, "text": "x", "finish_reason": None}]})
        if behaviour == "close":
            request.transport.close()
            return response
        if behaviour == "stall":
            await self._stop.wait()
            return response
        if behaviour == "badjson":
            await response.write(b"data: {not json\n\n")
            return response
        if behaviour == "hugeline":
            await response.write(b"data: " + b"x" * (1 << 20) + b"\n\n")
            return response
        if behaviour == "error":
            await _event(response, {"error": {"message": "engine died", "code": 500}})
            return response
        prompt_tokens = len(body["prompt"])
        await _event(
            response, {"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n_tokens}}
        )
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def _event(response: web.StreamResponse, payload: dict) -> None:
    await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")


@pytest.fixture
def fake_server(port: int) -> Iterator[FakeCompletionsServer]:
    server = FakeCompletionsServer(port)
    server.start()
    yield server
    server.stop()
