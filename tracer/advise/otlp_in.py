"""`advise --follow --otlp-port`: OTLP/HTTP trace export straight into the advisor, no file in between.

POST /v1/traces, protobuf or JSON, identity or gzip, under the body rules every receiver of ours applies
(tracer.otlp.http_body): 415, 413 or 400 with the reason, 411 without a Content-Length. A body is decoded on
its request's thread into the codec's spans (`tracer.otlp.spans_from_record`, what `--follow` reads from a
file) and handed to the advisor's loop through a bounded inbox. While the inbox is full (the loop is deciding
a window and exporters outrun it) the answer is 503 with Retry-After, which OTLP exporters retry: a request
is taken whole or refused whole, so nothing an exporter was told is accepted is lost. Answers 200 with an
empty ExportTraceServiceResponse otherwise. Any other path or method is 404 / 405.

Plain HTTP/1.1 from the standard library's threading server: one advisor takes one deployment's spans
(deploy/otel-collector-advice-router.yaml routes them), far below what needs an event loop. No TLS or
token here: bind it to a private address, as the metrics port.

Threads: a daemon thread serves, one thread per connection; `drain()` from the advisor's loop only.
"""

from __future__ import annotations

import queue
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tracer.otlp import Span, spans_from_record
from tracer.otlp.http_body import (
    DEFAULT_MAX_BODY_BYTES,
    TRACE_FORMAT,
    BodyTooLarge,
    UnsupportedMedia,
    empty_answer,
    export_body,
)

TRACES_PATH = "/v1/traces"
DEFAULT_INBOX_REQUESTS = 256  # export requests waiting for the loop (an SDK batch is up to 512 spans)
RETRY_AFTER_S = 1


class OtlpInbox:
    """The receiver and the bounded queue of decoded requests it fills. `address`: (host, bound port)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        max_requests: int = DEFAULT_INBOX_REQUESTS,
    ) -> None:
        self._queue: queue.Queue[list[Span]] = queue.Queue(max_requests)
        self.refused_full = 0  # requests answered 503 (counted on request threads; read for tests and logs)
        handler = _handler(self._queue, max_body_bytes, self)
        try:
            self._server = ThreadingHTTPServer((host, port), handler)
        except OSError as exc:
            raise ValueError(f"cannot listen for OTLP/HTTP on {host}:{port}: {exc}") from None
        self._server.daemon_threads = True
        self.address = (host, self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="advise-otlp", daemon=True)
        self._thread.start()
        print(f"advise: OTLP/HTTP on http://{host}:{self.address[1]}{TRACES_PATH}", file=sys.stderr, flush=True)

    def drain(self) -> list[list[Span]]:
        """Every request decoded since the last call, in arrival order; never blocks."""
        taken = []
        while True:
            try:
                taken.append(self._queue.get_nowait())
            except queue.Empty:
                return taken

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _handler(inbox: queue.Queue[list[Span]], max_body_bytes: int, owner: OtlpInbox) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: exporters reuse their connection

        def do_POST(self) -> None:  # noqa: N802 (the standard library's name)
            if self.path.split("?", 1)[0] != TRACES_PATH:
                self._answer(404, f"no such path; export traces to {TRACES_PATH}", close=True)
                return
            content_type = self.headers.get_content_type()
            length = self.headers.get("Content-Length")
            if length is None or not length.isdigit():
                self._answer(411, "a Content-Length is required", close=True)
                return
            if int(length) > max_body_bytes:
                self._answer(413, f"body exceeds {max_body_bytes} bytes", close=True)  # not read: close
                return
            body = self.rfile.read(int(length))
            try:
                body = export_body(content_type, self.headers.get("Content-Encoding", ""), body, max_body_bytes)
                spans = spans_from_record(TRACE_FORMAT[content_type], body)
            except UnsupportedMedia as exc:
                self._answer(415, str(exc))
                return
            except BodyTooLarge as exc:
                self._answer(413, str(exc))
                return
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                self._answer(400, f"malformed OTLP request: {exc}")
                return
            try:
                inbox.put_nowait(spans)
            except queue.Full:
                owner.refused_full += 1
                self._answer(503, "the advisor is deciding a window; retry", retry_after=True)
                return
            self._answer(200, empty_answer(content_type), content_type=content_type)

        def do_GET(self) -> None:  # noqa: N802
            self._answer(405, f"POST OTLP traces to {TRACES_PATH}")

        def _answer(
            self,
            status: int,
            body: str | bytes,
            *,
            content_type: str = "text/plain; charset=utf-8",
            close: bool = False,
            retry_after: bool = False,
        ) -> None:
            data = body.encode() if isinstance(body, str) else body
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            if retry_after:
                self.send_header("Retry-After", str(RETRY_AFTER_S))
            if close:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the standard library's name)
            pass  # one line per export request would drown the advisor's own output

    return Handler
