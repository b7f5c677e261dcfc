"""One streamed completion request and what the client measured about it.

`CompletionClient.send` runs on the runner's event loop; it never raises for a failed request (the
failure is classified into `RequestMeasurement.error_kind`), only for bugs. Times are seconds on the run's
clock (`clock()`: perf_counter seconds since the run started).

Token accounting follows OpenAI streaming: an SSE event `data: {...}` whose `choices[0].text` is
non-empty is one output chunk; `data: [DONE]` ends the stream. Engines normally send one token per
chunk; when the server also sends `usage` (we ask with `stream_options.include_usage`), its
`completion_tokens` is taken as the output token count, and inter-token gaps stay per chunk.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
from aiohttp.http_exceptions import HttpProcessingError

from tracer.context import TraceContext, new_span_id, new_trace_id
from tracer.load.workload import PlannedRequest

# Error kinds (the values of RequestMeasurement.error_kind).
HTTP_4XX = "http_4xx"  # also any other non-2xx, non-5xx status
HTTP_5XX = "http_5xx"
CONNECT = "connect"  # no response status received: refused, reset, DNS, TLS
STREAM_CLOSED = "stream_closed"  # the stream ended or broke before `data: [DONE]`
TIMEOUT = "timeout"  # the whole request exceeded --timeout
BAD_EVENT = "bad_event"  # an event that is not valid OpenAI streaming JSON, or an error event
INFLIGHT_CAP = "inflight_cap"  # never sent: --max-inflight requests were already in flight
ERROR_KINDS = (HTTP_4XX, HTTP_5XX, CONNECT, STREAM_CLOSED, TIMEOUT, BAD_EVENT)

OK = "ok"
ERROR = "error"
SKIPPED = "skipped"
CANCELLED = "cancelled"  # sent, then abandoned by the run itself (a stop that cancels requests in flight)

_ERROR_BODY_BYTES = 300


@dataclass
class RequestMeasurement:
    """Client-side measurements of one request. Durations in seconds; None where not reached.

    `scheduled_s`/`sent_s` are offsets from the run start; `lag_s` = sent_s - scheduled_s (how far the
    client was behind its schedule). `ttft_s` and `e2e_s` are measured from `sent_s`; `itl_s` lists the
    gaps between successive output chunks; `tpot_s` = (e2e_s - ttft_s) / (output_tokens - 1).
    """

    index: int
    source: str
    session: str | None
    scheduled_s: float
    prompt_tokens: int
    requested_output_tokens: int
    trace_id: str | None = None
    status: str = OK
    error_kind: str | None = None
    error_detail: str | None = None
    http_status: int | None = None
    sent_s: float | None = None
    lag_s: float | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    tpot_s: float | None = None
    output_chunks: int = 0
    output_tokens: int = 0
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    itl_s: list[float] = field(default_factory=list)

    @classmethod
    def planned(cls, planned: PlannedRequest) -> RequestMeasurement:
        return cls(
            index=planned.index,
            source=planned.source,
            session=planned.session,
            scheduled_s=planned.arrival_s,
            prompt_tokens=planned.prompt_tokens,
            requested_output_tokens=planned.output_tokens,
        )

    def fail(self, kind: str, detail: str) -> None:
        self.status = SKIPPED if kind == INFLIGHT_CAP else ERROR
        self.error_kind = kind
        self.error_detail = detail[:_ERROR_BODY_BYTES]

    def cancel(self) -> None:
        """The run, not the server, ended this request: neither a success nor an error (no error kind)."""
        self.status = CANCELLED
        self.error_kind = None
        self.error_detail = "cancelled: the run was stopped before the answer ended"


class _StreamError(Exception):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


def new_traceparent() -> tuple[str, dict[str, str]]:
    """A fresh sampled W3C trace context: (trace id as 32 hex digits, headers carrying `traceparent`).
    The request's parent is a span the client never exports: the server's root span hangs under it."""
    context = TraceContext(new_trace_id(), new_span_id())
    return f"{context.trace_id:032x}", {"traceparent": context.traceparent()}


class CompletionClient:
    """Sends streamed /v1/completions requests over one shared aiohttp session."""

    def __init__(
        self, session: aiohttp.ClientSession, *, endpoint: str, model: str, timeout_s: float, clock: Callable[[], float]
    ) -> None:
        self._session = session
        self._endpoint = endpoint
        self._model = model
        self._timeout_s = timeout_s
        self._clock = clock

    async def send(self, planned: PlannedRequest, prompt: str) -> RequestMeasurement:
        """Send one request and stream its answer to the end; returns its record (never raises on failure)."""
        record = RequestMeasurement.planned(planned)
        await self.fill(record, prompt)
        return record

    async def fill(self, record: RequestMeasurement, prompt: str) -> None:
        """Send the request `record` plans and stream its answer into `record` (never raises on failure).

        Cancelling the calling task ends the request at once (the connection is closed): `record` then says
        status `cancelled`, keeps what was measured until then, and the CancelledError propagates.
        """
        record.trace_id, headers = new_traceparent()
        body = {
            "model": self._model,
            "prompt": prompt,
            "max_tokens": record.requested_output_tokens,
            # Fixed-length outputs: vLLM and SGLang honour these; other servers may ignore or reject them.
            "min_tokens": record.requested_output_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if record.session is not None:
            body["user"] = record.session
        record.sent_s = self._clock()
        record.lag_s = record.sent_s - record.scheduled_s
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._exchange(body, headers, record)
        except TimeoutError:
            record.fail(TIMEOUT, f"no complete answer within {self._timeout_s:g} s")
        except _StreamError as exc:
            record.fail(exc.kind, str(exc))
        except asyncio.CancelledError:
            record.cancel()
            raise
        finally:
            record.output_tokens = record.usage_completion_tokens or record.output_chunks
        if record.status == OK and record.ttft_s is not None and record.e2e_s is not None and record.output_tokens > 1:
            record.tpot_s = (record.e2e_s - record.ttft_s) / (record.output_tokens - 1)

    async def _exchange(self, body: dict, headers: dict[str, str], record: RequestMeasurement) -> None:
        try:
            async with self._session.post(self._endpoint, json=body, headers=headers) as response:
                record.http_status = response.status
                if response.status >= 300:
                    kind = HTTP_5XX if response.status >= 500 else HTTP_4XX
                    raise _StreamError(kind, f"HTTP {response.status}: {await _error_body(response)}")
                if "text/event-stream" not in response.headers.get("Content-Type", ""):
                    raise _StreamError(BAD_EVENT, f"response is not an event stream ({response.content_type})")
                await self._read_stream(response, record)
        except (aiohttp.ClientError, OSError) as exc:
            # Before a status line arrived the server was never reached properly; after, the stream broke.
            kind = CONNECT if record.http_status is None else STREAM_CLOSED
            raise _StreamError(kind, f"{type(exc).__name__}: {exc}") from None

    async def _read_stream(self, response: aiohttp.ClientResponse, record: RequestMeasurement) -> None:
        assert record.sent_s is not None
        last_chunk_s: float | None = None
        while True:
            try:
                line = await response.content.readline()
            except (ValueError, HttpProcessingError) as exc:
                # aiohttp refuses a line beyond its buffer limit (ValueError before 3.10, LineTooLong since).
                raise _StreamError(BAD_EVENT, f"event line too long: {str(exc)[:120]}") from None
            if not line:
                raise _StreamError(STREAM_CLOSED, f"stream ended without [DONE] after {record.output_chunks} chunks")
            now_s = self._clock()
            data = _sse_data(line)
            if data is None:
                continue
            if data == "[DONE]":
                record.e2e_s = now_s - record.sent_s
                return
            if _apply_event(data, record):
                if last_chunk_s is None:
                    record.ttft_s = now_s - record.sent_s
                else:
                    record.itl_s.append(now_s - last_chunk_s)
                last_chunk_s = now_s


def _sse_data(line: bytes) -> str | None:
    """The payload of a `data:` line, else None (blank lines, comments, `event:`/`id:` fields).

    OpenAI-compatible servers put each JSON event on one `data:` line, so events are taken per line.
    """
    text = line.decode("utf-8", errors="replace").rstrip("\r\n")
    if not text.startswith("data:"):
        return None
    payload = text[5:]
    return payload[1:] if payload.startswith(" ") else payload


def _apply_event(data: str, record: RequestMeasurement) -> bool:
    """Fold one event into `record`; True when it carried output text (one chunk)."""
    try:
        event = json.loads(data)
    except json.JSONDecodeError as exc:
        raise _StreamError(BAD_EVENT, f"event is not JSON ({exc.msg}): {data[:80]!r}") from None
    if not isinstance(event, dict):
        raise _StreamError(BAD_EVENT, f"event is not a JSON object: {data[:80]!r}")
    if "error" in event:
        raise _StreamError(BAD_EVENT, f"error event: {json.dumps(event['error'])[:200]}")
    usage = event.get("usage")
    if isinstance(usage, dict):
        record.usage_prompt_tokens = _int_or_none(usage.get("prompt_tokens"))
        record.usage_completion_tokens = _int_or_none(usage.get("completion_tokens"))
    choices = event.get("choices")
    if choices is None and usage is not None:
        return False
    if not isinstance(choices, list):
        raise _StreamError(BAD_EVENT, f"event without a choices list: {data[:80]!r}")
    if not choices:
        return False
    first = choices[0]
    if not isinstance(first, dict) or not isinstance(first.get("text", ""), str):
        raise _StreamError(BAD_EVENT, f"choices[0].text is not a string: {data[:80]!r}")
    if first.get("text"):
        record.output_chunks += 1
        return True
    return False


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


async def _error_body(response: aiohttp.ClientResponse) -> str:
    try:
        raw = await response.content.read(_ERROR_BODY_BYTES)
    except (aiohttp.ClientError, OSError):
        return "(body unreadable)"
    return raw.decode("utf-8", errors="replace").strip() or response.reason or ""
