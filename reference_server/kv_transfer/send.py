"""KV transfer, sending side: ``KVSender`` stripes a request's blocks over N persistent TCP streams.

Connections are kept per receiver (a small idle pool): a transfer then starts with no TCP handshake and
no clock exchange on the time-to-first-token path, only one round trip per stream for the header. The
clock offset is measured on the first transfer to a receiver and refreshed every ``clock_refresh_s``.
Shares are contiguous slices of the request's block list, so consecutive block ids leave as one
``sendall`` straight from the pool's memory.
"""

from __future__ import annotations

import operator
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass, replace
from typing import Any

import torch

from reference_server.kv_transfer.clock import ClockEstimate, best_estimate
from reference_server.kv_transfer.pool import PoolBytes, pool_bytes
from reference_server.kv_transfer.wire import (
    ABORTED,
    MAX_REQUEST_ID_CHARS,
    MAX_STREAMS,
    PAYLOAD_BATCH_BYTES,
    TRACEPARENT_PATTERN,
    KVTransferError,
    StreamHeader,
    bulk_mode,
    clock_message,
    encode_frame,
    expect_reply,
    io_errors,
    new_checksum,
    read_frame,
    reply_int,
    send_frame,
    sendmsg_all,
    token_from_env,
    trailer_message,
    tune_socket,
)

DEFAULT_STREAMS = 4

ClockNs = Callable[[], int]


@dataclass(frozen=True, slots=True)
class TransferResult:
    """What ``KVSender.send`` moved. Wall times are on the sender's clock (``time.time_ns``-like, ns)."""

    request_id: str
    transfer_id: str
    dst: str  # "host:port" of the receiver
    kv_bytes: int
    blocks: int
    block_tokens: int
    streams: int
    start_wall_ns: int  # send() began (before connections were taken)
    end_wall_ns: int  # the receiver had acknowledged every stream
    clock_offset_ns: int  # receiver clock minus sender clock
    clock_delay_ns: int  # round trip of the clock sample the offset came from
    receiver_end_wall_ns: int  # the receiver's last byte checked, moved onto the sender's clock

    @property
    def duration_s(self) -> float:
        return (self.end_wall_ns - self.start_wall_ns) / 1e9


class _PeerConnections:
    """Idle persistent connections to one receiver, and its latest clock estimate. Thread-safe."""

    def __init__(
        self,
        address: tuple[str, int],
        *,
        connect_timeout_s: float,
        io_timeout_s: float,
        max_idle: int,
        max_idle_s: float,
        socket_buffer_bytes: int | None,
    ) -> None:
        self.address = address
        self._connect_timeout_s = connect_timeout_s
        self._io_timeout_s = io_timeout_s
        self._max_idle = max_idle
        self._max_idle_s = max_idle_s
        self._socket_buffer_bytes = socket_buffer_bytes
        self._idle: deque[tuple[socket.socket, float]] = deque()
        self._lock = threading.Lock()
        self.clock: ClockEstimate | None = None
        self.clock_lock = threading.Lock()

    def checkout(self) -> socket.socket:
        """A connection for one stream: the freshest idle one that is still open, else a new one."""
        while True:
            with self._lock:
                if not self._idle:
                    break
                sock, idle_since = self._idle.pop()
            if time.monotonic() - idle_since <= self._max_idle_s and self._still_open(sock):
                return sock
            sock.close()
        with io_errors():
            sock = socket.create_connection(self.address, timeout=self._connect_timeout_s)
        tune_socket(sock, self._socket_buffer_bytes)
        sock.settimeout(self._io_timeout_s)
        return sock

    def checkin(self, sock: socket.socket) -> None:
        """Return a connection whose last exchange completed cleanly; closes it if the pool is full."""
        with self._lock:
            if len(self._idle) < self._max_idle:
                self._idle.append((sock, time.monotonic()))
                return
        sock.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = list(self._idle), deque()
        for sock, _ in idle:
            sock.close()

    def _still_open(self, sock: socket.socket) -> bool:
        # A receiver that closed an idle connection (restart, idle timeout) left EOF in it; anything else
        # readable is out of protocol. Either way the connection is not reused.
        try:
            sock.setblocking(False)
            try:
                sock.recv(1, socket.MSG_PEEK)
            except BlockingIOError:
                return True
            except OSError:
                return False
            return False
        finally:
            try:
                sock.settimeout(self._io_timeout_s)
            except OSError:
                pass


class KVSender:
    """Sends KV blocks to ``KVReceiver``s. Thread-safe: one instance serves all of a worker's transfer threads.

    ``send`` blocks its caller (a worker's transfer thread, never the engine loop) for the whole transfer;
    streams after the first run on this sender's thread pool (``max_parallel_streams`` threads; its queue
    holds at most callers x (streams - 1) items because every caller waits for its own streams).
    ``token`` (default: ``SPLITSCOPE_KV_TOKEN``) is sent with every frame when set.
    """

    def __init__(
        self,
        *,
        streams: int = DEFAULT_STREAMS,
        token: str | None = None,
        clock_ns: ClockNs = time.time_ns,
        connect_timeout_s: float = 5.0,
        io_timeout_s: float = 30.0,
        clock_refresh_s: float = 30.0,
        clock_samples: int = 5,
        max_idle_per_peer: int = 16,
        max_idle_s: float = 60.0,
        max_parallel_streams: int = 64,
        socket_buffer_bytes: int | None = None,
    ) -> None:
        if not 1 <= streams <= MAX_STREAMS:
            raise ValueError(f"streams must be in [1, {MAX_STREAMS}], got {streams}")
        if clock_samples < 1:
            raise ValueError("clock_samples must be at least 1")
        self._streams = streams
        self._token = token if token is not None else token_from_env()
        self._clock_ns = clock_ns
        self._connect_timeout_s = connect_timeout_s
        self._io_timeout_s = io_timeout_s
        self._clock_refresh_ns = int(clock_refresh_s * 1e9)
        self._clock_samples = clock_samples
        self._max_idle_per_peer = max_idle_per_peer
        self._max_idle_s = max_idle_s
        self._socket_buffer_bytes = socket_buffer_bytes
        self._executor = ThreadPoolExecutor(max_workers=max_parallel_streams, thread_name_prefix="kv-send")
        self._peers: dict[tuple[str, int], _PeerConnections] = {}
        self._pool_access: dict[tuple[Any, ...], PoolBytes] = {}
        self._lock = threading.Lock()
        self._closed = False

    # -- public

    def send(
        self,
        request_id: str,
        pool: torch.Tensor,
        block_ids: Sequence[int],
        dst: tuple[str, int],
        traceparent: str | None = None,
        meta: dict[str, Any] | None = None,
        *,
        streams: int | None = None,
    ) -> TransferResult:
        """Move ``pool[block_ids]`` to the receiver at ``dst``, in that order; blocks until it acknowledged.

        ``meta`` (small JSON fields the decode worker needs) and ``traceparent`` travel in every stream's
        header. Raises ValueError for bad arguments (nothing sent), KVTransferError(reason) when the
        transfer fails; either way the caller still owns, and frees, the source blocks.
        """
        if self._closed:
            raise ValueError("KVSender is closed")
        access = self._access(pool)
        layout = access.layout
        ids = _checked_block_ids(block_ids, layout.num_blocks)
        _check_request(request_id, traceparent, meta, dst)
        wanted_streams = self._streams if streams is None else streams
        if not 1 <= wanted_streams <= MAX_STREAMS:
            raise ValueError(f"streams must be in [1, {MAX_STREAMS}], got {wanted_streams}")
        stream_count = min(wanted_streams, len(ids))
        shares = [ids[len(ids) * k // stream_count : len(ids) * (k + 1) // stream_count] for k in range(stream_count)]
        starts = [len(ids) * k // stream_count for k in range(stream_count)]

        start_wall_ns = self._clock_ns()
        transfer_id = secrets.token_hex(16)
        headers = [
            StreamHeader(
                transfer_id=transfer_id,
                request_id=request_id,
                traceparent=traceparent,
                dtype=layout.dtype,
                block_shape=layout.block_shape,
                block_bytes=layout.block_bytes,
                n_blocks=len(ids),
                n_streams=stream_count,
                stream=k,
                positions=tuple(range(starts[k], starts[k] + len(shares[k]))),
                src_block_ids=tuple(shares[k]),
                nbytes=len(shares[k]) * layout.block_bytes,
                sent_wall_ns=start_wall_ns,
                clock_offset_ns=0,
                clock_delay_ns=0,
                meta=meta or {},
                token=self._token,
            )
            for k in range(stream_count)
        ]
        for header in headers:
            encode_frame(header.to_wire())  # ValueError (not JSON, too large) before anything is sent

        peer = self._peer(dst)
        connections = self._checkout(peer, stream_count)
        try:
            clock = self._clock_estimate(peer, connections[0])
        except KVTransferError:
            connections[0].close()
            for sock in connections[1:]:
                peer.checkin(sock)
            raise
        frames = [
            encode_frame(replace(header, clock_offset_ns=clock.offset_ns, clock_delay_ns=clock.delay_ns).to_wire())
            for header in headers
        ]
        futures = [
            self._executor.submit(self._run_stream, connections[k], frames[k], transfer_id, k, shares[k], access)
            for k in range(1, stream_count)
        ]
        outcomes = [self._run_stream(connections[0], frames[0], transfer_id, 0, shares[0], access)]
        outcomes += [future.result() for future in futures]

        errors = [outcome for outcome in outcomes if isinstance(outcome, KVTransferError)]
        for sock, outcome in zip(connections, outcomes):
            if isinstance(outcome, KVTransferError):
                sock.close()
            else:
                peer.checkin(sock)
        if errors:
            raise min(errors, key=lambda error: _REASON_PRIORITY[error.reason])
        end_wall_ns = self._clock_ns()
        receiver_end_ns = max(reply_int(outcome, "recv_end_ns") for outcome in outcomes if isinstance(outcome, dict))
        return TransferResult(
            request_id=request_id,
            transfer_id=transfer_id,
            dst=f"{dst[0]}:{dst[1]}",
            kv_bytes=len(ids) * layout.block_bytes,
            blocks=len(ids),
            block_tokens=layout.block_tokens,
            streams=stream_count,
            start_wall_ns=start_wall_ns,
            end_wall_ns=end_wall_ns,
            clock_offset_ns=clock.offset_ns,
            clock_delay_ns=clock.delay_ns,
            receiver_end_wall_ns=clock.receiver_to_sender_ns(receiver_end_ns),
        )

    def clock_estimate(self, dst: tuple[str, int], *, refresh: bool = False) -> ClockEstimate:
        """The receiver's clock offset (cached per receiver); measures it now if stale, absent or ``refresh``.

        Blocking; raises KVTransferError if the receiver cannot be reached.
        """
        peer = self._peer(dst)
        if refresh:
            with peer.clock_lock:
                peer.clock = None
        sock = peer.checkout()
        try:
            estimate = self._clock_estimate(peer, sock)
        except KVTransferError:
            sock.close()
            raise
        peer.checkin(sock)
        return estimate

    def close(self) -> None:
        """Close idle connections and stop the stream threads; sends in flight finish first."""
        self._closed = True
        self._executor.shutdown(wait=True)
        with self._lock:
            peers = list(self._peers.values())
            self._peers.clear()
            self._pool_access.clear()
        for peer in peers:
            peer.close()

    def __enter__(self) -> KVSender:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals

    def _access(self, pool: torch.Tensor) -> PoolBytes:
        # Pools live as long as their worker; cache their byte access (CUDA's holds pinned staging memory).
        key = (pool.data_ptr(), pool.device, tuple(pool.shape), pool.dtype)
        with self._lock:
            access = self._pool_access.get(key)
            if access is None:
                if len(self._pool_access) >= 4:
                    self._pool_access.clear()
                access = self._pool_access[key] = pool_bytes(pool)
            return access

    def _peer(self, dst: tuple[str, int]) -> _PeerConnections:
        with self._lock:
            peer = self._peers.get(dst)
            if peer is None:
                peer = self._peers[dst] = _PeerConnections(
                    dst,
                    connect_timeout_s=self._connect_timeout_s,
                    io_timeout_s=self._io_timeout_s,
                    max_idle=self._max_idle_per_peer,
                    max_idle_s=self._max_idle_s,
                    socket_buffer_bytes=self._socket_buffer_bytes,
                )
            return peer

    @staticmethod
    def _checkout(peer: _PeerConnections, count: int) -> list[socket.socket]:
        connections: list[socket.socket] = []
        try:
            for _ in range(count):
                connections.append(peer.checkout())
        except KVTransferError:
            for sock in connections:
                peer.checkin(sock)  # untouched by this transfer, still clean
            raise
        return connections

    def _clock_estimate(self, peer: _PeerConnections, sock: socket.socket) -> ClockEstimate:
        with peer.clock_lock:
            estimate = peer.clock
            if estimate is not None and self._clock_ns() - estimate.measured_wall_ns < self._clock_refresh_ns:
                return estimate
            samples = []
            with io_errors():
                for _ in range(self._clock_samples):
                    t0_ns = self._clock_ns()
                    send_frame(sock, clock_message(t0_ns, self._token))
                    reply = expect_reply(read_frame(sock), "clock_reply")
                    t3_ns = self._clock_ns()
                    samples.append((t0_ns, reply_int(reply, "t1"), reply_int(reply, "t2"), t3_ns))
            peer.clock = best_estimate(samples)
            return peer.clock

    @staticmethod
    def _run_stream(
        sock: socket.socket,
        header_frame: bytes,
        transfer_id: str,
        stream: int,
        src_block_ids: list[int],
        access: PoolBytes,
    ) -> dict[str, Any] | KVTransferError:
        """One stream, on the caller's thread or a pool thread: the receiver's ``done`` answer, or the error."""
        try:
            with io_errors():
                sock.sendall(header_frame)
                expect_reply(read_frame(sock), "ready")
                checksum = new_checksum()
                batches = access.read_batches(src_block_ids, PAYLOAD_BATCH_BYTES)
                with closing(batches), bulk_mode(sock):
                    for batch in batches:
                        sendmsg_all(sock, batch[:])
                        for piece in batch:  # just copied by the kernel: still in cache
                            checksum.update(piece)
                send_frame(sock, trailer_message(transfer_id, stream, checksum.intdigest()))
                return expect_reply(read_frame(sock), "done")
        except KVTransferError as error:
            return error


# The receiver's own verdicts explain a failure better than the broken connections that follow them.
_REASON_PRIORITY = {
    reason: rank
    for rank, reason in enumerate(
        (ABORTED, "unauthorized", "bad_header", "checksum", "refused", "timeout", "connection")
    )
}


def _checked_block_ids(block_ids: Sequence[int], num_blocks: int) -> list[int]:
    try:
        ids = [operator.index(block_id) for block_id in block_ids]
    except TypeError:
        raise ValueError("block_ids must be integers") from None
    if not ids:
        raise ValueError("block_ids is empty")
    if len(set(ids)) != len(ids):
        raise ValueError("block_ids has repeats")
    out_of_range = [block_id for block_id in ids if not 0 <= block_id < num_blocks]
    if out_of_range:
        raise ValueError(f"block ids {out_of_range[:8]} are outside the pool's {num_blocks} blocks")
    return ids


def _check_request(request_id: str, traceparent: str | None, meta: dict[str, Any] | None, dst: Any) -> None:
    if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_REQUEST_ID_CHARS:
        raise ValueError(f"request_id must be a string of 1 to {MAX_REQUEST_ID_CHARS} characters")
    if traceparent is not None and not (isinstance(traceparent, str) and TRACEPARENT_PATTERN.fullmatch(traceparent)):
        raise ValueError(f"traceparent must be a W3C traceparent string, got {traceparent!r}")
    if meta is not None and not isinstance(meta, dict):
        raise ValueError("meta must be a dict of JSON values")
    if not (isinstance(dst, tuple) and len(dst) == 2 and isinstance(dst[0], str) and isinstance(dst[1], int)):
        raise ValueError(f"dst must be (host, port), got {dst!r}")
