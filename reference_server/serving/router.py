"""The HTTP front: OpenAI-compatible `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`
(and `/v1/models/{id}`), `GET /health`, `GET /metrics`; routing. Unknown routes answer 404 with an
OpenAI error body.

Runs on one asyncio event loop (aiohttp). Every handler is a coroutine; nothing here blocks the loop.

Routing (the router is the only client of its workers, so its own count of requests in flight per
worker is exact and needs no polling):
- colocated / chunked: sticky by `user` (rendezvous hashing over the live workers, so a user's prompts
  meet their prefix cache and a dead worker moves only its own users), else the least loaded worker.
- disaggregated: a decode worker by fewest requests in flight; a prefill worker sticky by `user`, else
  by fewest prompt tokens in flight. The router opens the token stream on the decode worker first (it
  then expects the request's KV), then posts the prompt to the prefill worker with the decode worker's
  KV receiver address. The first token reaches the client from the decode worker, after the transfer,
  so time to first token includes the exposed transfer (architecture.md §7).

Tracing: the root span `text_completion {model}` or `chat {model}` (SERVER; its parent is the client's
`traceparent` when it sent one) is recorded when the request ends, with the first-token mark and the
inter-token gaps the client saw; the workers get `traceparent` = the root span, so every stage span is
its child.

Failures: a worker that answers with an error, breaks its stream or dies fails that request only:
before the first token the client gets a JSON error with the status (500, or 503 with Retry-After when
queues or KV blocks are short), after it an SSE error event. A worker whose health check fails leaves
the rotation until it recovers.

A client that disconnects (aiohttp cancels its handler, or a write fails) aborts its request: the router
closes the worker streams, each worker drops the request and frees its KV blocks, and
`splitscope_requests_aborted_total{reason="client_disconnected"}` counts it once. No traceback: it is
a normal event.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
from array import array
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from reference_server.kv_transfer.wire import token_from_env
from reference_server.serving import openai_api as api
from reference_server.serving.metrics_proxy import joined_exposition
from reference_server.serving.text_stream import TextStream
from tracer import TraceContext, TracingSession
from tracer.export.exposition import Exposition
from tracer.metrics import ABORT_CLIENT_DISCONNECTED, process_labels
from tracer.spans import new_span_id
from tracer.timing import perf_counter_ns
from tracer.vocabulary import POOLS_OF_MODE, Mode, Pool

log = logging.getLogger(__name__)

MODES = tuple(Mode)
DEFAULT_MAX_BODY_BYTES = 1 << 20
HEALTH_INTERVAL_S = 1.0
RETRY_AFTER_S = 1  # the Retry-After of a 503: a decode step frees blocks within milliseconds to seconds


@dataclass
class Endpoint:
    """One worker as the router sees it. Event-loop thread only."""

    name: str
    pool: str  # colocated | prefill | decode
    url: str  # http://host:port of its internal API
    kv_address: str | None = None  # decode workers: host:port of the KV receiver
    pid: int | None = None
    alive: bool = True
    inflight: int = 0
    inflight_tokens: int = 0

    @classmethod
    def from_ready(cls, ready: dict[str, Any]) -> Endpoint:
        return cls(ready["name"], ready["pool"], ready["url"], ready.get("kv_address"), ready.get("pid"))


class UpstreamError(Exception):
    """A worker failed a request: `status` for the client, `error_type` for the span and the body."""

    def __init__(self, status: int, error_type: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.message = message


def least_loaded(endpoints: Sequence[Endpoint], *, by_tokens: bool = False) -> Endpoint | None:
    """The live endpoint with the least work in flight (ties: the first in order)."""
    live = [e for e in endpoints if e.alive]
    if not live:
        return None
    return min(live, key=(lambda e: (e.inflight_tokens, e.inflight)) if by_tokens else (lambda e: e.inflight))


def sticky(endpoints: Sequence[Endpoint], user: str) -> Endpoint | None:
    """Rendezvous hashing: the live endpoint with the highest hash of (user, name)."""
    live = [e for e in endpoints if e.alive]
    if not live:
        return None
    return max(live, key=lambda e: hashlib.blake2b(f"{user}\x00{e.name}".encode(), digest_size=8).digest())


@dataclass
class _Outcome:
    """What the root span needs, filled in while a request runs."""

    first_token: int | None = None  # clock mark when the first token was written to the client
    last_token_ns: int = 0
    gaps_s: array = field(default_factory=lambda: array("d"))
    output_tokens: int = 0
    error_type: str = ""


class Router:
    """The router's state and handlers. Create, `await start()`, serve `app()`, `await close()`."""

    def __init__(
        self,
        *,
        mode: str,
        model: str,
        max_context_tokens: int,
        endpoints: Sequence[Endpoint],
        tracing: TracingSession,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        max_inflight: int = 1024,
        stream_timeout_s: float = 600.0,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        self.mode = mode
        self.limits = api.Limits(model, max_context_tokens, max_context_tokens - 1)
        self.endpoints = list(endpoints)
        self.pools: dict[str, list[Endpoint]] = {}
        for endpoint in self.endpoints:
            self.pools.setdefault(endpoint.pool, []).append(endpoint)
        needed = POOLS_OF_MODE[Mode(mode)]
        for pool in needed:
            if not self.pools.get(pool):
                raise ValueError(f"mode {mode} needs at least one {pool} worker")
        self.needed_pools = needed
        self.tracing = tracing
        self.tracer = tracing.tracer
        self.exposition = Exposition(tracing.registry, process_labels())
        self.max_body_bytes = max_body_bytes
        self.max_inflight = max_inflight
        self.stream_timeout_s = stream_timeout_s
        self.inflight = 0
        self.started_s = api.now_s()  # the model card's `created`
        catalogue = tracing.catalogue
        self._aborted_disconnected = (
            catalogue.requests_aborted.labels(reason=ABORT_CLIENT_DISCONNECTED) if catalogue is not None else None
        )
        self._session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task | None = None

    # -- lifecycle

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0)  # bounded by max_inflight instead
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5.0, sock_read=self.stream_timeout_s)
        # Workers bound beyond loopback require the deployment's shared secret on their internal API.
        token = token_from_env()
        headers = {"Authorization": f"Bearer {token}"} if token else None
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers)
        self._update_pool_gauges()
        self._health_task = asyncio.create_task(self._health_loop())

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            try:
                await self._health_task
            except asyncio.CancelledError:
                pass
        if self._session is not None:
            await self._session.close()

    def mark_dead(self, name: str) -> None:
        """The launcher saw worker `name` exit: take it out of the rotation now."""
        for endpoint in self.endpoints:
            if endpoint.name == name:
                endpoint.alive = False
        self._update_pool_gauges()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "Router.start() was not awaited"
        return self._session

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[openai_not_found])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model_id:.+}", self.model)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        return app

    def metrics_app(self) -> web.Application:
        """Only /metrics, for --metrics-port."""
        app = web.Application()
        app.router.add_get("/metrics", self.metrics)
        return app

    # -- health and metrics

    async def _probe(self, endpoint: Endpoint) -> None:
        try:
            async with self.session.get(endpoint.url + "/health", timeout=aiohttp.ClientTimeout(total=2.0)) as response:
                endpoint.alive = response.status == 200
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            endpoint.alive = False

    async def _health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._probe(e) for e in self.endpoints))
            self._update_pool_gauges()
            await asyncio.sleep(HEALTH_INTERVAL_S)

    def _update_pool_gauges(self) -> None:
        catalogue = self.tracing.catalogue
        if catalogue is None:
            return
        for pool, endpoints in self.pools.items():
            catalogue.pool_workers.labels(pool=pool).set(sum(e.alive for e in endpoints))

    def healthy(self) -> bool:
        return all(any(e.alive for e in self.pools.get(pool, ())) for pool in self.needed_pools)

    async def health(self, request: web.Request) -> web.Response:
        body = {
            "status": "ok" if self.healthy() else "degraded",
            "mode": self.mode,
            "model": self.limits.model,
            "inflight": self.inflight,
            "workers": [
                {"name": e.name, "pool": e.pool, "pid": e.pid, "alive": e.alive, "inflight": e.inflight}
                for e in self.endpoints
            ],
        }
        return web.json_response(body, status=200 if self.healthy() else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        """The router's own series and every live worker's, each keeping its labels (metrics_proxy): the
        fallback /metrics for a server without a metrics exporter, which is the path to scrape."""
        accept = request.headers.get("Accept")
        own = await asyncio.to_thread(self.exposition.render, accept)
        urls = [e.url + "/metrics" for e in self.endpoints if e.alive]
        body = await joined_exposition(own, urls, self.session, accept)
        content_type = own[1]
        response = web.Response(body=body)
        response.headers["Content-Type"] = content_type
        return response

    # -- completions

    async def _read_body(self, request: web.Request) -> Any:
        if request.content_length is not None and request.content_length > self.max_body_bytes:
            raise api.ApiError(413, f"request body is over the {self.max_body_bytes}-byte limit", code="body_too_large")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise api.ApiError(
                413, f"request body is over the {self.max_body_bytes}-byte limit", code="body_too_large"
            ) from None
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise api.ApiError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions."""
        return await self._serve(request, api.parse_completion)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions: the chat template's prompt, served as a completion."""
        return await self._serve(request, api.parse_chat)

    async def models(self, request: web.Request) -> web.Response:
        """GET /v1/models: the one model this server serves."""
        return web.json_response(api.model_list(self.limits.model, self.started_s))

    async def model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{id}: its card, or 404 with an OpenAI error body."""
        model_id = request.match_info["model_id"]
        if model_id != self.limits.model:
            exc = api.model_not_found(model_id, self.limits.model)
            return web.json_response(exc.body(), status=exc.status)
        return web.json_response(api.model_card(self.limits.model, self.started_s))

    async def _serve(
        self, request: web.Request, parse: Callable[[Any, api.Limits], api.CompletionParams]
    ) -> web.StreamResponse:
        start = self.tracer.mark()
        try:
            params = parse(await self._read_body(request), self.limits)
        except api.ApiError as exc:
            return web.json_response(exc.body(), status=exc.status)
        if self.inflight >= self.max_inflight:
            return _overloaded("server is at its request limit")
        client_ctx = TraceContext.from_traceparent(request.headers.get("traceparent")) or TraceContext.new_root()
        root_span_id = new_span_id()
        ctx = client_ctx.child(root_span_id)
        shape = api.SHAPES[params.operation]
        request_id = shape.id_prefix + secrets.token_hex(12)
        outcome = _Outcome()
        self.inflight += 1
        try:
            events = self._events(params, ctx, request_id)
            # Leaving this block (an answer, an error, or the client gone: aiohttp cancels this handler)
            # closes the worker streams, and a worker whose stream closes aborts the request and frees
            # its KV blocks at once, wherever it is: queued, prefilling, in transfer, or decoding.
            async with aclosing(events):
                if params.stream:
                    return await self._stream(request, params, shape, request_id, events, outcome)
                return await self._complete(params, shape, request_id, events, outcome)
        except asyncio.CancelledError:
            outcome.error_type = outcome.error_type or ABORT_CLIENT_DISCONNECTED
            raise
        finally:
            self.inflight -= 1
            if outcome.error_type == ABORT_CLIENT_DISCONNECTED and self._aborted_disconnected is not None:
                self._aborted_disconnected.inc()
            self.tracer.request(
                client_ctx,
                root_span_id,
                start,
                self.tracer.mark(),
                outcome.first_token,
                model=params.model,
                mode=self.mode,
                request_id=request_id,
                input_tokens=len(params.prompt_token_ids),
                output_tokens=outcome.output_tokens,
                token_gap_s=outcome.gaps_s,
                error_type=outcome.error_type,
                operation=params.operation,
            )

    def _on_tokens(self, outcome: _Outcome, count: int) -> None:
        """`count` tokens just reached the client (in one event: several when text was held back)."""
        now_ns = perf_counter_ns()
        for _ in range(count):
            if outcome.first_token is None:
                outcome.first_token = self.tracer.mark()
            else:
                outcome.gaps_s.append((now_ns - outcome.last_token_ns) / 1e9)
            outcome.last_token_ns = now_ns
        outcome.output_tokens += count

    async def _stream(
        self,
        request: web.Request,
        params: api.CompletionParams,
        shape: api.ResponseShape,
        request_id: str,
        events: AsyncIterator[tuple],
        outcome: _Outcome,
    ) -> web.StreamResponse:
        """The SSE answer. An event is written only when it has text (held-back bytes of a character, or a
        possible start of a stop string, go out with a later event), except the last, which carries the
        finish reason."""
        try:
            event = await anext(events)
        except UpstreamError as exc:  # nothing sent yet: a plain error answer with its status
            outcome.error_type = exc.error_type
            return _upstream_error_response(exc)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        text_stream = TextStream(params.stop)
        created_s = api.now_s()
        model = params.model
        with_ids = params.return_token_ids
        held_ids: list[int] = []  # tokens whose text has not been sent yet
        first = True
        try:
            while True:
                if event[0] == "token":
                    held_ids.append(event[1])
                    text = text_stream.push((event[1],))
                    if text_stream.stopped:
                        tail = self._tail(
                            params, shape, request_id, created_s, text, "stop", held_ids, first, outcome, 0
                        )
                        await response.write(tail)
                        break
                    if text:
                        await response.write(
                            shape.chunk_event(
                                request_id, created_s, model, text, None, held_ids if with_ids else None, first=first
                            )
                        )
                        self._on_tokens(outcome, len(held_ids))
                        held_ids = []
                        first = False
                else:
                    info = event[1]
                    text = text_stream.flush()
                    tail = self._tail(
                        params,
                        shape,
                        request_id,
                        created_s,
                        text,
                        info.get("finish_reason"),
                        held_ids,
                        first,
                        outcome,
                        info.get("cached_tokens", 0),
                    )
                    await response.write(tail)
                    break
                event = await anext(events)
        except UpstreamError as exc:
            outcome.error_type = exc.error_type
            try:
                await response.write(api.error_event(exc.message, "server_error", exc.error_type))
            except ConnectionError:
                outcome.error_type = ABORT_CLIENT_DISCONNECTED
                return response
        except ConnectionError:  # the client went away mid-stream (aiohttp's reset error is one)
            outcome.error_type = ABORT_CLIENT_DISCONNECTED
            return response
        try:
            await response.write_eof()
        except ConnectionError:
            pass
        return response

    def _tail(
        self,
        params: api.CompletionParams,
        shape: api.ResponseShape,
        request_id: str,
        created_s: int,
        text: str,
        finish_reason: str | None,
        held_ids: list[int],
        first: bool,
        outcome: _Outcome,
        cached_tokens: int,
    ) -> bytes:
        """The last event (with the finish reason and the tokens still held), usage if asked, and [DONE]."""
        tail = shape.chunk_event(
            request_id,
            created_s,
            params.model,
            text,
            finish_reason,
            held_ids if params.return_token_ids else None,
            first=first,
        )
        self._on_tokens(outcome, len(held_ids))
        if params.include_usage:
            usage = api.usage(len(params.prompt_token_ids), outcome.output_tokens, cached_tokens)
            tail += shape.usage_event(request_id, created_s, params.model, usage)
        return tail + api.DONE_EVENT

    async def _complete(
        self,
        params: api.CompletionParams,
        shape: api.ResponseShape,
        request_id: str,
        events: AsyncIterator[tuple],
        outcome: _Outcome,
    ) -> web.Response:
        token_ids: list[int] = []
        info: dict[str, Any] = {}
        text_stream = TextStream(params.stop)
        pieces: list[str] = []
        try:
            async for event in events:
                if event[0] == "token":
                    token_ids.append(event[1])
                    self._on_tokens(outcome, 1)
                    pieces.append(text_stream.push((event[1],)))
                    if text_stream.stopped:
                        info = {"finish_reason": "stop"}
                        break
                else:
                    info = event[1]
        except UpstreamError as exc:
            outcome.error_type = exc.error_type
            return _upstream_error_response(exc)
        pieces.append(text_stream.flush())
        usage = api.usage(len(params.prompt_token_ids), len(token_ids), info.get("cached_tokens", 0))
        body = shape.body(
            request_id,
            api.now_s(),
            params.model,
            "".join(pieces),
            info.get("finish_reason"),
            usage,
            token_ids if params.return_token_ids else None,
        )
        return web.json_response(body)

    # -- upstream

    def _payload(self, params: api.CompletionParams, request_id: str) -> dict[str, Any]:
        return {
            "request_id": request_id,
            "prompt_token_ids": list(params.prompt_token_ids),
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "seed": params.seed,
            "ignore_eos": params.ignore_eos,
            # The workers end the request on these strings' bytes (freeing its blocks at once); the
            # router cuts the text itself, streaming-safe.
            "stop": list(params.stop),
        }

    def _events(self, params: api.CompletionParams, ctx: TraceContext, request_id: str) -> AsyncGenerator[tuple, None]:
        if self.mode == Mode.DISAGGREGATED:
            return self._disaggregated_events(params, ctx, request_id)
        return self._colocated_events(params, ctx, request_id)

    async def _colocated_events(
        self, params: api.CompletionParams, ctx: TraceContext, request_id: str
    ) -> AsyncGenerator[tuple, None]:
        pool = self.pools[Pool.COLOCATED]
        worker = (sticky(pool, params.user) if params.user else None) or least_loaded(pool)
        if worker is None:
            raise UpstreamError(503, "unavailable", "no live worker")
        worker.inflight += 1
        try:
            async with self.session.post(
                worker.url + "/generate",
                json=self._payload(params, request_id),
                headers={"traceparent": ctx.traceparent()},
            ) as response:
                await _check_status(response, worker)
                async for event in _ndjson_events(response, worker):
                    yield event
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            raise UpstreamError(
                500, "worker_failed", f"worker {worker.name} failed: {type(exc).__name__}: {exc}"
            ) from None
        finally:
            worker.inflight -= 1

    async def _disaggregated_events(
        self, params: api.CompletionParams, ctx: TraceContext, request_id: str
    ) -> AsyncGenerator[tuple, None]:
        decode_worker = least_loaded(self.pools[Pool.DECODE])
        prefill_pool = self.pools[Pool.PREFILL]
        prefill_worker = (sticky(prefill_pool, params.user) if params.user else None) or least_loaded(
            prefill_pool, by_tokens=True
        )
        if decode_worker is None or prefill_worker is None or not decode_worker.kv_address:
            raise UpstreamError(503, "unavailable", "no live prefill or decode worker")
        headers = {"traceparent": ctx.traceparent()}
        payload = self._payload(params, request_id)
        prompt_tokens = len(params.prompt_token_ids)
        decode_worker.inflight += 1
        prefill_worker.inflight += 1
        prefill_worker.inflight_tokens += prompt_tokens
        prefill_task: asyncio.Task | None = None
        try:
            async with self.session.post(
                decode_worker.url + "/generate", json={**payload, "kv": True}, headers=headers
            ) as response:
                await _check_status(response, decode_worker)
                # The decode worker now expects this request's KV: start the prefill.
                prefill_task = asyncio.create_task(self._prefill(prefill_worker, decode_worker, payload, headers))
                prefill_task.add_done_callback(lambda _: self._prefill_done(prefill_worker, prompt_tokens))
                stream = _ndjson_events(response, decode_worker)
                # Closed innermost first: the merge cancels its pending read before the stream closes.
                async with aclosing(stream), aclosing(_merge_prefill_outcome(stream, prefill_task)) as merged:
                    async for event in merged:
                        yield event
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            raise UpstreamError(
                500, "worker_failed", f"worker {decode_worker.name} failed: {type(exc).__name__}: {exc}"
            ) from None
        finally:
            decode_worker.inflight -= 1
            if prefill_task is None:
                self._prefill_done(prefill_worker, prompt_tokens)
            elif not prefill_task.done():
                prefill_task.cancel()

    @staticmethod
    def _prefill_done(worker: Endpoint, prompt_tokens: int) -> None:
        worker.inflight -= 1
        worker.inflight_tokens -= prompt_tokens

    async def _prefill(
        self, worker: Endpoint, decode_worker: Endpoint, payload: dict[str, Any], headers: dict[str, str]
    ) -> dict[str, Any]:
        body = {**payload, "kv_dst": decode_worker.kv_address, "kv_dst_worker": decode_worker.name}
        try:
            async with self.session.post(worker.url + "/prefill", json=body, headers=headers) as response:
                await _check_status(response, worker)
                return await response.json()
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as exc:
            raise UpstreamError(
                500, "worker_failed", f"prefill worker {worker.name} failed: {type(exc).__name__}: {exc}"
            ) from None


async def _merge_prefill_outcome(
    stream: AsyncIterator[tuple], prefill_task: asyncio.Task
) -> AsyncGenerator[tuple, None]:
    """The decode worker's events, failing as soon as the prefill (or its KV transfer) fails.

    A prefill that finished the request by itself (its first token was a stop, or max_tokens 1) ends the
    stream with that token: no KV will come.
    """
    next_event: asyncio.Future = asyncio.ensure_future(anext(stream))
    prefill_pending = True
    try:
        while True:
            waiting = {next_event, prefill_task} if prefill_pending else {next_event}
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if prefill_pending and prefill_task in done:
                prefill_pending = False
                outcome = prefill_task.result()  # raises UpstreamError when the prefill failed
                if outcome.get("status") == "finished":
                    yield ("token", outcome["first_token_id"])
                    yield ("done", outcome)
                    return
                continue
            if next_event in done:
                try:
                    event = next_event.result()
                except StopAsyncIteration:
                    return
                yield event
                if event[0] == "done":
                    return
                next_event = asyncio.ensure_future(anext(stream))
    finally:
        if not next_event.done():
            next_event.cancel()
            try:
                await next_event
            except (asyncio.CancelledError, StopAsyncIteration, Exception):
                pass


async def _check_status(response: aiohttp.ClientResponse, worker: Endpoint) -> None:
    if response.status == 200:
        return
    try:
        error = (await response.json()).get("error", {})
    except (ValueError, aiohttp.ClientError):
        error = {}
    message = error.get("message") or f"HTTP {response.status}"
    raise UpstreamError(response.status, error.get("type") or "worker_error", f"worker {worker.name}: {message}")


async def _ndjson_events(response: aiohttp.ClientResponse, worker: Endpoint) -> AsyncGenerator[tuple, None]:
    """A worker's NDJSON stream as ("token", id) ... ("done", info); raises UpstreamError on its error
    event or when the stream ends early (the worker died)."""
    async for line in response.content:
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except ValueError:
            raise UpstreamError(500, "worker_failed", f"worker {worker.name} sent a malformed event") from None
        if "token" in event:
            yield ("token", event["token"])
        elif "done" in event:
            yield ("done", event["done"])
            return
        else:
            error = event.get("error") or {}
            raise UpstreamError(
                int(error.get("status", 500)),
                str(error.get("type", "worker_error")),
                f"worker {worker.name}: {error.get('message', 'failed')}",
            )
    raise UpstreamError(500, "worker_failed", f"worker {worker.name} closed the stream before the end")


def _upstream_error_response(exc: UpstreamError) -> web.Response:
    if exc.status == 503:
        return _overloaded(exc.message, exc.error_type)
    status = exc.status if 400 <= exc.status < 500 else 500
    error_type = "invalid_request_error" if 400 <= status < 500 else "server_error"
    return web.json_response(api.error_body(exc.message, error_type, None, exc.error_type), status=status)


def _overloaded(message: str, code: str = "server_overloaded") -> web.Response:
    """503 with Retry-After: capacity (queues, KV blocks) is short now; the same request may fit soon."""
    return web.json_response(
        api.error_body(message, "server_overloaded", None, code),
        status=503,
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


@web.middleware
async def openai_not_found(request: web.Request, handler: Any) -> web.StreamResponse:
    """Unknown routes and methods answer with an OpenAI error body (clients parse it), not plain text."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        body = api.error_body(f"no route {request.method} {request.path}", "invalid_request_error", None, "not_found")
        return web.json_response(body, status=404)
    except web.HTTPMethodNotAllowed as exc:
        body = api.error_body(
            f"{request.method} is not allowed on {request.path}", "invalid_request_error", None, "method_not_allowed"
        )
        return web.json_response(body, status=405, headers={"Allow": ", ".join(sorted(exc.allowed_methods))})
