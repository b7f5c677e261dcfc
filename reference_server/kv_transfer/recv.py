"""KV transfer, receiving side: ``KVReceiver`` writes each stream's share straight into its paged pool.

Destination blocks are allocated (through a callback) when a transfer's first header arrives, and freed
if the transfer fails: checksum mismatch, dropped connection, timeout, or a later stream's bad header.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

import torch

from reference_server.kv_transfer.pool import pool_bytes
from reference_server.kv_transfer.wire import (
    ABORTED,
    PAYLOAD_BATCH_BYTES,
    TOKEN_ENV_VAR,
    KVTransferError,
    StreamHeader,
    TransferAborted,
    bulk_mode,
    error_message,
    io_errors,
    new_checksum,
    parse_clock,
    parse_trailer,
    read_frame,
    recvmsg_exactly_into,
    reply_message,
    send_frame,
    token_from_env,
    token_matches,
    tune_socket,
)
from tracer.auth import check_bind_token

logger = logging.getLogger(__name__)

_FAILED_TRANSFERS_REMEMBERED = 1024
_LINGER_S = 1.0
_LINGER_MAX_BYTES = 8 << 20

AllocateBlocks = Callable[[int], "Sequence[int] | None"]
FreeBlocks = Callable[[Sequence[int]], None]
ClockNs = Callable[[], int]


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
    sockets: set[socket.socket] = field(default_factory=set)  # the writers' connections (cancel cuts them)
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
        check_bind_token("the KV receiver", [host], self._token, TOKEN_ENV_VAR)
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
        self._cancelled: OrderedDict[str, None] = OrderedDict()  # bounded: request ids aborted before their KV came
        self._connections: dict[socket.socket, threading.Thread] = {}
        self.accepted_connections_total = 0

        self._listener = socket.create_server((host, port), backlog=max_connections)
        tune_socket(self._listener, socket_buffer_bytes)  # accepted sockets inherit it, window scale included
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
    def open_connections(self) -> int:
        with self._lock:
            return len(self._connections)

    @property
    def inflight_transfers(self) -> int:
        with self._lock:
            return len(self._transfers)

    def cancel(self, request_id: str) -> bool:
        """Cut the transfer of `request_id` (its request was aborted): in flight, its streams stop and its
        blocks are freed once no stream writes into them; not yet started, it is refused when it comes. The
        sender sees ``aborted``, which is not a failure. Any thread; never blocks on I/O. True if a
        transfer was in flight."""
        with self._lock:
            self._cancelled[request_id] = None
            while len(self._cancelled) > _FAILED_TRANSFERS_REMEMBERED:
                self._cancelled.popitem(last=False)
            found = [a for a in self._transfers.values() if a.request_id == request_id]
        for assembly in found:
            self._fail(assembly, KVTransferError(ABORTED, "its request was aborted"))
            with self._lock:
                sockets = list(assembly.sockets)
            for sock in sockets:  # a stream blocked mid-payload returns from its read at once
                try:
                    sock.shutdown(socket.SHUT_RD)
                except OSError:
                    pass
        return bool(found)

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
        tune_socket(sock, self._socket_buffer_bytes)
        thread.start()

    def _serve_connection(self, sock: socket.socket, peer: str) -> None:
        """Frames of one connection until it closes, idles out or breaks the protocol."""
        linger = True  # every exit but a quiet end (below) follows an answer that must reach the peer
        try:
            while True:
                sock.settimeout(self._idle_timeout_s)
                try:
                    message = read_frame(sock, eof_ok=True)
                except KVTransferError as error:
                    if error.reason == "bad_header":
                        self._refuse(sock, error, peer)
                    else:  # idle timeout or a broken connection: nothing to tell the peer
                        linger = False
                    return
                arrived_ns = self._clock_ns()
                if message is None:
                    linger = False
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
            if linger:
                _lingering_close(sock)
            else:
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
        except KVTransferError as refused:
            self._refuse(sock, refused, peer)  # nothing of this stream was written
            return False
        # From here this stream is a writer of assembly.dst_block_ids and must leave exactly once.
        with self._lock:
            assembly.sockets.add(sock)
        error: KVTransferError | None = None
        try:
            assert assembly.dst_block_ids is not None
            dst_block_ids = [assembly.dst_block_ids[position] for position in header.positions]
            with io_errors():
                send_frame(sock, reply_message("ready"))
                checksum = new_checksum()
                batches = self._access.write_batches(dst_block_ids, PAYLOAD_BATCH_BYTES)
                with closing(batches), bulk_mode(sock):
                    for batch in batches:
                        recvmsg_exactly_into(sock, batch[:], should_abort=assembly.is_failed)
                        for piece in batch:  # just written by the kernel: still in cache
                            checksum.update(piece)
                if assembly.is_failed():  # no use waiting for a trailer of a transfer already lost
                    raise TransferAborted()
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
        with self._lock:
            assembly.sockets.discard(sock)
        if error is not None:
            self._fail(assembly, error)
            self._leave(assembly, finished=False)
            # The first reason wins: a connection cut by cancel() answers `aborted`, not `connection`.
            self._send_quietly(sock, error_message(assembly.failed_reason or error.reason, error.detail))
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
            if header.request_id in self._cancelled:
                raise KVTransferError(ABORTED, "its request was aborted")
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
                header.request_id,
                header.n_blocks,
                header.n_streams,
            ):
                problem = KVTransferError("bad_header", "stream disagrees with its transfer's request or sizes")
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
        level = logging.INFO if error.reason == ABORTED else logging.WARNING
        logger.log(level, "KV transfer of request %s failed (%s): %s", assembly.request_id, error.reason, error.detail)
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
        level = logging.INFO if error.reason == ABORTED else logging.WARNING
        logger.log(level, "refused KV frame from %s (%s): %s", peer, error.reason, error.detail)
        self._send_quietly(sock, error_message(error.reason, error.detail))

    @staticmethod
    def _send_quietly(sock: socket.socket, message: dict[str, Any]) -> bool:
        """Best-effort answer; False if the connection is gone."""
        try:
            send_frame(sock, message)
        except OSError:
            return False
        return True


def _lingering_close(sock: socket.socket) -> None:
    """Close so that our last answer (often an ``error``) reaches the peer.

    Closing a socket with unread input makes the kernel send a reset, which can destroy the answer still
    queued for the peer. So: end our side, then read and discard what the peer still sends, bounded in
    time and bytes (as HTTP servers' lingering close does), then close.
    """
    try:
        sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + _LINGER_S
        discarded = 0
        while discarded < _LINGER_MAX_BYTES:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                break
            sock.settimeout(remaining_s)
            chunk = sock.recv(1 << 16)
            if not chunk:
                break
            discarded += len(chunk)
    except OSError:
        pass
    finally:
        sock.close()
