"""KV transfer wire format, schema v1: framing, message schemas and their strict validation.

A frame is ``MAGIC (4 bytes) | body length (uint32, big-endian) | body`` where the body is one UTF-8 JSON
object of at most ``MAX_HEADER_BYTES``. Raw KV bytes follow a ``kv`` header frame and are never framed as
JSON. Nothing here unpickles anything: a pickle (or any other foreign bytes) fails the magic check.

One KV stream, sender S and receiver R (each stream is one TCP connection)::

    S -> R  kv header      (request id, traceparent, dtype, layout, block positions, sizes, checksum algo)
    R -> S  ready | error  (blocks allocated, or why not; no KV byte is sent before "ready")
    S -> R  nbytes of raw KV, block after block, then a kv_end trailer (checksum of the stream's bytes)
    S <- R  done | error

Clock exchange on the same connections: ``clock {t0}`` answered by ``clock_reply {t1, t2}``.

This module does framing and validation only; threads, connections and pools live in send.py
and recv.py.
It does not import torch.
"""

from __future__ import annotations

import json
import os
import re
import socket
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
import xxhash

from tracer.auth import token_ok
from tracer.metrics import KV_TRANSFER_FAILURE_REASONS

MAGIC = b"SSKV"
WIRE_VERSION = 1
MAX_HEADER_BYTES = 1 << 20
MAX_STREAMS = 64
MAX_REQUEST_ID_CHARS = 256
MAX_TOKEN_CHARS = 1024
MAX_DETAIL_CHARS = 500
# XXH3 rather than zlib.crc32: about 7x faster here (bench/kv_transfer.py prints both), and a checksum pass
# on each side is the only per-byte CPU cost besides the kernel's copies. It detects corruption; it is
# not a MAC (the token, not the checksum, is what authenticates a peer).
CHECKSUM_ALGORITHM = "xxh3_64"

# Element size per dtype name (torch's names, without "torch."). Anything else is refused.
ALLOWED_DTYPES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

# Labels of splitscope_kv_transfer_failures_total{reason}: the metric catalogue owns them (and creates
# one child per reason at start, so the first failure of each kind is visible to increase()).
FAILURE_REASONS: tuple[str, ...] = KV_TRANSFER_FAILURE_REASONS
# Not a failure of the transfer: its request was aborted (the client left) and the receiver cut it. Never
# counted in the failures metric; the sender drops the transfer quietly.
ABORTED = "aborted"
WIRE_REASONS: tuple[str, ...] = (*FAILURE_REASONS, ABORTED)

# The shared secret a receiver requires (when set) and a sender presents; compared in constant time.
TOKEN_ENV_VAR = "SPLITSCOPE_KV_TOKEN"

_PREFIX = struct.Struct("!4sI")
_TRANSFER_ID = re.compile(r"[0-9a-f]{32}")
TRACEPARENT_PATTERN = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
_MAX_INT64 = (1 << 63) - 1
_MAX_UINT64 = (1 << 64) - 1
_MAX_DIM = 1 << 20


class KVTransferError(Exception):
    """A KV transfer failed; ``reason`` is one of FAILURE_REASONS (the metric label) or ABORTED (its request
    was aborted: not counted as a failure), ``detail`` says why."""

    def __init__(self, reason: str, detail: str = "") -> None:
        if reason not in WIRE_REASONS:
            raise ValueError(f"unknown KV transfer failure reason {reason!r}; expected one of {WIRE_REASONS}")
        self.reason = reason
        self.detail = detail
        super().__init__(f"KV transfer failed ({reason}): {detail}" if detail else f"KV transfer failed ({reason})")


def token_from_env() -> str | None:
    """The shared secret from ``SPLITSCOPE_KV_TOKEN``, or None when unset or empty."""
    return os.environ.get(TOKEN_ENV_VAR) or None


def tune_socket(sock: socket.socket, buffer_bytes: int | None) -> None:
    """TCP_NODELAY (headers and answers are small), and fixed buffer sizes if asked."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # None leaves the kernel's buffer autotuning on; a fixed size turns it off (and is capped by rmem_max).
    if buffer_bytes is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)


# The payload moves in batches of at most this many bytes: one sendmsg / recvmsg_into each, then the
# checksum pass over the batch while the kernel's copy has left it in cache (1 MiB = L2 of the machine
# measured in bench/RESULTS.md; 256 KiB and 4 MiB measured worse there).
PAYLOAD_BATCH_BYTES = 1 << 20


def new_checksum() -> xxhash.xxh3_64:
    """A running checksum; ``update(buffer)`` releases the GIL for buffers above 64 KiB."""
    return xxhash.xxh3_64()


# ---------------------------------------------------------------------------------------------- framing


def encode_frame(message: dict[str, Any]) -> bytes:
    """One frame for ``message``. Raises ValueError (a caller's bug) if it is not JSON or is too large."""
    try:
        body = json.dumps(message, separators=(",", ":"), allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise ValueError(f"KV transfer header is not plain JSON: {exc}") from exc
    if len(body) > MAX_HEADER_BYTES:
        raise ValueError(f"KV transfer header is {len(body)} bytes, over the {MAX_HEADER_BYTES}-byte limit")
    return _PREFIX.pack(MAGIC, len(body)) + body


def send_frame(sock: socket.socket, message: dict[str, Any]) -> None:
    """Send one frame; blocking, under the socket's timeout. OSError propagates (see ``io_errors``)."""
    sock.sendall(encode_frame(message))


def read_frame(sock: socket.socket, *, eof_ok: bool = False) -> dict[str, Any] | None:
    """Read one frame and parse its body; blocking, under the socket's timeout.

    Returns None only when ``eof_ok`` and the peer closed cleanly before the first byte of a frame.
    Raises KVTransferError: ``bad_header`` (bad magic, oversize, not a JSON object), ``connection``
    (closed mid-frame), ``timeout``. At most MAX_HEADER_BYTES are buffered, and only after the length
    prefix was checked.
    """
    prefix = bytearray(_PREFIX.size)
    with io_errors():
        if not recv_exactly_into(sock, memoryview(prefix), eof_ok=eof_ok):
            return None
    magic, length = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        hint = " (looks like a pickle, which is never accepted)" if prefix[:1] == b"\x80" else ""
        raise KVTransferError("bad_header", f"not a splitscope KV frame: bad magic {bytes(prefix[:4])!r}{hint}")
    if length > MAX_HEADER_BYTES:
        raise KVTransferError("bad_header", f"header of {length} bytes is over the {MAX_HEADER_BYTES}-byte limit")
    body = bytearray(length)
    with io_errors():
        recv_exactly_into(sock, memoryview(body))
    return parse_frame_body(bytes(body))


def parse_frame_body(body: bytes) -> dict[str, Any]:
    """Strict JSON: UTF-8, one object, no duplicate keys, no NaN/Infinity. Raises KVTransferError(bad_header)."""
    try:
        message = json.loads(body.decode("utf-8"), object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constants)
    except (UnicodeDecodeError, ValueError) as exc:
        raise KVTransferError("bad_header", f"header is not valid JSON: {_clip(str(exc))}") from None
    except RecursionError:
        raise KVTransferError("bad_header", "header JSON is nested too deeply") from None
    if not isinstance(message, dict):
        raise KVTransferError("bad_header", f"header must be a JSON object, got {type(message).__name__}")
    return message


def recv_exactly_into(sock: socket.socket, view: memoryview, *, eof_ok: bool = False) -> bool:
    """Fill ``view`` from ``sock`` with ``recv_into`` (no intermediate copy); blocking, socket timeout applies.

    Returns False only if ``eof_ok`` and the peer closed before the first byte. Raises ConnectionError on
    EOF mid-buffer; OSError/TimeoutError as the socket raises them. For frames; payloads go through
    ``recvmsg_exactly_into``.
    """
    received = 0
    size = len(view)
    while received < size:
        count = sock.recv_into(view[received:])
        if count == 0:
            if received == 0 and eof_ok:
                return False
            raise ConnectionError(f"peer closed the connection after {received} of {size} bytes")
        received += count
    return True


@contextmanager
def bulk_mode(sock: socket.socket) -> Iterator[None]:
    """The payload phase of a stream: the socket blocking, with the kernel enforcing its timeout.

    With a Python-level timeout every send or receive is a ``poll`` plus a non-blocking call that moves at
    most one socket buffer, and each retakes the GIL. Blocking calls move a whole batch per call
    (``sendmsg_all``, ``recvmsg_exactly_into`` with MSG_WAITALL), and SO_SNDTIMEO/SO_RCVTIMEO keep the same
    timeout: a call that makes no progress for that long raises TimeoutError. The Python-level timeout is
    restored on exit.
    """
    timeout_s = sock.gettimeout()
    if timeout_s is not None:
        seconds = int(timeout_s)
        timeval = struct.pack("@ll", seconds, int((timeout_s - seconds) * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
    sock.settimeout(None)
    try:
        yield
    except BlockingIOError as exc:  # EAGAIN from a blocking call: the kernel timeout expired
        raise TimeoutError(f"no progress within {timeout_s} s") from exc
    finally:
        try:
            sock.settimeout(timeout_s)
        except OSError:
            pass  # closed meanwhile (a failed transfer); nothing to restore


def sendmsg_all(sock: socket.socket, views: list[memoryview]) -> None:
    """Send every byte of ``views`` in order, gathering them into as few ``sendmsg`` calls as the socket
    allows (one, on a blocking socket). ``views`` is consumed."""
    while views:
        sent = sock.sendmsg(views)
        _advance(views, sent)


def recvmsg_exactly_into(
    sock: socket.socket, views: list[memoryview], *, should_abort: Callable[[], bool] | None = None
) -> None:
    """Fill every view of ``views`` in order with ``recvmsg_into`` and MSG_WAITALL (one call on a blocking
    socket, see ``bulk_mode``). ConnectionError on EOF; ``should_abort`` is polled between calls and
    raises TransferAborted. ``views`` is consumed."""
    total = sum(len(view) for view in views)
    received = 0
    while views:
        if should_abort is not None and should_abort():
            raise TransferAborted()
        count = sock.recvmsg_into(views, 0, socket.MSG_WAITALL)[0]
        if count == 0:
            raise ConnectionError(f"peer closed the connection after {received} of {total} bytes")
        received += count
        _advance(views, count)


def _advance(views: list[memoryview], count: int) -> None:
    """Drop the first ``count`` bytes of ``views`` (whole views, then the front of a partial one)."""
    done = 0
    while done < len(views) and count >= len(views[done]):
        count -= len(views[done])
        done += 1
    del views[:done]
    if count:
        views[0] = views[0][count:]


class TransferAborted(Exception):
    """Raised inside a stream's receive loop when another stream of the same transfer already failed."""


@contextmanager
def io_errors() -> Iterator[None]:
    """Map socket errors to KVTransferError: TimeoutError -> ``timeout``, other OSError -> ``connection``."""
    try:
        yield
    except TimeoutError as exc:
        raise KVTransferError("timeout", str(exc) or "socket timed out") from exc
    except OSError as exc:
        raise KVTransferError("connection", str(exc) or type(exc).__name__) from exc


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _clip(text: str) -> str:
    return text if len(text) <= MAX_DETAIL_CHARS else text[: MAX_DETAIL_CHARS - 3] + "..."


# ---------------------------------------------------------------------------------------------- layout


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """Shape of one KV block, ``[2, n_layers, block_tokens, n_kv_heads, head_dim]``, its dtype, and the pool size."""

    dtype: str
    block_shape: tuple[int, ...]
    num_blocks: int

    @property
    def block_bytes(self) -> int:
        size = ALLOWED_DTYPES[self.dtype]
        for dim in self.block_shape:
            size *= dim
        return size

    @property
    def block_tokens(self) -> int:
        return self.block_shape[2]


# ---------------------------------------------------------------------------------------------- messages


def _whole(pattern: str) -> str:
    """``pattern`` anchored at both ends: msgspec searches a pattern rather than matching it whole (and \\Z,
    not $, which would let a trailing newline through)."""
    return rf"\A(?:{pattern})\Z"


# A kv header's fields one by one, as constraints msgspec checks in C (strict: JSON true is no integer,
# 4096.0 no byte count).
_Int64 = Annotated[int, msgspec.Meta(ge=-_MAX_INT64, le=_MAX_INT64)]
_NonNegative = Annotated[int, msgspec.Meta(ge=0, le=_MAX_INT64)]
_Positive = Annotated[int, msgspec.Meta(ge=1, le=_MAX_INT64)]
_Dim = Annotated[int, msgspec.Meta(ge=1, le=_MAX_DIM)]
_TransferId = Annotated[str, msgspec.Meta(pattern=_whole(_TRANSFER_ID.pattern))]
_Traceparent = Annotated[str, msgspec.Meta(pattern=_whole(TRACEPARENT_PATTERN.pattern))]
_Dtype = Annotated[str, msgspec.Meta(pattern=_whole("|".join(map(re.escape, ALLOWED_DTYPES))))]
_Checksum = Annotated[str, msgspec.Meta(pattern=_whole(re.escape(CHECKSUM_ALGORITHM)))]


class _WireLayout(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """``layout`` of a ``kv`` header: ``[2 (K and V), layers, block_tokens, kv_heads, head_dim]``."""

    block_shape: tuple[Literal[2], _Dim, _Dim, _Dim, _Dim]


class _WireClock(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """``clock`` of a ``kv`` header: the sender's estimate of receiver clock minus sender clock, in ns."""

    offset_ns: _Int64
    delay_ns: _Int64


class _WireHeader(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A ``kv`` frame as it arrives: every key required but ``token``, no unknown key, each value checked on
    its own. What depends on another field or on the receiver's pool is checked by ``_check_layout`` and
    ``_check_blocks``."""

    v: Literal[1]  # WIRE_VERSION
    type: Literal["kv"]
    transfer_id: _TransferId
    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_REQUEST_ID_CHARS)]
    traceparent: _Traceparent | None
    dtype: _Dtype
    layout: _WireLayout
    block_bytes: _Positive
    n_blocks: _Positive
    n_streams: Annotated[int, msgspec.Meta(ge=1, le=MAX_STREAMS)]
    stream: Annotated[int, msgspec.Meta(ge=0, le=MAX_STREAMS - 1)]
    positions: Annotated[tuple[_NonNegative, ...], msgspec.Meta(min_length=1)]
    src_block_ids: tuple[_NonNegative, ...]
    nbytes: _Positive
    checksum: _Checksum
    sent_wall_ns: _NonNegative
    clock: _WireClock
    meta: dict[str, Any]
    token: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_TOKEN_CHARS)] | None = None


@dataclass(frozen=True, slots=True)
class StreamHeader:
    """The ``kv`` frame that opens one stream. ``positions`` index the request's block list (0..n_blocks-1);
    destination block ids are chosen by the receiver. Clock fields: receiver clock minus sender clock."""

    transfer_id: str
    request_id: str
    traceparent: str | None
    dtype: str
    block_shape: tuple[int, ...]
    block_bytes: int
    n_blocks: int
    n_streams: int
    stream: int
    positions: tuple[int, ...]
    src_block_ids: tuple[int, ...]
    nbytes: int
    sent_wall_ns: int
    clock_offset_ns: int
    clock_delay_ns: int
    meta: dict[str, Any]
    token: str | None = None

    def to_wire(self) -> dict[str, Any]:
        message: dict[str, Any] = {
            "v": WIRE_VERSION,
            "type": "kv",
            "transfer_id": self.transfer_id,
            "request_id": self.request_id,
            "traceparent": self.traceparent,
            "dtype": self.dtype,
            "layout": {"block_shape": list(self.block_shape)},
            "block_bytes": self.block_bytes,
            "n_blocks": self.n_blocks,
            "n_streams": self.n_streams,
            "stream": self.stream,
            "positions": list(self.positions),
            "src_block_ids": list(self.src_block_ids),
            "nbytes": self.nbytes,
            "checksum": CHECKSUM_ALGORITHM,
            "sent_wall_ns": self.sent_wall_ns,
            "clock": {"offset_ns": self.clock_offset_ns, "delay_ns": self.clock_delay_ns},
            "meta": self.meta,
        }
        if self.token is not None:
            message["token"] = self.token
        return message

    @classmethod
    def from_wire(cls, message: dict[str, Any], layout: BlockLayout) -> StreamHeader:
        """Validate a ``kv`` frame against the receiver's pool ``layout``; raises KVTransferError(bad_header)
        whose detail names the bad field. Nothing is allocated or written before this returns."""
        _check_envelope(message, "kv")  # a future schema version is named as such, not as a bad field
        try:
            wire = msgspec.convert(message, _WireHeader)
        except msgspec.ValidationError as exc:
            raise KVTransferError("bad_header", _clip(f"kv header: {exc}")) from None
        _check_layout(wire, layout)
        _check_blocks(wire, layout)
        return cls(
            transfer_id=wire.transfer_id,
            request_id=wire.request_id,
            traceparent=wire.traceparent,
            dtype=wire.dtype,
            block_shape=wire.layout.block_shape,
            block_bytes=wire.block_bytes,
            n_blocks=wire.n_blocks,
            n_streams=wire.n_streams,
            stream=wire.stream,
            positions=wire.positions,
            src_block_ids=wire.src_block_ids,
            nbytes=wire.nbytes,
            sent_wall_ns=wire.sent_wall_ns,
            clock_offset_ns=wire.clock.offset_ns,
            clock_delay_ns=wire.clock.delay_ns,
            meta=wire.meta,
            token=wire.token,
        )


def _check_layout(wire: _WireHeader, layout: BlockLayout) -> None:
    """The sender's block layout is the receiver's pool's: the bytes land as they were, or not at all."""
    if wire.dtype != layout.dtype or wire.layout.block_shape != layout.block_shape:
        raise KVTransferError(
            "bad_header",
            f"layout {wire.dtype} {list(wire.layout.block_shape)} does not match this pool's "
            f"{layout.dtype} {list(layout.block_shape)}",
        )
    if wire.block_bytes != layout.block_bytes:
        raise KVTransferError("bad_header", f"block_bytes {wire.block_bytes} != {layout.block_bytes} for this layout")


def _check_blocks(wire: _WireHeader, layout: BlockLayout) -> None:
    """This stream's share fits the transfer and the pool: ``stream`` < ``n_streams`` <= ``n_blocks`` <= the
    pool's blocks, ``positions`` distinct in [0, n_blocks), one distinct source block per position, and
    ``nbytes`` exactly their bytes."""
    if wire.n_blocks > layout.num_blocks:
        raise KVTransferError(
            "bad_header", f"'n_blocks' = {wire.n_blocks} is more than this pool's {layout.num_blocks}"
        )
    if wire.n_streams > wire.n_blocks:
        raise KVTransferError("bad_header", f"'n_streams' = {wire.n_streams} is more than 'n_blocks' = {wire.n_blocks}")
    if wire.stream >= wire.n_streams:
        raise KVTransferError("bad_header", f"'stream' = {wire.stream} is outside [0, {wire.n_streams - 1}]")
    if max(wire.positions) >= wire.n_blocks:
        raise KVTransferError(
            "bad_header", f"'positions' holds {max(wire.positions)}, outside [0, {wire.n_blocks - 1}]"
        )
    if len(set(wire.positions)) != len(wire.positions):
        raise KVTransferError("bad_header", "'positions' must be non-empty and free of repeats")
    if len(wire.src_block_ids) != len(wire.positions) or len(set(wire.src_block_ids)) != len(wire.src_block_ids):
        raise KVTransferError("bad_header", "'src_block_ids' must match 'positions' in length, free of repeats")
    if wire.nbytes != len(wire.positions) * wire.block_bytes:
        raise KVTransferError(
            "bad_header", f"nbytes {wire.nbytes} != {len(wire.positions)} blocks x {wire.block_bytes} bytes per block"
        )


def trailer_message(transfer_id: str, stream: int, checksum: int) -> dict[str, Any]:
    return {"v": WIRE_VERSION, "type": "kv_end", "transfer_id": transfer_id, "stream": stream, "checksum": checksum}


def parse_trailer(message: dict[str, Any], transfer_id: str, stream: int) -> int:
    """The checksum carried by a ``kv_end`` frame of this stream; raises KVTransferError(bad_header)."""
    _check_keys(message, required={"v", "type", "transfer_id", "stream", "checksum"}, optional=set())
    _check_envelope(message, "kv_end")
    if message["transfer_id"] != transfer_id or message["stream"] != stream:
        raise KVTransferError("bad_header", "kv_end trailer belongs to another stream")
    return _int(message, "checksum", low=0, high=_MAX_UINT64)


def clock_message(t0_ns: int, token: str | None) -> dict[str, Any]:
    message: dict[str, Any] = {"v": WIRE_VERSION, "type": "clock", "t0": t0_ns}
    if token is not None:
        message["token"] = token
    return message


def parse_clock(message: dict[str, Any]) -> int:
    _check_keys(message, required={"v", "type", "t0"}, optional={"token"})
    _check_envelope(message, "clock")
    if message.get("token") is not None:
        _string(message, "token", max_chars=MAX_TOKEN_CHARS)
    return _int(message, "t0", low=0, high=_MAX_INT64)


def reply_message(kind: str, **fields: Any) -> dict[str, Any]:
    """A receiver's answer: ``ready``, ``done``, ``clock_reply`` or ``error`` (with ``reason``, ``detail``)."""
    return {"v": WIRE_VERSION, "type": kind, **fields}


def error_message(reason: str, detail: str) -> dict[str, Any]:
    return reply_message("error", reason=reason, detail=_clip(detail))


def expect_reply(message: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    """Check the receiver's answer; raises KVTransferError with the receiver's reason on ``error``."""
    if message is None:
        raise KVTransferError("connection", "receiver closed the connection")
    if message.get("v") != WIRE_VERSION:
        raise KVTransferError("bad_header", f"receiver answered with schema version {message.get('v')!r}")
    if message.get("type") == "error":
        reason = message.get("reason")
        detail = message.get("detail")
        detail = _clip(detail) if isinstance(detail, str) else ""
        raise KVTransferError(reason if reason in WIRE_REASONS else "refused", f"receiver: {detail}")
    if message.get("type") != kind:
        raise KVTransferError("bad_header", f"expected a {kind!r} answer, got {_clip(repr(message.get('type')))}")
    return message


def reply_int(message: dict[str, Any], key: str) -> int:
    return _int(message, key, low=-_MAX_INT64, high=_MAX_INT64)


def token_matches(expected: str | None, message: dict[str, Any]) -> bool:
    """True if no token is configured, or the frame's ``token`` equals it (constant-time comparison)."""
    presented = message.get("token")
    return token_ok(expected or "", presented if isinstance(presented, str) else None)


# ---------------------------------------------------------------------------------------------- checks


def _check_envelope(message: dict[str, Any], kind: str) -> None:
    if message.get("v") != WIRE_VERSION or isinstance(message.get("v"), bool):
        raise KVTransferError("bad_header", f"unsupported schema version {_clip(repr(message.get('v')))}")
    if message.get("type") != kind:
        raise KVTransferError("bad_header", f"expected a {kind!r} frame, got {_clip(repr(message.get('type')))}")


def _check_keys(message: dict[str, Any], *, required: set[str], optional: set[str], where: str = "header") -> None:
    missing = required - message.keys()
    if missing:
        raise KVTransferError("bad_header", f"{where} lacks {sorted(missing)}")
    unknown = message.keys() - required - optional
    if unknown:
        raise KVTransferError("bad_header", _clip(f"{where} has unknown fields {sorted(unknown)}"))


def _int(message: dict[str, Any], key: str, *, low: int, high: int) -> int:
    value = message.get(key)
    # bool is an int subclass in Python; JSON true is not a number.
    if not isinstance(value, int) or isinstance(value, bool):
        raise KVTransferError("bad_header", f"{key!r} must be an integer, got {type(value).__name__}")
    if not low <= value <= high:
        raise KVTransferError("bad_header", f"{key!r} = {value} is outside [{low}, {high}]")
    return value


def _string(message: dict[str, Any], key: str, *, max_chars: int) -> str:
    value = message.get(key)
    if not isinstance(value, str) or not value:
        raise KVTransferError("bad_header", f"{key!r} must be a non-empty string")
    if len(value) > max_chars:
        raise KVTransferError("bad_header", f"{key!r} is longer than {max_chars} characters")
    return value
