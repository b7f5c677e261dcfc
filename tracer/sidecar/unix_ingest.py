"""The sidecar's Unix-socket server for workers' compact span frames (protocol: wire.py).

One accept thread and one thread per connection (at most `max_connections`; more are refused in the
handshake). A connection thread reads a frame, decodes it (msgspec validates every field) and offers it to
the IngestQueue; it never waits on export. A metrics snapshot frame goes to `on_snapshot(resource,
snapshot)` instead (it sets a few gauges: no queue), and `on_disconnect(resource)` runs when a handshaken
connection ends, so the worker's gauges can go with it. A malformed frame or handshake (or a snapshot
`on_snapshot` refuses with ValueError) closes that connection only, with one log line and a count in
`splitscope_tracer_dropped_records_total{reason="sidecar_bad_frame"}` (one per frame: its span count is
unknown).
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import threading
from collections.abc import Callable

from tracer.auth import token_ok
from tracer.sidecar import wire
from tracer.sidecar.ingest_queue import Batch, IngestQueue, resource_key

log = logging.getLogger(__name__)

DROP_BAD_FRAME = "sidecar_bad_frame"


class UnixIngestServer:
    def __init__(
        self,
        path: str | os.PathLike[str],
        queue: IngestQueue,
        *,
        token: str = "",
        max_connections: int = 256,
        on_drop: Callable[[str, int], None] | None = None,
        handshake_timeout_s: float = 5.0,
        on_snapshot: Callable[[tuple, wire.MetricsSnapshot], None] | None = None,
        on_disconnect: Callable[[tuple], None] | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self.queue = queue
        self.token = token
        self.max_connections = max_connections
        self._on_drop = on_drop
        self.handshake_timeout_s = handshake_timeout_s
        self._on_snapshot = on_snapshot
        self._on_disconnect = on_disconnect
        self._listener: socket.socket | None = None
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self.received_spans = 0
        self.bad_frames = 0

    def start(self) -> UnixIngestServer:
        """Bind and listen (raises OSError if another live sidecar holds the path), then accept on a thread."""
        _remove_stale_socket(self.path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.path)
        os.chmod(self.path, 0o660)  # the workers' user or group, nobody else
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept_loop, name="splitscope-sidecar-accept", daemon=True).start()
        return self

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # listener closed by stop()
            threading.Thread(target=self._serve, args=(conn,), name="splitscope-sidecar-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with self._lock:
            full = len(self._connections) >= self.max_connections
            if not full:
                self._connections.add(conn)
        try:
            if full:
                conn.sendall(wire.encode_answer(f"too many connections (max {self.max_connections})"))
                return
            resource = self._handshake(conn)
            if resource is None:
                return
            conn.settimeout(None)
            try:
                self._read_frames(conn, resource)
            finally:
                if self._on_disconnect is not None:
                    self._on_disconnect(resource)
        except OSError:
            pass  # the worker went away; nothing to answer
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    def _handshake(self, conn: socket.socket) -> tuple | None:
        conn.settimeout(self.handshake_timeout_s)
        reader = conn.makefile("rb")
        line = reader.readline(wire.HANDSHAKE_MAX_BYTES)
        reader.close()
        try:
            token, resource = wire.decode_handshake(line)
        except wire.WireError as exc:
            conn.sendall(wire.encode_answer(str(exc)))
            return None
        if not token_ok(self.token, token):
            log.warning("splitscope sidecar: refused a Unix-socket client with a wrong token")
            conn.sendall(wire.encode_answer("bad token"))
            return None
        conn.sendall(wire.encode_answer(None))
        return resource_key(resource)

    def _read_frames(self, conn: socket.socket, resource: tuple) -> None:
        header = bytearray(wire.FRAME_HEADER.size)
        while not self._stopping.is_set():
            if not _recv_exactly(conn, memoryview(header)):
                return  # clean close between frames
            (length,) = wire.FRAME_HEADER.unpack(header)
            if length > wire.MAX_FRAME_BYTES:
                self._bad_frame(f"frame of {length} bytes exceeds {wire.MAX_FRAME_BYTES}")
                return
            payload = bytearray(length)
            if not _recv_exactly(conn, memoryview(payload)):
                return
            try:
                spans = wire.decode_payload(payload)
                if isinstance(spans, wire.MetricsSnapshot):
                    if self._on_snapshot is not None:
                        self._on_snapshot(resource, spans)  # ValueError: a family or labels we do not take
                    continue
            except ValueError as exc:  # a WireError, or a snapshot on_snapshot refused
                self._bad_frame(str(exc))
                return
            self.received_spans += len(spans)
            self.queue.offer(Batch(resource, spans))

    def _bad_frame(self, reason: str) -> None:
        self.bad_frames += 1
        log.warning("splitscope sidecar: closing a Unix-socket client: %s", reason)
        if self._on_drop is not None:
            self._on_drop(DROP_BAD_FRAME, 1)

    def stop(self) -> None:
        self._stopping.set()
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            for conn in list(self._connections):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _recv_exactly(conn: socket.socket, view: memoryview) -> bool:
    """Fill `view`; False on EOF before the first byte, ConnectionError on EOF mid-way."""
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            if got == 0:
                return False
            raise ConnectionError("connection closed mid-frame")
        got += n
    return True


def _remove_stale_socket(path: str) -> None:
    """Remove a socket file left by a dead sidecar; refuse if one is alive or the path is not a socket."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise FileExistsError(f"{path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # nobody listening: stale
        return
    finally:
        probe.close()
    raise OSError(f"another sidecar is listening on {path}")
