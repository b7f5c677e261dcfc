"""SidecarSink: the worker's side of the Unix-socket ingest (a `tracer.pipeline.Sink`).

With it, a worker runs no OpenTelemetry SDK: its pipeline thread hands resolved spans here, they are
encoded into compact frames (wire.py) and a sender thread ships them to `splitscope sidecar`, which
exports them and keeps the span-derived metrics.

Contract (architecture.md §9: a dead sidecar never stalls serving):
- `emit` runs on the pipeline thread and never blocks: it encodes, appends to a buffer bounded by
  `max_buffered_spans`, and returns. When the buffer is full the oldest frames are dropped.
- The sender thread connects lazily, retries with exponential backoff (up to `max_backoff_s`) while the
  sidecar is absent, and reconnects after any error. A frame that fails mid-send is dropped, not resent
  (the sidecar discards a partial frame, and resending one it did read would duplicate spans).
- Every dropped span is reported through `on_drop(count)` (tracer.session counts them as
  `splitscope_tracer_dropped_records_total{reason="sidecar_unreachable"}`); it may be called from the
  pipeline thread or the sender thread.
- Metrics snapshots (`emit_snapshot`, the process's own gauges and counters: `MetricsShipper`) are not
  queued: only the latest is kept, sent before any span frame, and sent again after every reconnect, so a
  sidecar that restarts has every value again within one pipeline interval of the worker reconnecting.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tracer import spans as s
from tracer.resource import resource_attributes
from tracer.sidecar import wire
from tracer.sidecar.auth import TOKEN_ENV

if TYPE_CHECKING:
    from prometheus_client import Counter, Gauge

log = logging.getLogger(__name__)


class SidecarSink:
    def __init__(
        self,
        socket_path: str | os.PathLike[str],
        on_drop: Callable[[int], None] | None = None,
        *,
        resource: dict[str, Any] | None = None,
        token: str | None = None,
        max_buffered_spans: int = 65536,
        connect_timeout_s: float = 1.0,
        send_timeout_s: float = 5.0,
        max_backoff_s: float = 1.0,
    ) -> None:
        self.socket_path = os.fspath(socket_path)
        self._on_drop = on_drop
        self._resource = resource
        self._token = os.environ.get(TOKEN_ENV, "") if token is None else token
        self.max_buffered_spans = max_buffered_spans
        self.connect_timeout_s = connect_timeout_s
        self.send_timeout_s = send_timeout_s
        self.max_backoff_s = max_backoff_s
        self._frames: deque[tuple[bytes, int]] = deque()
        self._buffered_spans = 0
        self._snapshot: bytes | None = None  # the latest metrics snapshot frame
        self._snapshot_due = False  # not yet sent on the current connection
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._stopping = threading.Event()
        self._sock: socket.socket | None = None
        self.sent_spans = 0
        self.dropped_spans = 0
        self.connects = 0
        self.last_error = ""
        self._thread = threading.Thread(target=self._run, name="splitscope-sidecar-sink", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ pipeline thread

    def emit(self, batch: Sequence[s.SpanData]) -> None:
        """Queue `batch` for the sidecar. Never blocks; drops (counted) when the buffer is full."""
        if not batch:
            return
        frames = []
        for i in range(0, len(batch), wire.MAX_RECORDS_PER_FRAME):
            chunk = batch[i : i + wire.MAX_RECORDS_PER_FRAME]
            try:
                frames.append((wire.encode_frame(chunk), len(chunk)))
            except (TypeError, OverflowError, ValueError) as exc:  # an attribute MessagePack cannot carry
                log.warning("splitscope sidecar sink: dropping %d spans that cannot be encoded: %s", len(chunk), exc)
                self._drop(len(chunk))
        dropped = 0
        with self._lock:
            for frame in frames:
                self._frames.append(frame)
                self._buffered_spans += frame[1]
            while self._buffered_spans > self.max_buffered_spans and len(self._frames) > 1:
                _, n = self._frames.popleft()
                self._buffered_spans -= n
                dropped += n
            self._wakeup.notify()
        if dropped:
            self._drop(dropped)

    def emit_snapshot(self, samples: Sequence[tuple[str, dict[str, str], float]]) -> None:
        """Send `samples` (family, labels, value) as the process's current metric values, replacing any
        snapshot not yet sent. Never blocks."""
        frame = wire.encode_snapshot(samples)
        with self._lock:
            self._snapshot, self._snapshot_due = frame, True
            self._wakeup.notify()

    # ------------------------------------------------------------------ sender thread

    def _run(self) -> None:
        backoff_s = 0.02
        while True:
            with self._lock:
                while not self._frames and not self._snapshot_due and not self._stopping.is_set():
                    self._wakeup.wait()
                if not self._frames and not self._snapshot_due:
                    break  # stopping, nothing left
            if self._sock is None:
                if not self._connect():
                    if self._stopping.wait(backoff_s):
                        break
                    backoff_s = min(backoff_s * 2, self.max_backoff_s)
                    continue
                backoff_s = 0.02
            with self._lock:
                if self._snapshot_due and self._snapshot is not None:
                    frame, n = self._snapshot, 0
                    self._snapshot_due = False
                elif self._frames:
                    frame, n = self._frames.popleft()
                    self._buffered_spans -= n
                else:
                    continue
            sock = self._sock
            assert sock is not None  # connected above; only this thread closes it
            try:
                sock.sendall(frame)
                self.sent_spans += n
            except OSError as exc:
                self.last_error = f"send failed: {exc}"
                self._close()
                self._drop(n)
        self._close()

    def _connect(self) -> bool:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.connect_timeout_s)
            sock.connect(self.socket_path)
            sock.sendall(wire.encode_handshake(self._token, self._resource_attributes()))
            answer = _read_line(sock, wire.HANDSHAKE_MAX_BYTES)
            refusal = wire.decode_answer(answer)
            if refusal is not None:
                raise ConnectionRefusedError(f"sidecar refused the handshake: {refusal}")
            sock.settimeout(self.send_timeout_s)
        except OSError as exc:
            if str(exc) != self.last_error:
                log.info("splitscope sidecar sink: %s unreachable (%s); buffering and retrying", self.socket_path, exc)
            self.last_error = str(exc)
            sock.close()
            return False
        self._sock = sock
        self.connects += 1
        self.last_error = ""
        with self._lock:  # a new connection may be a new sidecar: it has none of our values yet
            self._snapshot_due = self._snapshot is not None
        return True

    def _resource_attributes(self) -> dict[str, Any]:
        if self._resource is None:  # a sink built on its own: our defaults and the OTEL_* environment
            self._resource = resource_attributes()
        return self._resource

    def _close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    def _drop(self, n: int) -> None:
        self.dropped_spans += n
        if self._on_drop is not None:
            self._on_drop(n)

    # ------------------------------------------------------------------ any thread

    @property
    def connected(self) -> bool:
        return self._sock is not None

    @property
    def buffered_spans(self) -> int:
        return self._buffered_spans

    def shutdown(self, timeout_s: float) -> None:
        """Send what is buffered for up to `timeout_s`, then stop; what is left is counted as dropped."""
        self._stopping.set()
        with self._lock:
            self._wakeup.notify_all()
        self._thread.join(timeout_s)
        with self._lock:
            left = sum(n for _, n in self._frames)
            self._frames.clear()
            self._buffered_spans = 0
        if left:
            self._drop(left)


def _read_line(sock: socket.socket, limit: int) -> bytes:
    data = bytearray()
    while not data.endswith(b"\n"):
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionError("sidecar closed the connection during the handshake")
        data += chunk
        if len(data) > limit:
            raise ConnectionError("handshake answer too long")
    return bytes(data)


class MetricsShipper:
    """Sends a process's own gauges and counters (`Catalogue.process_set()`) to the sidecar when they change.

    `ship()` runs on the pipeline thread after each drain (tracer.session wires it): it collects the ten
    families (13 samples for a worker; about 0.15 ms here, mostly prometheus_client building its sample
    objects: 0.15% of a core at the pipeline's 10 drains a second) and hands the sink a snapshot only when
    a value moved since the last one, so an idle worker sends nothing.
    """

    def __init__(self, sink: SidecarSink, families: Mapping[str, Gauge | Counter]) -> None:
        self.sink = sink
        self.families = dict(families)
        self._last: list[tuple[str, dict[str, str], float]] | None = None

    def snapshot(self) -> list[tuple[str, dict[str, str], float]]:
        """(family, labels, value) of every series of the families: a counter's running total, a gauge's value."""
        out: list[tuple[str, dict[str, str], float]] = []
        for name, metric in self.families.items():
            for family in metric.collect():
                value_sample = name + "_total" if family.type == "counter" else name
                out.extend((name, x.labels, x.value) for x in family.samples if x.name == value_sample)
        return out

    def ship(self) -> None:
        samples = self.snapshot()
        if samples != self._last:
            self.sink.emit_snapshot(samples)
            self._last = samples
