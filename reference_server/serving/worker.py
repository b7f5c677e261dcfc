"""One engine process: its internal HTTP API, the engine thread, KV transfer, tracing and metrics.

Started by the launcher as `python -m reference_server.serving.worker --role ROLE --name NAME ...`. It binds its
HTTP port (and, for a decode worker, its KV receiver) on free ports, then prints one line to stdout,
`SPLITSCOPE_WORKER_READY {json}` with the addresses, and serves until SIGTERM/SIGINT (or its launcher
dies: `process_guard`). Logs go to stderr.

Internal API (the router is its only client; bodies are JSON, streams are NDJSON, one event a line):
- `POST /generate` (colocated/chunked/decode): {request_id, prompt_token_ids, max_tokens, temperature,
  top_p, seed, ignore_eos, stop (strings: the request ends once its output bytes end with one), kv};
  header `traceparent` = the router's root span. Answers 200 with a stream of
  `{"token": id}`, then `{"done": {finish_reason, prompt_tokens, cached_tokens, output_tokens}}` or
  `{"error": {status, type, message}}`. With `kv: true` (decode workers) the stream starts once the
  request's KV has arrived from a prefill worker. 400 on a bad body, 503 when the queue is full.
- `POST /prefill` (prefill): the same fields plus `kv_dst` ("host:port" of the decode worker's KV
  receiver) and `kv_dst_worker`; answers once the KV is transferred: `{"status": "transferred",
  "first_token_id", ...}`, or `{"status": "finished", ...}` when the first token ended the request, or
  an error status with `{"error": {...}}`.
- `GET /health` (200 with load figures while the engine runs, else 503), `GET /metrics`.

Binding: 127.0.0.1 by default. Another `--host` needs the deployment's shared secret in
SPLITSCOPE_KV_TOKEN (the one the KV transfer checks); with it set, every route of the internal API
answers 401 unless the request carries `Authorization: Bearer <token>` (compared in constant time). The
router sends it from the same variable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from aiohttp import web
from prometheus_client import CollectorRegistry

from reference_server.engine import (
    EVENT_DONE,
    EVENT_ERROR,
    EVENT_TOKEN,
    Engine,
    default_kv_blocks,
)
from reference_server.kv_cache import KVCachePool, kv_bytes_per_token
from reference_server.kv_transfer.wire import TOKEN_ENV_VAR, token_from_env
from reference_server.launch.engine_options import EngineOptions, flag_of
from reference_server.launch.process_guard import die_with_parent
from reference_server.launch.ready_line import ready_line
from reference_server.model import ModelArgs, build_model
from reference_server.scheduler import QueueFull, Request, RequestRejected
from reference_server.tokenizer import EOS_ID, encode
from tracer import TraceContext, start_tracing
from tracer.auth import bearer_ok, check_bind_token
from tracer.export.exposition import Exposition
from tracer.metrics import ABORT_CLIENT_DISCONNECTED, process_labels
from tracer.vocabulary import POOL_OF_ROLE, Role

log = logging.getLogger("reference_server.serving.worker")

ROLES = tuple(Role)
MAX_BODY_BYTES = 4 << 20  # a max_seq_len prompt as JSON token ids fits many times over
MAX_REQUEST_ID_CHARS = 256
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 256
NDJSON = "application/x-ndjson"


@dataclass(frozen=True)
class WorkerOptions(EngineOptions):
    """One worker's settings: its role and name, what only a worker has, and the engine settings the
    launcher passes on (`EngineOptions`, keyword-only). Every field but role and name is a flag."""

    role: str
    name: str
    preset: str = "tiny"
    host: str = "127.0.0.1"
    threads: int = 0  # torch intra-op threads; 0 leaves torch's default
    max_waiting: int = 256


def internal_api_token(host: str) -> str | None:
    """The bearer token the internal API requires (SPLITSCOPE_KV_TOKEN), or None when unset.

    Raises ValueError when `host` is not loopback and no token is set: an engine's internal API is never
    open beyond this machine without one.
    """
    token = token_from_env()
    check_bind_token("the worker", [host], token, TOKEN_ENV_VAR)
    return token


def require_bearer(token: str) -> Any:
    """aiohttp middleware: 401 unless `Authorization: Bearer <token>` (constant-time compare)."""

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        if not bearer_ok(token, request.headers.get("Authorization")):
            return error_json(401, "unauthorized", "missing or wrong bearer token")
        return await handler(request)

    return check


class BadRequest(ValueError):
    """An internal API body that does not parse; answered with 400."""


def error_json(status: int, error_type: str, message: str) -> web.Response:
    return web.json_response({"error": {"status": status, "type": error_type, "message": message}}, status=status)


class Worker:
    """The process's parts. Built on the event loop's thread; `engine` runs on its own thread."""

    def __init__(self, options: WorkerOptions, loop: asyncio.AbstractEventLoop) -> None:
        if options.role not in ROLES:
            raise ValueError(f"unknown role {options.role!r}; choose one of {', '.join(ROLES)}")
        self.options = options
        self.loop = loop
        self.pool_name = POOL_OF_ROLE[Role(options.role)]
        self.engine_failed = asyncio.Event()  # set on the loop when the engine thread gives up
        if options.threads > 0:
            torch.set_num_threads(options.threads)
        self.args = ModelArgs.from_name(options.preset)
        self.tracing = start_tracing(
            self.pool_name,
            options.name,
            traces_file=options.traces_file,
            device=options.device,
            step_sample_every=options.step_sample,
            sidecar_socket=options.sidecar_socket,
            registry=CollectorRegistry(),  # the worker serves its own /metrics on either export path
        )
        # Every series labelled with this worker; kept, so each scrape formats only the values.
        self.exposition = Exposition(self.tracing.registry, process_labels(options.name))
        self.model = build_model(self.args, seed=options.seed, device=options.device)
        bytes_per_block = kv_bytes_per_token(self.args, torch.float32) * options.block_size
        kv_blocks = options.kv_blocks or default_kv_blocks(
            self.args.max_seq_len, options.block_size, options.max_batch, bytes_per_block
        )
        self.kv_pool = KVCachePool(self.args, kv_blocks, options.block_size, device=options.device, dtype=torch.float32)
        tracer = self.tracing.tracer
        clock = getattr(tracer, "clock", None)
        metrics = self.tracing.catalogue.bind(self.pool_name, options.name) if self.tracing.catalogue else None
        token_budget = (
            options.token_budget if options.role == Role.CHUNKED else max(options.token_budget, self.args.max_seq_len)
        )
        self.engine = Engine(
            role=options.role,
            model=self.model,
            kv_pool=self.kv_pool,
            token_budget=token_budget,
            max_batch_seqs=options.max_batch,
            tracer=tracer,
            metrics=metrics,
            deliver=self.deliver,
            max_waiting_requests=options.max_waiting,
            anchor=getattr(clock, "anchor", None),
            kv_wait_s=options.kv_wait_s,
            on_fatal=lambda reason: loop.call_soon_threadsafe(self.engine_failed.set),
        )
        self.receiver = None
        self.sender = None
        self.handoff = None
        # The KV transfer times with the tracer's clock: its spans and the stage spans then share one
        # timeline in this process, and the offset the sender measures is the one between the two tracers.
        wall_ns = getattr(clock, "wall_ns", time.time_ns)
        if options.role == Role.DECODE:
            from reference_server.kv_transfer import KVReceiver

            self.receiver = KVReceiver(
                self.kv_pool.tensor,
                allocate_blocks=self.engine.allocate_blocks,
                free_blocks=self.engine.free_blocks,
                on_complete=self.engine.kv_arrived,
                on_failed=self.engine.kv_failed,
                host=options.host,
                clock_ns=wall_ns,
            )
            self.engine.kv_address = options.name
        elif options.role == Role.PREFILL:
            from reference_server.kv_transfer import KVSender
            from reference_server.kv_transfer.handoff import KVHandoff

            self.sender = KVSender(streams=options.kv_streams, clock_ns=wall_ns)
            self.handoff = KVHandoff(
                self.engine,
                self.sender,
                tracer,
                self.deliver,
                worker=options.name,
                streams=options.kv_streams,
                clock_ns=wall_ns,
            )
            self.engine.on_handoff = self.handoff
        self.engine.start()

    # -- engine -> event loop

    def deliver(self, batch: list[tuple[Any, tuple]]) -> None:
        """Engine or transfer thread: hand events to their sinks on the event loop (one wakeup a batch)."""
        try:
            self.loop.call_soon_threadsafe(_dispatch, batch)
        except RuntimeError:  # the loop is closed: shutting down
            pass

    # -- HTTP

    def app(self, token: str | None = None) -> web.Application:
        """The internal API; with `token`, every route requires it as a bearer token."""
        middlewares = [require_bearer(token)] if token else []
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        if self.options.role == Role.PREFILL:
            app.router.add_post("/prefill", self.prefill)
        else:
            app.router.add_post("/generate", self.generate)
        return app

    async def health(self, request: web.Request) -> web.Response:
        body = {
            "status": "ok" if self.engine.alive else "down",
            "pool": self.pool_name,
            "worker": self.options.name,
            **self.engine.load(),
        }
        return web.json_response(body, status=200 if self.engine.alive else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        # Off the loop that streams tokens to the router.
        body, content_type = await asyncio.to_thread(self.exposition.render, request.headers.get("Accept"))
        response = web.Response(body=body)
        response.headers["Content-Type"] = content_type
        return response

    async def _parse(self, request: web.Request) -> tuple[Request, TraceContext, dict[str, Any]]:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadRequest(f"body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise BadRequest("body must be a JSON object")
        request_id = body.get("request_id")
        if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_REQUEST_ID_CHARS:
            raise BadRequest("request_id must be a non-empty string")
        prompt = body.get("prompt_token_ids")
        vocab = self.args.vocab_size
        if not isinstance(prompt, list) or not all(type(t) is int and 0 <= t < vocab for t in prompt):
            raise BadRequest(f"prompt_token_ids must be a list of token ids in [0, {vocab})")
        max_tokens = body.get("max_tokens")
        if type(max_tokens) is not int:
            raise BadRequest("max_tokens must be an integer")
        temperature = body.get("temperature", 0.0)
        if type(temperature) not in (int, float):
            raise BadRequest("temperature must be a number")
        seed = body.get("seed")
        if seed is not None and type(seed) is not int:
            raise BadRequest("seed must be an integer or null")
        top_p = body.get("top_p", 1.0)
        if type(top_p) not in (int, float):
            raise BadRequest("top_p must be a number")
        stop = body.get("stop") or []
        if (
            not isinstance(stop, list)
            or len(stop) > MAX_STOP_SEQUENCES
            or not all(isinstance(x, str) and 0 < len(x) <= MAX_STOP_CHARS for x in stop)
        ):
            raise BadRequest(f"stop must be a list of at most {MAX_STOP_SEQUENCES} non-empty strings")
        stop_tokens = frozenset() if body.get("ignore_eos") is True else frozenset({EOS_ID})
        try:
            req = Request(
                request_id,
                tuple(prompt),
                max_tokens,
                float(temperature),
                stop_tokens,
                float(top_p),
                tuple(tuple(encode(x)) for x in stop),
            )
        except RequestRejected as exc:
            raise BadRequest(str(exc)) from None
        ctx = TraceContext.from_traceparent(request.headers.get("traceparent")) or TraceContext.new_root()
        return req, ctx, body

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            req, ctx, body = await self._parse(request)
        except BadRequest as exc:
            return error_json(400, "invalid_request_error", str(exc))
        events: asyncio.Queue[tuple] = asyncio.Queue()  # bounded by construction: max_tokens + 1 events
        try:
            if body.get("kv") is True:
                if self.options.role != Role.DECODE:
                    return error_json(400, "invalid_request_error", "this worker does not receive KV")
                self.engine.expect_kv(req, ctx, events.put_nowait, seed=body.get("seed"))
            else:
                if self.options.role == Role.DECODE:
                    return error_json(400, "invalid_request_error", "a decode worker serves only kv requests")
                self.engine.submit(req, ctx, events.put_nowait, seed=body.get("seed"))
        except QueueFull as exc:
            return error_json(503, "overloaded", str(exc))
        except RequestRejected as exc:
            return error_json(400, "invalid_request_error", str(exc))
        response = web.StreamResponse(headers={"Content-Type": NDJSON})
        finished = False
        try:
            await response.prepare(request)
            while not finished:
                batch = [await events.get()]
                while not events.empty():
                    batch.append(events.get_nowait())
                lines = []
                for event in batch:
                    line, finished = _event_line(event)
                    lines.append(line)
                    if finished:
                        break
                await response.write(b"".join(lines))
            await response.write_eof()
        except ConnectionError:  # the router went away mid-stream: a normal disconnect, no traceback
            pass
        finally:
            if not finished:  # the router went away (or the write failed): free the request's blocks
                self.engine.abort(req.request_id, ABORT_CLIENT_DISCONNECTED)
                if self.receiver is not None:  # and cut its KV transfer if it is on its way
                    self.receiver.cancel(req.request_id)
        return response

    async def prefill(self, request: web.Request) -> web.Response:
        try:
            req, ctx, body = await self._parse(request)
            kv_dst = _host_port(body.get("kv_dst"))
        except BadRequest as exc:
            return error_json(400, "invalid_request_error", str(exc))
        kv_dst_worker = body.get("kv_dst_worker")
        if not isinstance(kv_dst_worker, str):
            kv_dst_worker = ""
        outcome: asyncio.Future[tuple] = self.loop.create_future()

        def sink(event: tuple) -> None:
            if not outcome.done():
                outcome.set_result(event)

        try:
            self.engine.submit(req, ctx, sink, seed=body.get("seed"), kv_dst=kv_dst, kv_dst_worker=kv_dst_worker[:100])
        except QueueFull as exc:
            return error_json(503, "overloaded", str(exc))
        except RequestRejected as exc:
            return error_json(400, "invalid_request_error", str(exc))
        try:
            event = await outcome
        except asyncio.CancelledError:
            self.engine.abort(req.request_id, ABORT_CLIENT_DISCONNECTED)
            raise
        from reference_server.kv_transfer.handoff import EVENT_TRANSFERRED

        kind = event[0]
        if kind == EVENT_TRANSFERRED:
            return web.json_response({"status": "transferred", "first_token_id": event[1], **event[2]})
        if kind == EVENT_DONE:
            return web.json_response({"status": "finished", "finish_reason": event[1], **event[2]})
        if kind == EVENT_ERROR:
            return error_json(event[1], event[2], event[3])
        return error_json(500, "internal_error", f"unexpected engine event {kind!r}")

    async def close(self) -> None:
        """Stop serving: engine, transfer, tracing (flushes spans). Blocking parts run off the loop."""
        await asyncio.to_thread(self._close_blocking)

    def _close_blocking(self) -> None:
        self.engine.stop()
        if self.handoff is not None:
            self.handoff.close()
        if self.sender is not None:
            self.sender.close()
        if self.receiver is not None:
            self.receiver.close()
        self.tracing.shutdown(5.0)


def _dispatch(batch: list[tuple[Any, tuple]]) -> None:
    for sink, event in batch:
        sink(event)


def _event_line(event: tuple) -> tuple[bytes, bool]:
    """One NDJSON line for an engine event, and whether it ends the stream."""
    kind = event[0]
    if kind == EVENT_TOKEN:
        return b'{"token":%d}\n' % event[1], False
    if kind == EVENT_DONE:
        return json.dumps({"done": {"finish_reason": event[1], **event[2]}}).encode() + b"\n", True
    if kind == EVENT_ERROR:
        error = {"status": event[1], "type": event[2], "message": event[3]}
        return json.dumps({"error": error}).encode() + b"\n", True
    return json.dumps(
        {"error": {"status": 500, "type": "internal_error", "message": f"event {kind!r}"}}
    ).encode() + b"\n", True


def _host_port(value: Any) -> tuple[str, int]:
    if not isinstance(value, str) or ":" not in value:
        raise BadRequest("kv_dst must be 'host:port'")
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise BadRequest("kv_dst must be 'host:port'")
    return host, int(port)


# ------------------------------------------------------------------------------------------ process


async def serve_worker(options: WorkerOptions, ready_stream: Any = None) -> None:
    """Build the worker, bind its ports, announce them, and serve until SIGTERM/SIGINT."""
    token = internal_api_token(options.host)  # before the model build: a bad bind fails at once
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    worker = await asyncio.to_thread(Worker, options, loop)  # model build: seconds, off the loop
    runner = web.AppRunner(worker.app(token), handler_cancellation=True, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    sock = socket.create_server((options.host, 0))
    site = web.SockSite(runner, sock, shutdown_timeout=2.0)
    await site.start()
    ready = {
        "name": options.name,
        "role": options.role,
        "pool": worker.pool_name,
        "pid": os.getpid(),
        "url": f"http://{options.host}:{sock.getsockname()[1]}",
        "kv_address": "%s:%d" % worker.receiver.address if worker.receiver is not None else None,
        "model": options.preset,
        "max_context_tokens": worker.args.max_seq_len,
        "kv_blocks": worker.kv_pool.num_blocks,
    }
    out = ready_stream or sys.stdout
    out.write(ready_line(ready))
    out.flush()
    log.info("%s (%s) ready at %s", options.name, options.role, ready["url"])
    try:
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(worker.engine_failed.wait())]
        _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
    finally:
        await runner.cleanup()
        await worker.close()
    if worker.engine.fatal_error:
        raise EngineFailed(worker.engine.fatal_error)


class EngineFailed(RuntimeError):
    """The engine loop gave up (deterministic failures); the worker process exits non-zero."""


def parse_args(argv: list[str] | None = None) -> tuple[WorkerOptions, int]:
    parser = argparse.ArgumentParser(
        prog="python -m reference_server.serving.worker", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--role", required=True, choices=[role.value for role in Role])
    parser.add_argument("--name", required=True)
    parser.add_argument("--parent-pid", type=int, default=0, help="stop when this process (the launcher) exits")
    defaults = WorkerOptions(Role.COLOCATED, "w")
    for field_name, value in asdict(defaults).items():
        if field_name in ("role", "name"):
            continue
        parser.add_argument(flag_of(field_name), type=type(value) if value is not None else str, default=value)
    ns = parser.parse_args(argv)
    values = {k: v for k, v in vars(ns).items() if k != "parent_pid"}
    try:
        internal_api_token(ns.host)
    except ValueError as exc:
        parser.error(str(exc))
    return WorkerOptions(**values), ns.parent_pid


def main(argv: list[str] | None = None) -> None:
    options, parent_pid = parse_args(argv)
    # The engine thread gives up the GIL inside every torch op; a pure-Python thread beside it (a /metrics
    # render, an HTTP handler) then holds it for up to the switch interval each time the engine wants it
    # back. 1 ms instead of the default 5 ms bounds that wait between the steps of a decode.
    sys.setswitchinterval(0.001)
    if parent_pid:
        die_with_parent(parent_pid)
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format=f"%(asctime)s {options.name} %(levelname)s %(name)s: %(message)s"
    )
    try:
        asyncio.run(serve_worker(options))
    except EngineFailed as exc:
        print(f"error: worker {options.name}: {exc}", file=sys.stderr)
        sys.exit(1)
    except Exception as exc:
        log.exception("worker %s failed to start", options.name)
        print(f"error: worker {options.name}: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
