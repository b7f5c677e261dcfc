"""KV cache transfer from a prefill worker's pool to a decode worker's pool over parallel TCP streams.

``KVSender.send`` stripes a request's blocks over N streams (contiguous shares, so consecutive block ids
go out as one ``sendall``); ``KVReceiver`` allocates destination blocks when a transfer's first header
arrives and ``recv_into``s each share straight into its pool. Wire format and validation:
transfer_wire.py; clock offset: transfer_clock.py; byte access to pools: transfer_pool.py.

Failure contract: a checksum mismatch, a dropped connection, a timeout or a refused header fails the whole
transfer. The receiver frees its destination blocks (once no stream writes into them any more) and calls
``on_failed``; the sender raises ``KVTransferError(reason)`` and its caller frees the source blocks.

Connections are persistent (a small idle pool per receiver): a transfer then starts with no TCP handshake
and no clock exchange on the time-to-first-token path, only one round trip per stream for the header.
The clock offset is measured on the first transfer to a receiver and refreshed every ``clock_refresh_s``.
"""

from __future__ import annotations

import logging
import operator
import os
import secrets
import selectors
import socket
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

import torch

from reference_server.transfer_clock import ClockEstimate, best_estimate
from reference_server.transfer_pool import PoolBytes, pool_bytes
from reference_server.transfer_wire import (
    FAILURE_REASONS,
    MAX_REQUEST_ID_CHARS,
    MAX_STREAMS,
    KVTransferError,
    StreamHeader,
    TransferAborted,
    clock_message,
    encode_frame,
    error_message,
    expect_reply,
    io_errors,
    new_checksum,
    parse_clock,
    parse_trailer,
    read_frame,
    recv_exactly_into,
    reply_int,
    reply_message,
    send_frame,
    token_matches,
    trailer_message,
)

__all__ = [
    "DEFAULT_STREAMS",
    "FAILURE_REASONS",
    "TOKEN_ENV_VAR",
    "ClockEstimate",
    "KVReceiver",
    "KVSender",
    "KVTransferError",
    "ReceiveInfo",
    "TransferResult",
]

logger = logging.getLogger(__name__)

TOKEN_ENV_VAR = "SPLITSCOPE_KV_TOKEN"
DEFAULT_STREAMS = 4
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
_FAILED_TRANSFERS_REMEMBERED = 1024
_TRACEPARENT_CHARS = 55

AllocateBlocks = Callable[[int], "Sequence[int] | None"]
FreeBlocks = Callable[[Sequence[int]], None]
ClockNs = Callable[[], int]


def token_from_env() -> str | None:
    """The shared secret from ``SPLITSCOPE_KV_TOKEN``, or None when unset or empty."""
    return os.environ.get(TOKEN_ENV_VAR) or None


def _tune(sock: socket.socket, buffer_bytes: int | None) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # None leaves the kernel's buffer autotuning on; a fixed size turns it off (and is capped by rmem_max).
    if buffer_bytes is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)


# ------------------------------------------------------------------------------------------------ results


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

    @property
    def throughput_bytes_per_s(self) -> float:
        return self.kv_bytes / max(self.duration_s, 1e-9)


@dataclass(frozen=True, slots=True)
class ReceiveInfo:
    """What ``KVReceiver`` hands ``on_complete`` besides the blocks: trace context, sizes and timing.

    ``recv_*`` are on the receiver's clock, ``sender_start_wall_ns`` on the sender's; ``clock_offset_ns``
    (receiver minus sender, measured by the sender) moves one onto the other.
    """

    transfer_id: str
    traceparent: str | None
    src: str  # "host:port" the first stream came from
    kv_bytes: int
    blocks: int
    block_tokens: int
    streams: int
    recv_start_wall_ns: int  # the first stream's header arrived
    recv_end_wall_ns: int  # the last stream's bytes were checked
    sender_start_wall_ns: int  # the sender began (sender's clock)
    clock_offset_ns: int
    clock_delay_ns: int

    @property
    def sender_start_receiver_clock_ns(self) -> int:
        return self.sender_start_wall_ns + self.clock_offset_ns

    @property
    def duration_s(self) -> float:
        """Offset-corrected transfer time: sender's start to the receiver's last byte checked."""
        return (self.recv_end_wall_ns - self.sender_start_receiver_clock_ns) / 1e9


OnComplete = Callable[[str, list[int], dict[str, Any], ReceiveInfo], None]
OnFailed = Callable[[str, str], None]


# ------------------------------------------------------------------------------------------------ sender


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
        _tune(sock, self._socket_buffer_bytes)
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
            encode_frame(
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
                    clock_offset_ns=clock.offset_ns,
                    clock_delay_ns=clock.delay_ns,
                    meta=meta or {},
                    token=self._token,
                ).to_wire()
            )
            for k in range(stream_count)
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
                with closing(access.read_runs(src_block_ids)) as runs:
                    for run in runs:
                        sock.sendall(run)
                        checksum.update(run)
                send_frame(sock, trailer_message(transfer_id, stream, checksum.intdigest()))
                return expect_reply(read_frame(sock), "done")
        except KVTransferError as error:
            return error


# The receiver's own verdicts explain a failure better than the broken connections that follow them.
_REASON_PRIORITY = {reason: rank for rank, reason in enumerate(
    ("unauthorized", "bad_header", "checksum", "refused", "timeout", "connection")
)}


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
    if traceparent is not None and (not isinstance(traceparent, str) or len(traceparent) != _TRACEPARENT_CHARS):
        raise ValueError(f"traceparent must be a W3C traceparent string, got {traceparent!r}")
    if meta is not None and not isinstance(meta, dict):
        raise ValueError("meta must be a dict of JSON values")
    if not (isinstance(dst, tuple) and len(dst) == 2 and isinstance(dst[0], str) and isinstance(dst[1], int)):
        raise ValueError(f"dst must be (host, port), got {dst!r}")


# ------------------------------------------------------------------------------------------------ receiver


@dataclass(eq=False)
class _Assembly:
    """One transfer being received, shared by its streams' connection threads; guarded by the receiver lock."""

    transfer_id: str
    request_id: str
    n_blocks: int
    n_streams: int
    traceparent: str | None
    meta: dict[str, Any]
    src: str
    sender_start_wall_ns: int
    clock_offset_ns: int
    clock_delay_ns: int
    recv_start_wall_ns: int
    deadline_monotonic: float
    allocated: threading.Event = field(default_factory=threading.Event)
    dst_block_ids: list[int] | None = None
    streams_seen: set[int] = field(default_factory=set)
    claimed_positions: set[int] = field(default_factory=set)
    streams_done: int = 0
    writers: int = 0  # streams between "joined" and "left": they may still write into dst blocks
    failed_reason: str | None = None
    completed: bool = False
    freed: bool = False

    def is_failed(self) -> bool:
        return self.failed_reason is not None


class KVReceiver:
    """Receives KV transfers into ``pool`` (``[num_blocks, 2, layers, block_tokens, kv_heads, head_dim]``).

    Binds on construction and serves from background daemon threads: one accepting, one per connection
    (at most ``max_connections``), one enforcing ``transfer_timeout_s`` (first header to last trailer).
    Callbacks run on connection threads (the reaper's, for timeouts), never with an internal lock held,
    and must not block for long:

    - ``allocate_blocks(n) -> ids | None``: n destination blocks, or None when there is no room;
    - ``free_blocks(ids)``: give back the blocks of a failed transfer (called once per transfer, after the
      last stream stopped writing into them);
    - ``on_complete(request_id, dst_block_ids, meta, info)``: every block has arrived and passed its
      checksum; the blocks now belong to the callee. If it raises, the blocks are freed and the sender
      sees ``refused``;
    - ``on_failed(request_id, reason)``: once per transfer that had been accepted, after the reason is known.
      Frames refused before a transfer exists (bad header, wrong token) are answered to the sender and
      logged, without a callback.

    ``token`` (default: ``SPLITSCOPE_KV_TOKEN``) is required on every frame when set, and must be set to
    bind anywhere but loopback. ``clock_ns`` is this receiver's wall clock (injectable for tests).
    """

    def __init__(
        self,
        pool: torch.Tensor,
        *,
        allocate_blocks: AllocateBlocks,
        free_blocks: FreeBlocks,
        on_complete: OnComplete,
        on_failed: OnFailed,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        clock_ns: ClockNs = time.time_ns,
        io_timeout_s: float = 30.0,
        transfer_timeout_s: float = 60.0,
        idle_timeout_s: float = 300.0,
        max_connections: int = 64,
        max_inflight_transfers: int = 256,
        socket_buffer_bytes: int | None = None,
    ) -> None:
        self._access = pool_bytes(pool)
        self._layout = self._access.layout
        self._token = token if token is not None else token_from_env()
        if host not in LOOPBACK_HOSTS and self._token is None:
            raise ValueError(f"binding the KV receiver to {host} needs a shared-secret token: set {TOKEN_ENV_VAR}")
        self._allocate_blocks = allocate_blocks
        self._free_blocks = free_blocks
        self._on_complete = on_complete
        self._on_failed = on_failed
        self._clock_ns = clock_ns
        self._io_timeout_s = io_timeout_s
        self._transfer_timeout_s = transfer_timeout_s
        self._idle_timeout_s = idle_timeout_s
        self._max_connections = max_connections
        self._max_inflight = max_inflight_transfers
        self._socket_buffer_bytes = socket_buffer_bytes

        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # wakes the reaper: a transfer began, or closing
        self._closed = False
        self._transfers: dict[str, _Assembly] = {}
        self._failed_transfers: OrderedDict[str, str] = OrderedDict()  # bounded: late streams of failed ones
        self._connections: dict[socket.socket, threading.Thread] = {}
        self.accepted_connections_total = 0

        self._listener = socket.create_server((host, port), backlog=max_connections)
        _tune(self._listener, socket_buffer_bytes)  # accepted sockets inherit it, window scale included
        self._listener.setblocking(False)
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._accept_thread = threading.Thread(target=self._accept_loop, name="kv-recv-accept", daemon=True)
        self._reaper_thread = threading.Thread(target=self._reap_loop, name="kv-recv-reaper", daemon=True)
        self._accept_thread.start()
        self._reaper_thread.start()

    # -- public

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) actually bound; the port is the OS's choice when constructed with port 0."""
        host, port = self._listener.getsockname()[:2]
        return host, port

    @property
    def inflight_transfers(self) -> int:
        with self._lock:
            return len(self._transfers)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, cut open connections, fail unfinished transfers (freeing their blocks); blocking."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._changed.notify_all()
            connections = dict(self._connections)
        self._wake_writer.send(b"x")
        deadline = time.monotonic() + timeout_s
        self._accept_thread.join(timeout_s)
        self._listener.close()
        for sock in connections:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in connections.values():
            thread.join(max(0.0, deadline - time.monotonic()))
        self._reaper_thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            leftovers = list(self._transfers.values())
        for assembly in leftovers:
            self._fail(assembly, KVTransferError("connection", "receiver closed"))
        self._wake_reader.close()
        self._wake_writer.close()

    def __enter__(self) -> KVReceiver:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- threads

    def _accept_loop(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self._listener, selectors.EVENT_READ)
            selector.register(self._wake_reader, selectors.EVENT_READ)
            while True:
                for key, _ in selector.select():
                    if key.fileobj is self._wake_reader:
                        return
                    try:
                        sock, address = self._listener.accept()
                    except OSError:  # the client gave up between select and accept
                        continue
                    self._admit(sock, f"{address[0]}:{address[1]}")

    def _admit(self, sock: socket.socket, peer: str) -> None:
        sock.settimeout(self._io_timeout_s)
        thread = threading.Thread(target=self._serve_connection, args=(sock, peer), name="kv-recv-conn", daemon=True)
        with self._lock:
            admitted = not self._closed and len(self._connections) < self._max_connections
            if admitted:
                self._connections[sock] = thread
                self.accepted_connections_total += 1
        if not admitted:
            self._refuse(sock, KVTransferError("refused", "receiver is at its connection limit or closing"), peer)
            sock.close()
            return
        _tune(sock, self._socket_buffer_bytes)
        thread.start()

    def _serve_connection(self, sock: socket.socket, peer: str) -> None:
        """Frames of one connection until it closes, idles out or breaks the protocol."""
        try:
            while True:
                sock.settimeout(self._idle_timeout_s)
                try:
                    message = read_frame(sock, eof_ok=True)
                except KVTransferError as error:
                    if error.reason == "bad_header":
                        self._refuse(sock, error, peer)
                    return
                arrived_ns = self._clock_ns()
                if message is None:
                    return
                sock.settimeout(self._io_timeout_s)
                if not token_matches(self._token, message):
                    self._refuse(sock, KVTransferError("unauthorized", "missing or wrong token"), peer)
                    return
                kind = message.get("type")
                if kind == "clock":
                    if not self._answer_clock(sock, message, arrived_ns, peer):
                        return
                elif kind == "kv":
                    if not self._serve_stream(sock, message, arrived_ns, peer):
                        return
                else:
                    self._refuse(sock, KVTransferError("bad_header", f"unknown frame type {str(kind)[:40]!r}"), peer)
                    return
        except Exception:  # a bug here must not kill the receiver silently
            logger.exception("KV receiver connection from %s failed", peer)
        finally:
            sock.close()
            with self._lock:
                self._connections.pop(sock, None)

    def _answer_clock(self, sock: socket.socket, message: dict[str, Any], t1_ns: int, peer: str) -> bool:
        try:
            parse_clock(message)
        except KVTransferError as error:
            self._refuse(sock, error, peer)
            return False
        try:
            with io_errors():
                send_frame(sock, reply_message("clock_reply", t1=t1_ns, t2=self._clock_ns()))
        except KVTransferError:
            return False
        return True

    def _serve_stream(self, sock: socket.socket, message: dict[str, Any], arrived_ns: int, peer: str) -> bool:
        """One stream's share, straight into the pool. True if the connection can carry the next frame."""
        try:
            header = StreamHeader.from_wire(message, self._layout)
            assembly = self._join(header, arrived_ns, peer)
        except KVTransferError as error:
            self._refuse(sock, error, peer)  # nothing of this stream was written
            return False
        # From here this stream is a writer of assembly.dst_block_ids and must leave exactly once.
        error: KVTransferError | None = None
        try:
            assert assembly.dst_block_ids is not None
            dst_block_ids = [assembly.dst_block_ids[position] for position in header.positions]
            with io_errors():
                send_frame(sock, reply_message("ready"))
                checksum = new_checksum()
                with closing(self._access.write_runs(dst_block_ids)) as buffers:
                    for buffer in buffers:
                        recv_exactly_into(sock, buffer, should_abort=assembly.is_failed)
                        checksum.update(buffer)
                trailer = read_frame(sock)
            expected = parse_trailer(trailer or {}, header.transfer_id, header.stream)
            if expected != checksum.intdigest():
                error = KVTransferError(
                    "checksum", f"request {header.request_id} stream {header.stream}: bytes do not match checksum"
                )
        except TransferAborted:
            error = KVTransferError(assembly.failed_reason or "connection", "another stream of this transfer failed")
        except KVTransferError as caught:
            error = caught
        if error is not None:
            self._fail(assembly, error)
            self._leave(assembly, finished=False)
            self._send_quietly(sock, error_message(error.reason, error.detail))
            return False

        completed = self._leave(assembly, finished=True)
        if assembly.failed_reason is not None:
            reason = assembly.failed_reason
            self._send_quietly(sock, error_message(reason, "another stream of this transfer failed"))
            return False
        recv_end_ns = self._clock_ns()
        if completed:
            rejection = self._complete(assembly, recv_end_ns)
            if rejection is not None:
                self._send_quietly(sock, error_message("refused", rejection))
                return False
        return self._send_quietly(
            sock, reply_message("done", recv_start_ns=assembly.recv_start_wall_ns, recv_end_ns=recv_end_ns)
        )

    def _reap_loop(self) -> None:
        """Fail transfers still unfinished at their deadline (e.g. a stream that never came)."""
        while True:
            with self._lock:
                while True:
                    if self._closed:
                        return
                    now = time.monotonic()
                    expired = [a for a in self._transfers.values() if a.deadline_monotonic <= now]
                    if expired:
                        break
                    deadlines = [a.deadline_monotonic for a in self._transfers.values()]
                    self._changed.wait(min(deadlines) - now if deadlines else None)
            for assembly in expired:
                self._fail(
                    assembly,
                    KVTransferError("timeout", f"transfer not finished within {self._transfer_timeout_s} s"),
                )

    # -- transfer state

    def _join(self, header: StreamHeader, arrived_ns: int, peer: str) -> _Assembly:
        """Register this stream as a writer of its transfer, allocating the blocks if it is the first.

        Raises KVTransferError (and is then not registered) if the stream cannot be accepted.
        """
        problem: KVTransferError | None = None
        with self._lock:
            if self._closed:
                raise KVTransferError("refused", "receiver is closing")
            failed_reason = self._failed_transfers.get(header.transfer_id)
            if failed_reason is not None:
                raise KVTransferError(failed_reason, "this transfer already failed")
            assembly = self._transfers.get(header.transfer_id)
            creator = assembly is None
            if assembly is None:
                if len(self._transfers) >= self._max_inflight:
                    raise KVTransferError("refused", f"receiver has {self._max_inflight} transfers in flight")
                assembly = _Assembly(
                    transfer_id=header.transfer_id,
                    request_id=header.request_id,
                    n_blocks=header.n_blocks,
                    n_streams=header.n_streams,
                    traceparent=header.traceparent,
                    meta=header.meta,
                    src=peer,
                    sender_start_wall_ns=header.sent_wall_ns,
                    clock_offset_ns=header.clock_offset_ns,
                    clock_delay_ns=header.clock_delay_ns,
                    recv_start_wall_ns=arrived_ns,
                    deadline_monotonic=time.monotonic() + self._transfer_timeout_s,
                )
                self._transfers[header.transfer_id] = assembly
                self._changed.notify_all()
            elif (assembly.request_id, assembly.n_blocks, assembly.n_streams) != (
                header.request_id, header.n_blocks, header.n_streams,
            ):
                problem = KVTransferError("bad_header", "stream disagrees with its transfer's request, blocks or streams")
            if problem is None and header.stream in assembly.streams_seen:
                problem = KVTransferError("bad_header", f"stream {header.stream} arrived twice")
            if problem is None and not assembly.claimed_positions.isdisjoint(header.positions):
                problem = KVTransferError("bad_header", "streams claim the same block positions")
            if problem is None:
                assembly.streams_seen.add(header.stream)
                assembly.claimed_positions.update(header.positions)
                assembly.writers += 1
        if problem is not None:
            self._fail(assembly, problem)
            raise problem

        if creator:
            try:
                dst_block_ids = self._allocate(header.n_blocks)
            except KVTransferError as error:
                self._fail(assembly, error)
                assembly.allocated.set()
                self._leave(assembly, finished=False)
                raise
            with self._lock:
                assembly.dst_block_ids = dst_block_ids
            assembly.allocated.set()
        elif not assembly.allocated.wait(self._io_timeout_s):
            self._leave(assembly, finished=False)
            raise KVTransferError("timeout", "destination blocks were not allocated in time")
        if assembly.failed_reason is not None or assembly.dst_block_ids is None:
            reason = assembly.failed_reason or "refused"
            self._leave(assembly, finished=False)
            raise KVTransferError(reason, "this transfer already failed")
        return assembly

    def _allocate(self, count: int) -> list[int]:
        try:
            block_ids = self._allocate_blocks(count)
        except Exception:
            logger.exception("allocate_blocks(%d) raised", count)
            raise KVTransferError("refused", "receiver failed to allocate blocks") from None
        if block_ids is None:
            raise KVTransferError("refused", f"no room for {count} KV blocks")
        block_ids = list(block_ids)
        valid = (
            len(block_ids) == count
            and all(isinstance(b, int) and 0 <= b < self._layout.num_blocks for b in block_ids)
            and len(set(block_ids)) == count
        )
        if not valid:
            logger.error("allocate_blocks(%d) returned unusable block ids %s", count, block_ids[:16])
            raise KVTransferError("refused", "receiver allocated unusable blocks")
        return block_ids

    def _leave(self, assembly: _Assembly, *, finished: bool) -> bool:
        """A writer stops; True if it was the last stream of a transfer that is now complete."""
        completed = False
        free_now = False
        with self._lock:
            assembly.writers -= 1
            if finished and assembly.failed_reason is None:
                assembly.streams_done += 1
                if assembly.streams_done == assembly.n_streams:
                    completed = len(assembly.claimed_positions) == assembly.n_blocks
            if completed:
                assembly.completed = True
                self._transfers.pop(assembly.transfer_id, None)
            elif assembly.failed_reason is not None and assembly.writers == 0 and not assembly.freed:
                assembly.freed = free_now = True
        if free_now:
            self._free(assembly)
        if finished and not completed and assembly.streams_done == assembly.n_streams:
            self._fail(assembly, KVTransferError("bad_header", "the streams did not cover every block"))
        return completed

    def _fail(self, assembly: _Assembly, error: KVTransferError) -> None:
        """Mark the transfer failed (first reason wins); free now if no stream writes into its blocks."""
        with self._lock:
            if assembly.failed_reason is not None or assembly.completed:
                return
            assembly.failed_reason = error.reason
            self._transfers.pop(assembly.transfer_id, None)
            self._failed_transfers[assembly.transfer_id] = error.reason
            while len(self._failed_transfers) > _FAILED_TRANSFERS_REMEMBERED:
                self._failed_transfers.popitem(last=False)
            free_now = assembly.writers == 0 and not assembly.freed
            if free_now:
                assembly.freed = True
        logger.warning("KV transfer of request %s failed (%s): %s", assembly.request_id, error.reason, error.detail)
        if free_now:
            self._free(assembly)
        try:
            self._on_failed(assembly.request_id, error.reason)
        except Exception:
            logger.exception("on_failed callback raised")

    def _free(self, assembly: _Assembly) -> None:
        if assembly.dst_block_ids is None:
            return
        try:
            self._free_blocks(list(assembly.dst_block_ids))
        except Exception:
            logger.exception("free_blocks callback raised")

    def _complete(self, assembly: _Assembly, recv_end_ns: int) -> str | None:
        """Hand the blocks over; None on success, else why the receiver's owner rejected them (blocks freed)."""
        assert assembly.dst_block_ids is not None
        info = ReceiveInfo(
            transfer_id=assembly.transfer_id,
            traceparent=assembly.traceparent,
            src=assembly.src,
            kv_bytes=assembly.n_blocks * self._layout.block_bytes,
            blocks=assembly.n_blocks,
            block_tokens=self._layout.block_tokens,
            streams=assembly.n_streams,
            recv_start_wall_ns=assembly.recv_start_wall_ns,
            recv_end_wall_ns=recv_end_ns,
            sender_start_wall_ns=assembly.sender_start_wall_ns,
            clock_offset_ns=assembly.clock_offset_ns,
            clock_delay_ns=assembly.clock_delay_ns,
        )
        try:
            self._on_complete(assembly.request_id, list(assembly.dst_block_ids), assembly.meta, info)
        except Exception as exc:
            logger.exception("on_complete callback raised; freeing the blocks of request %s", assembly.request_id)
            self._free(assembly)
            return f"receiver rejected the transfer: {type(exc).__name__}"
        return None

    # -- replies

    def _refuse(self, sock: socket.socket, error: KVTransferError, peer: str) -> None:
        logger.warning("refused KV frame from %s (%s): %s", peer, error.reason, error.detail)
        self._send_quietly(sock, error_message(error.reason, error.detail))

    @staticmethod
    def _send_quietly(sock: socket.socket, message: dict[str, Any]) -> bool:
        """Best-effort answer; False if the connection is gone."""
        try:
            send_frame(sock, message)
        except OSError:
            return False
        return True
