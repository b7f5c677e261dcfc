"""KV transfer over real sockets on 127.0.0.1: round trips, corruption, drops, refusals, clock offset, tokens."""

from __future__ import annotations

import json
import pickle
import random
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reference_server.kv_transfer import (
    TOKEN_ENV_VAR,
    KVReceiver,
    KVSender,
    KVTransferError,
    ReceiveInfo,
)
from reference_server.kv_transfer.clock import best_estimate, offset_and_delay_ns
from reference_server.kv_transfer.pool import batched, consecutive_runs, layout_of
from reference_server.kv_transfer.wire import (
    MAGIC,
    MAX_HEADER_BYTES,
    BlockLayout,
    StreamHeader,
    encode_frame,
    new_checksum,
    parse_frame_body,
    read_frame,
    recvmsg_exactly_into,
    reply_message,
    sendmsg_all,
    trailer_message,
)
from tests.conftest import wait_for

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 8
POOL_BLOCKS = 64
WAIT_S = 10.0
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def make_pool(block_tokens: int = 16, dtype: torch.dtype = torch.float32, fill: float | None = None) -> torch.Tensor:
    shape = (POOL_BLOCKS, 2, LAYERS, block_tokens, KV_HEADS, HEAD_DIM)
    if fill is None:
        return torch.randn(shape, generator=torch.Generator().manual_seed(7)).to(dtype)
    return torch.full(shape, fill, dtype=dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


class BlockAllocator:
    """A free list like kv_cache's, handing out blocks in a shuffled order; thread-safe, counts calls."""

    def __init__(self, num_blocks: int, seed: int = 3) -> None:
        self.free_ids = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_ids)
        self.num_blocks = num_blocks
        self.allocations = 0
        self.double_frees: list[int] = []
        self._changed = threading.Condition()

    def allocate(self, count: int) -> list[int] | None:
        with self._changed:
            self.allocations += 1
            if len(self.free_ids) < count:
                return None
            taken, self.free_ids = self.free_ids[:count], self.free_ids[count:]
            return taken

    def free(self, block_ids: list[int]) -> None:
        with self._changed:
            self.double_frees += [b for b in block_ids if b in self.free_ids]
            self.free_ids += block_ids
            self._changed.notify_all()

    def wait_all_free(self, timeout_s: float = WAIT_S) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: len(self.free_ids) == self.num_blocks, timeout_s)


class Outcomes:
    """Collects on_complete / on_failed calls; waits on them without sleeping."""

    def __init__(self) -> None:
        self.completed: dict[str, tuple[list[int], dict[str, Any], ReceiveInfo]] = {}
        self.failed: list[tuple[str, str]] = []
        self._changed = threading.Condition()

    def on_complete(self, request_id: str, block_ids: list[int], meta: dict[str, Any], info: ReceiveInfo) -> None:
        with self._changed:
            self.completed[request_id] = (block_ids, meta, info)
            self._changed.notify_all()

    def on_failed(self, request_id: str, reason: str) -> None:
        with self._changed:
            self.failed.append((request_id, reason))
            self._changed.notify_all()

    def wait_completed(self, request_id: str) -> tuple[list[int], dict[str, Any], ReceiveInfo]:
        with self._changed:
            assert self._changed.wait_for(lambda: request_id in self.completed, WAIT_S), "transfer never completed"
            return self.completed[request_id]

    def wait_failed(self, request_id: str) -> str:
        with self._changed:
            found = self._changed.wait_for(lambda: any(r == request_id for r, _ in self.failed), WAIT_S)
            assert found, "on_failed never called"
            return next(reason for r, reason in self.failed if r == request_id)


class Side:
    """A receiver with its pool, allocator and outcome log."""

    def __init__(self, pool: torch.Tensor, **kwargs: Any) -> None:
        self.pool = pool
        self.allocator = BlockAllocator(pool.shape[0])
        self.outcomes = Outcomes()
        self.receiver = KVReceiver(
            pool,
            allocate_blocks=self.allocator.allocate,
            free_blocks=self.allocator.free,
            on_complete=kwargs.pop("on_complete", self.outcomes.on_complete),
            on_failed=self.outcomes.on_failed,
            **kwargs,
        )

    @property
    def address(self) -> tuple[str, int]:
        return self.receiver.address


@pytest.fixture
def receivers() -> Iterator[Callable[..., Side]]:
    made: list[Side] = []

    def make(pool: torch.Tensor, **kwargs: Any) -> Side:
        side = Side(pool, **kwargs)
        made.append(side)
        return side

    yield make
    for side in made:
        side.receiver.close()


@pytest.fixture
def senders() -> Iterator[Callable[..., KVSender]]:
    made: list[KVSender] = []

    def make(**kwargs: Any) -> KVSender:
        sender = KVSender(**kwargs)
        made.append(sender)
        return sender

    yield make
    for sender in made:
        sender.close()


@pytest.fixture(autouse=True)
def no_token_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV_VAR, raising=False)


class FaultyProxy:
    """A TCP relay that flips one sender->receiver byte, or cuts the connection, at a byte offset."""

    def __init__(self, upstream: tuple[str, int], *, flip_at: int | None = None, cut_after: int | None = None) -> None:
        self._upstream = upstream
        self._flip_at = flip_at
        self._cut_after = cut_after
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept_loop, daemon=True).start()

    @property
    def address(self) -> tuple[str, int]:
        return self._listener.getsockname()[:2]

    def close(self) -> None:
        for sock in [self._listener, *self._sockets]:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def _accept_loop(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self._upstream)
            self._sockets += [client, server]
            threading.Thread(target=self._forward, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._forward, args=(server, client, False), daemon=True).start()

    def _forward(self, source: socket.socket, sink: socket.socket, faulty: bool) -> None:
        offset = 0
        try:
            while True:
                chunk = bytearray(source.recv(1 << 16))
                if not chunk:
                    break
                if faulty and self._flip_at is not None and offset <= self._flip_at < offset + len(chunk):
                    chunk[self._flip_at - offset] ^= 0xFF
                if faulty and self._cut_after is not None and offset + len(chunk) >= self._cut_after:
                    sink.sendall(chunk[: self._cut_after - offset])
                    break
                sink.sendall(chunk)
                offset += len(chunk)
        except OSError:
            pass
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


# ---------------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("streams", [1, 4])
@pytest.mark.parametrize("block_tokens", [16, 256])
def test_round_trip_lands_in_allocated_blocks(receivers, senders, dtype, streams, block_tokens) -> None:
    src_pool = make_pool(block_tokens, dtype)
    side = receivers(make_pool(block_tokens, dtype, fill=-1.0))
    src_ids = [9, 10, 11, 3, 40, 41, 7, 0, 63]
    meta = {"first_token_id": 42, "prompt_tokens": 123, "max_tokens": 16, "temperature": 0.0}

    result = senders(streams=streams).send("req-1", src_pool, src_ids, side.address, TRACEPARENT, meta)

    dst_ids, got_meta, info = side.outcomes.wait_completed("req-1")
    assert len(dst_ids) == len(src_ids)
    for src, dst in zip(src_ids, dst_ids):
        assert same_bits(side.pool[dst], src_pool[src]), f"block {src} -> {dst} differs"
    untouched = sorted(set(range(POOL_BLOCKS)) - set(dst_ids))
    assert bool((side.pool[untouched] == -1.0).all()), "bytes landed outside the allocated blocks"
    assert got_meta == meta
    block_bytes = 2 * LAYERS * block_tokens * KV_HEADS * HEAD_DIM * src_pool.element_size()
    assert (result.kv_bytes, result.blocks, result.streams, result.block_tokens) == (
        len(src_ids) * block_bytes,
        len(src_ids),
        streams,
        block_tokens,
    )
    assert (info.kv_bytes, info.blocks, info.streams, info.traceparent) == (
        result.kv_bytes,
        len(src_ids),
        streams,
        TRACEPARENT,
    )
    assert result.start_wall_ns <= result.end_wall_ns
    assert info.recv_start_wall_ns <= info.recv_end_wall_ns
    assert side.outcomes.failed == []


def test_fewer_blocks_than_streams_uses_one_stream_per_block(receivers, senders) -> None:
    src_pool = make_pool()
    side = receivers(make_pool(fill=0.0))
    result = senders(streams=8).send("small", src_pool, [5, 6, 7], side.address)
    dst_ids, _, _ = side.outcomes.wait_completed("small")
    assert result.streams == 3
    assert all(same_bits(side.pool[d], src_pool[s]) for s, d in zip([5, 6, 7], dst_ids))


def test_connections_persist_across_transfers(receivers, senders) -> None:
    src_pool = make_pool()
    side = receivers(make_pool(fill=0.0))
    sender = senders(streams=2)
    for n in range(3):
        sender.send(f"r{n}", src_pool, [n, n + 10], side.address)
        side.outcomes.wait_completed(f"r{n}")
    assert side.receiver.accepted_connections_total == 2


def test_connection_closed_by_idle_receiver_is_replaced(receivers, senders) -> None:
    src_pool = make_pool()
    side = receivers(make_pool(fill=0.0), idle_timeout_s=0.05)
    sender = senders(streams=1)
    sender.send("first", src_pool, [1], side.address)
    wait_for(lambda: side.receiver.open_connections == 0, WAIT_S, "the receiver to close its idle connection")
    sender.send("second", src_pool, [2], side.address)
    dst_ids, _, _ = side.outcomes.wait_completed("second")
    assert same_bits(side.pool[dst_ids[0]], src_pool[2])


def test_concurrent_sends_from_several_threads(receivers, senders) -> None:
    src_pool = make_pool()
    side = receivers(make_pool(fill=0.0))
    sender = senders(streams=2)
    shares = {f"t{k}": [4 * k, 4 * k + 1, 4 * k + 2, 4 * k + 3] for k in range(6)}
    errors: list[BaseException] = []

    def run(request_id: str) -> None:
        try:
            sender.send(request_id, src_pool, shares[request_id], side.address)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(rid,)) for rid in shares]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    assert errors == []
    for request_id, src_ids in shares.items():
        dst_ids, _, _ = side.outcomes.wait_completed(request_id)
        assert all(same_bits(side.pool[d], src_pool[s]) for s, d in zip(src_ids, dst_ids))


# ---------------------------------------------------------------------------------------------- failures


@pytest.mark.parametrize("streams", [1, 4])
def test_flipped_byte_fails_with_checksum_and_frees_blocks(receivers, senders, streams) -> None:
    side = receivers(make_pool(fill=0.0))
    proxy = FaultyProxy(side.address, flip_at=6000)  # past the clock frames and header, inside the KV bytes
    try:
        with pytest.raises(KVTransferError) as caught:
            senders(streams=streams).send("corrupt", make_pool(), list(range(32)), proxy.address)
    finally:
        proxy.close()
    assert caught.value.reason == "checksum"
    assert side.outcomes.wait_failed("corrupt") == "checksum"
    assert side.allocator.wait_all_free(), "destination blocks leaked"
    assert side.allocator.double_frees == []
    assert side.outcomes.completed == {}


def test_connection_cut_mid_transfer_fails_both_sides_and_receiver_keeps_serving(receivers, senders) -> None:
    src_pool = make_pool()
    side = receivers(make_pool(fill=0.0))
    proxy = FaultyProxy(side.address, cut_after=20_000)
    try:
        with pytest.raises(KVTransferError) as caught:
            senders(streams=1).send("cut", src_pool, list(range(16)), proxy.address)
    finally:
        proxy.close()
    assert caught.value.reason == "connection"
    assert side.outcomes.wait_failed("cut") == "connection"
    assert side.allocator.wait_all_free(), "destination blocks leaked"

    senders(streams=2).send("after", src_pool, [1, 2, 3], side.address)
    dst_ids, _, _ = side.outcomes.wait_completed("after")
    assert all(same_bits(side.pool[d], src_pool[s]) for s, d in zip([1, 2, 3], dst_ids))


def test_sender_that_stops_mid_stream_gets_blocks_freed(receivers) -> None:
    side = receivers(make_pool(fill=0.0))
    header = valid_header(n_blocks=2, n_streams=1, stream=0, positions=(0, 1))
    with socket.create_connection(side.address, timeout=WAIT_S) as sock:
        sock.sendall(encode_frame(header))
        assert read_frame(sock)["type"] == "ready"
        sock.sendall(b"\x01" * (header["block_bytes"] + 100))  # one block and a bit, then hang up
    assert side.outcomes.wait_failed("raw-req") == "connection"
    assert side.allocator.wait_all_free()


def test_sender_that_stalls_mid_payload_times_out_on_the_receivers_io_timeout(receivers) -> None:
    # The payload is read by blocking calls whose timeout the kernel enforces (SO_RCVTIMEO): a peer that
    # goes quiet with the connection open must still fail the transfer as a timeout, within io_timeout_s.
    side = receivers(make_pool(fill=0.0), io_timeout_s=0.3, transfer_timeout_s=60.0)
    header = valid_header(n_blocks=2, n_streams=1, stream=0, positions=(0, 1))
    with socket.create_connection(side.address, timeout=WAIT_S) as sock:
        sock.sendall(encode_frame(header))
        assert read_frame(sock)["type"] == "ready"
        sock.sendall(b"\x01" * (header["block_bytes"] // 2))  # half a block, then silence
        assert side.outcomes.wait_failed("raw-req") == "timeout"
        reply = read_frame(sock)
    assert reply["type"] == "error" and reply["reason"] == "timeout"
    assert side.allocator.wait_all_free()


def test_a_receiver_that_stops_reading_times_out_the_sender(senders) -> None:
    # The sender's payload writes are blocking with SO_SNDTIMEO: a receiver that answers the header and
    # then never reads fails the send as a timeout once the (small, fixed) socket buffers are full.
    buffer_bytes = 64 << 10
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)  # inherited by the accepted one
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    accepted: list[socket.socket] = []

    def answer_then_stall() -> None:
        conn, _ = listener.accept()
        accepted.append(conn)
        while True:
            message = read_frame(conn)
            if message["type"] == "clock":
                conn.sendall(encode_frame(reply_message("clock_reply", t1=time.time_ns(), t2=time.time_ns())))
            else:
                conn.sendall(encode_frame(reply_message("ready")))
                return  # and never read the payload

    threading.Thread(target=answer_then_stall, daemon=True).start()
    sender = senders(streams=1, io_timeout_s=0.3, clock_samples=1, socket_buffer_bytes=buffer_bytes)
    src_pool = make_pool(block_tokens=256)  # 4 MiB
    assert src_pool.numel() * src_pool.element_size() > 8 * buffer_bytes  # far more than both buffers hold
    try:
        with pytest.raises(KVTransferError) as caught:
            sender.send("stalled", src_pool, list(range(POOL_BLOCKS)), listener.getsockname()[:2])
    finally:
        for conn in accepted:
            conn.close()
        listener.close()
    assert caught.value.reason == "timeout"


def test_cancel_cuts_a_transfer_mid_payload_and_refuses_one_not_yet_started(receivers, senders) -> None:
    side = receivers(make_pool(fill=0.0))
    header = valid_header(n_blocks=2, n_streams=1, stream=0, positions=(0, 1))
    with socket.create_connection(side.address, timeout=WAIT_S) as sock:
        sock.sendall(encode_frame(header))
        assert read_frame(sock)["type"] == "ready"
        sock.sendall(b"\x01" * (header["block_bytes"] // 2))  # mid-payload: the blocks are being written
        assert side.receiver.cancel("raw-req")
        assert side.outcomes.wait_failed("raw-req") == "aborted"
        reply = read_frame(sock)  # the stream's blocked read was cut: it answers at once
    assert reply["type"] == "error" and reply["reason"] == "aborted"
    assert side.allocator.wait_all_free() and side.allocator.double_frees == []
    assert side.receiver.inflight_transfers == 0

    # A request aborted before its KV came: the transfer is refused at its header, nothing written.
    assert not side.receiver.cancel("gone")
    before = side.pool.clone()
    with pytest.raises(KVTransferError) as caught:
        senders(streams=2).send("gone", make_pool(), [1, 2, 3], side.address)
    assert caught.value.reason == "aborted"
    assert same_bits(side.pool, before) and side.allocator.wait_all_free()
    # Another request is untouched.
    senders(streams=2).send("kept", make_pool(fill=3.0), [1, 2], side.address)
    assert len(side.outcomes.wait_completed("kept")[0]) == 2


def test_bad_later_stream_fails_transfer_and_frees_blocks_once_writer_stops(receivers) -> None:
    side = receivers(make_pool(fill=0.0))
    first = valid_header(n_blocks=2, n_streams=2, stream=0, positions=(0,))
    block_bytes = first["block_bytes"]
    with socket.create_connection(side.address, timeout=WAIT_S) as writer:
        writer.sendall(encode_frame(first))
        assert read_frame(writer)["type"] == "ready"
        writer.sendall(b"\x02" * (block_bytes // 2))  # stream 0 is mid-block, a writer of the blocks
        with socket.create_connection(side.address, timeout=WAIT_S) as intruder:
            intruder.sendall(encode_frame(first))  # stream 0 again: the whole transfer is now bad
            assert read_frame(intruder)["reason"] == "bad_header"
        assert side.outcomes.wait_failed("raw-req") == "bad_header"
        assert len(side.allocator.free_ids) == POOL_BLOCKS - 2, "blocks freed while stream 0 still writes"
        writer.sendall(b"\x02" * (block_bytes - block_bytes // 2))
        reply = read_frame(writer)
    assert reply["type"] == "error" and reply["reason"] == "bad_header"
    assert side.allocator.wait_all_free()
    assert side.allocator.double_frees == []
    assert side.outcomes.failed == [("raw-req", "bad_header")]


def test_missing_stream_times_out_and_frees_blocks(receivers) -> None:
    side = receivers(make_pool(fill=0.0), transfer_timeout_s=0.2)
    header = valid_header(n_blocks=2, n_streams=2, stream=0, positions=(0,))
    payload = bytes(range(256)) * (header["block_bytes"] // 256)
    checksum = new_checksum()
    checksum.update(payload)
    with socket.create_connection(side.address, timeout=WAIT_S) as sock:
        sock.sendall(encode_frame(header))
        assert read_frame(sock)["type"] == "ready"
        sock.sendall(payload)
        sock.sendall(encode_frame(trailer_message(header["transfer_id"], 0, checksum.intdigest())))
        assert read_frame(sock)["type"] == "done"  # its own share was fine; stream 1 never comes
        assert side.outcomes.wait_failed("raw-req") == "timeout"
    assert side.allocator.wait_all_free()
    assert side.receiver.inflight_transfers == 0


def test_no_free_blocks_is_refused_and_nothing_written(receivers, senders) -> None:
    side = receivers(make_pool(fill=0.0))
    side.allocator.free_ids = side.allocator.free_ids[:2]
    side.allocator.num_blocks = 2
    with pytest.raises(KVTransferError) as caught:
        senders(streams=2).send("big", make_pool(), [1, 2, 3, 4], side.address)
    assert caught.value.reason == "refused"
    assert bool((side.pool == 0.0).all())
    assert side.allocator.wait_all_free()


def test_on_complete_raising_frees_blocks_and_refuses(receivers, senders) -> None:
    def reject(*_: Any) -> None:
        raise RuntimeError("decode worker is draining")

    side = receivers(make_pool(fill=0.0), on_complete=reject)
    with pytest.raises(KVTransferError) as caught:
        senders(streams=2).send("rejected", make_pool(), [1, 2, 3], side.address)
    assert caught.value.reason == "refused"
    assert side.allocator.wait_all_free()


def test_unreachable_receiver_is_a_connection_error(senders) -> None:
    with socket.create_server(("127.0.0.1", 0)) as placeholder:
        address = placeholder.getsockname()[:2]
    with pytest.raises(KVTransferError) as caught:
        senders().send("nobody", make_pool(), [1], address)
    assert caught.value.reason == "connection"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_ids": [64]}, "outside"),
        ({"block_ids": [1, 1]}, "repeats"),
        ({"block_ids": []}, "empty"),
        ({"meta": {"x": object()}}, "JSON"),
        ({"meta": {"x": "y" * (MAX_HEADER_BYTES + 1)}}, "limit"),
        ({"traceparent": "not-a-traceparent"}, "traceparent"),
        ({"traceparent": TRACEPARENT.upper()}, "traceparent"),
        ({"request_id": ""}, "request_id"),
    ],
)
def test_bad_send_arguments_raise_before_sending(receivers, senders, kwargs, message) -> None:
    side = receivers(make_pool(fill=0.0))
    call = {"request_id": "r", "block_ids": [1], "meta": None, "traceparent": None} | kwargs
    sender = senders()
    with pytest.raises(ValueError, match=message):
        sender.send(call["request_id"], make_pool(), call["block_ids"], side.address, call["traceparent"], call["meta"])
    assert side.allocator.allocations == 0
    assert bool((side.pool == 0.0).all())


# ---------------------------------------------------------------------------------------------- malformed frames


def valid_header(
    *, n_blocks: int = 2, n_streams: int = 1, stream: int = 0, positions: tuple[int, ...] | None = None
) -> dict[str, Any]:
    """A header the receiver accepts: request "raw-req", stream ``stream`` of ``n_streams``."""
    layout = layout_of(make_pool())
    positions = tuple(range(n_blocks)) if positions is None else positions
    return StreamHeader(
        transfer_id="ab" * 16,
        request_id="raw-req",
        traceparent=TRACEPARENT,
        dtype=layout.dtype,
        block_shape=layout.block_shape,
        block_bytes=layout.block_bytes,
        n_blocks=n_blocks,
        n_streams=n_streams,
        stream=stream,
        positions=positions,
        src_block_ids=tuple(range(len(positions))),
        nbytes=len(positions) * layout.block_bytes,
        sent_wall_ns=time.time_ns(),
        clock_offset_ns=0,
        clock_delay_ns=0,
        meta={"prompt_tokens": 3},
    ).to_wire()


def frame_of_body(body: bytes) -> bytes:
    return MAGIC + struct.pack("!I", len(body)) + body


def header_frame(**overrides: Any) -> bytes:
    """A valid header with some fields replaced by raw (possibly ill-typed) values."""
    return encode_frame(valid_header() | overrides)


def edited_json(old: str, new: str) -> bytes:
    """A valid header's JSON text with one edit JSON encoders would never make."""
    text = json.dumps(valid_header())
    assert old in text
    return text.replace(old, new).encode()


def without(key: str) -> bytes:
    header = valid_header()
    del header[key]
    return encode_frame(header)


MALFORMED = {
    "bad_json": frame_of_body(b'{"v": 1, "type": "kv", '),
    "not_an_object": frame_of_body(b"[1, 2, 3]"),
    "raw_pickle": pickle.dumps({"type": "kv", "n_blocks": 2}),
    "pickle_in_frame": frame_of_body(pickle.dumps({"type": "kv"})),
    "oversize_header": MAGIC + struct.pack("!I", MAX_HEADER_BYTES + 1),
    "nan": frame_of_body(edited_json('"offset_ns": 0', '"offset_ns": NaN')),
    "infinity": frame_of_body(edited_json('"delay_ns": 0', '"delay_ns": Infinity')),
    "duplicate_key": frame_of_body(edited_json('"n_blocks": 2', '"n_blocks": 2, "n_blocks": 1')),
    "deep_nesting": frame_of_body(b"[" * 100_000 + b"]" * 100_000),
    "not_utf8": frame_of_body(b'{"v": "\xff\xfe"}'),
    "missing_field": without("n_blocks"),
    "unknown_field": header_frame(extra="x"),
    "wrong_version": header_frame(v=2),
    "n_blocks_as_string": header_frame(n_blocks="2"),
    "stream_as_bool": header_frame(stream=False),
    "float_block_bytes": header_frame(block_bytes=4096.0),
    "position_out_of_range": header_frame(positions=[0, 2]),
    "negative_position": header_frame(positions=[-1, 0]),
    "repeated_positions": header_frame(positions=[1, 1], src_block_ids=[0, 1]),
    "more_blocks_than_pool": header_frame(n_blocks=POOL_BLOCKS + 1),
    "negative_src_block": header_frame(src_block_ids=[-1, 0]),
    "dtype_not_allowed": header_frame(dtype="float64"),
    "dtype_of_other_pool": header_frame(dtype="bfloat16"),
    "layout_mismatch": header_frame(layout={"block_shape": [2, LAYERS, 32, KV_HEADS, HEAD_DIM]}),
    "layout_not_kv": header_frame(layout={"block_shape": [3, LAYERS, 16, KV_HEADS, HEAD_DIM]}),
    "block_bytes_inconsistent": header_frame(block_bytes=4097),
    "nbytes_inconsistent": header_frame(nbytes=123),
    "stream_out_of_range": header_frame(stream=1),
    "bad_checksum_algorithm": header_frame(checksum="crc32"),
    "bad_transfer_id": header_frame(transfer_id="../../etc"),
    "bad_traceparent": header_frame(traceparent="00-zz"),
    "meta_not_object": header_frame(meta=[1, 2]),
    "unknown_type": encode_frame({"v": 1, "type": "exec", "cmd": "rm"}),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_header_is_refused_and_nothing_written(receivers, name) -> None:
    side = receivers(make_pool(fill=0.0))
    with socket.create_connection(side.address, timeout=WAIT_S) as sock:
        sock.sendall(MALFORMED[name])
        reply = read_frame(sock, eof_ok=True)
        assert read_frame(sock, eof_ok=True) is None, "receiver kept a connection that broke the protocol"
    assert reply is not None and reply["type"] == "error"
    assert reply["reason"] == "bad_header"
    assert reply["detail"]
    assert side.allocator.allocations == 0
    assert bool((side.pool == 0.0).all())
    assert side.outcomes.failed == []


def test_receiver_serves_after_refusing_malformed_frames(receivers, senders) -> None:
    side = receivers(make_pool(fill=0.0))
    for payload in (MALFORMED["raw_pickle"], MALFORMED["oversize_header"], MALFORMED["position_out_of_range"]):
        with socket.create_connection(side.address, timeout=WAIT_S) as sock:
            sock.sendall(payload)
            assert read_frame(sock)["reason"] == "bad_header"
    src_pool = make_pool()
    senders().send("fine", src_pool, [4], side.address)
    dst_ids, _, _ = side.outcomes.wait_completed("fine")
    assert same_bits(side.pool[dst_ids[0]], src_pool[4])


def test_pool_of_other_layout_is_refused_by_receiver(receivers, senders) -> None:
    side = receivers(make_pool(block_tokens=16, fill=0.0))
    with pytest.raises(KVTransferError) as caught:
        senders().send("mismatch", make_pool(block_tokens=64), [1], side.address)
    assert caught.value.reason == "bad_header"
    assert "does not match" in caught.value.detail
    assert side.allocator.allocations == 0


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(body=st.binary(max_size=256))
def test_any_frame_body_is_an_object_or_bad_header(body: bytes) -> None:
    try:
        assert isinstance(parse_frame_body(body), dict)
    except KVTransferError as error:
        assert error.reason == "bad_header"


@settings(max_examples=200, deadline=None)
@given(mutation=st.dictionaries(st.sampled_from(sorted(valid_header())), JSON_VALUES, min_size=1, max_size=3))
def test_mutated_headers_validate_or_fail_cleanly(mutation: dict[str, Any]) -> None:
    layout = layout_of(make_pool())
    try:
        header = StreamHeader.from_wire(valid_header() | mutation, layout)
    except KVTransferError as error:
        assert error.reason == "bad_header"
        return
    assert header.nbytes == len(header.positions) * layout.block_bytes
    assert all(0 <= p < header.n_blocks <= layout.num_blocks for p in header.positions)


def test_header_round_trips_through_the_wire() -> None:
    layout = layout_of(make_pool())
    message = valid_header(n_blocks=4, n_streams=2, stream=1, positions=(2, 3))
    assert StreamHeader.from_wire(json.loads(encode_frame(message)[8:]), layout).to_wire() == message


# ---------------------------------------------------------------------------------------------- clock


def test_clock_offset_and_delay_from_four_timestamps() -> None:
    # Receiver 1 ms ahead; 30 us out, 50 us back, 10 us inside the receiver.
    t0 = 1_000_000_000
    t1 = t0 + 30_000 + 1_000_000
    t2 = t1 + 10_000
    t3 = t2 - 1_000_000 + 50_000
    assert offset_and_delay_ns(t0, t1, t2, t3) == (1_000_000 - 10_000, 80_000)
    noisy = (t0, t1 + 400_000, t2 + 400_000, t3 + 800_000)  # a queued sample: larger delay, worse offset
    assert best_estimate([noisy, (t0, t1, t2, t3)]).offset_ns == 990_000


def test_clock_offset_is_near_zero_on_loopback(receivers, senders) -> None:
    side = receivers(make_pool(fill=0.0))
    estimate = senders().clock_estimate(side.address)
    assert abs(estimate.offset_ns) < 1_000_000
    assert 0 <= estimate.delay_ns < 1_000_000_000


def test_injected_receiver_skew_is_recovered_and_corrected(receivers, senders) -> None:
    skew_ns = 5_000_000_000
    side = receivers(make_pool(fill=0.0), clock_ns=lambda: time.time_ns() + skew_ns)
    sender = senders(streams=2)
    estimate = sender.clock_estimate(side.address)
    assert abs(estimate.offset_ns - skew_ns) < 1_000_000

    result = sender.send("skewed", make_pool(), [1, 2, 3], side.address)
    _, _, info = side.outcomes.wait_completed("skewed")
    assert abs(result.clock_offset_ns - skew_ns) < 1_000_000
    assert info.clock_offset_ns == result.clock_offset_ns
    naive_s = (info.recv_end_wall_ns - info.sender_start_wall_ns) / 1e9
    assert naive_s > 4.0  # what the span would show without the correction
    assert abs(info.duration_s) < 1.0
    assert abs(result.receiver_end_wall_ns - result.end_wall_ns) < 1_000_000_000


def test_clock_estimate_is_cached_until_refresh(receivers, senders) -> None:
    side = receivers(make_pool(fill=0.0))
    sender = senders()
    first = sender.clock_estimate(side.address)
    assert sender.clock_estimate(side.address) == first
    assert sender.clock_estimate(side.address, refresh=True).measured_wall_ns > first.measured_wall_ns


# ---------------------------------------------------------------------------------------------- token


def test_token_required_when_configured(receivers, senders) -> None:
    side = receivers(make_pool(fill=0.0), token="s3cret")
    for sender in (senders(), senders(token="wrong")):
        with pytest.raises(KVTransferError) as caught:
            sender.send("no-entry", make_pool(), [1], side.address)
        assert caught.value.reason == "unauthorized"
    assert side.allocator.allocations == 0
    assert bool((side.pool == 0.0).all())

    senders(token="s3cret").send("entry", make_pool(), [1], side.address)
    side.outcomes.wait_completed("entry")


def test_token_comes_from_environment(receivers, senders, monkeypatch) -> None:
    monkeypatch.setenv(TOKEN_ENV_VAR, "from-env")
    side = receivers(make_pool(fill=0.0))
    senders().send("env", make_pool(), [1], side.address)
    side.outcomes.wait_completed("env")
    with pytest.raises(KVTransferError) as caught:
        senders(token="other").send("env-wrong", make_pool(), [1], side.address)
    assert caught.value.reason == "unauthorized"


def test_no_token_configured_accepts_any(receivers, senders) -> None:
    side = receivers(make_pool(fill=0.0))
    senders(token="anything").send("open", make_pool(), [1], side.address)
    side.outcomes.wait_completed("open")


def test_binding_beyond_loopback_needs_a_token() -> None:
    allocator = BlockAllocator(POOL_BLOCKS)
    with pytest.raises(ValueError, match=TOKEN_ENV_VAR):
        KVReceiver(
            make_pool(fill=0.0),
            allocate_blocks=allocator.allocate,
            free_blocks=allocator.free,
            on_complete=lambda *a: None,
            on_failed=lambda *a: None,
            host="0.0.0.0",
        )


# ---------------------------------------------------------------------------------------------- pool access


def test_consecutive_runs_are_merged_up_to_a_cap() -> None:
    assert consecutive_runs([3, 4, 5, 9, 1, 2], max_run_blocks=2) == [(3, 2), (5, 1), (9, 1), (1, 2)]


def test_layout_of_rejects_pools_the_wire_cannot_carry() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        layout_of(make_pool().transpose(3, 4))
    with pytest.raises(ValueError, match="dtype"):
        layout_of(make_pool().to(torch.float64))
    with pytest.raises(ValueError, match="num_blocks"):
        layout_of(torch.zeros(4, 2, 3))
    assert layout_of(make_pool()) == BlockLayout("float32", (2, LAYERS, 16, KV_HEADS, HEAD_DIM), POOL_BLOCKS)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned-staging path needs a CUDA device")
def test_round_trip_between_cuda_pools(receivers, senders) -> None:
    src_pool = make_pool(dtype=torch.bfloat16).cuda()
    side = receivers(make_pool(dtype=torch.bfloat16, fill=0.0).cuda())
    src_ids = [2, 3, 4, 30, 31]
    senders(streams=2).send("cuda", src_pool, src_ids, side.address)
    dst_ids, _, _ = side.outcomes.wait_completed("cuda")
    assert all(same_bits(side.pool[d], src_pool[s]) for s, d in zip(src_ids, dst_ids))


# -------------------------------------------------------------------------- payload batching helpers


def test_batches_keep_every_byte_in_order_and_stay_under_the_bound() -> None:
    data = bytes(random.Random(3).randrange(256) for _ in range(19_000))
    runs = [memoryview(data)[a:b] for a, b in ((0, 3_000), (3_000, 8_000), (8_000, 19_000))]
    batches = list(batched((run for run in runs), 4_096, across_runs=True))
    assert b"".join(bytes(piece) for batch in batches for piece in batch) == data
    assert all(sum(len(piece) for piece in batch) <= 4_096 for batch in batches)
    assert [sum(len(piece) for piece in batch) for batch in batches] == [4_096] * 4 + [2_616]  # runs gathered


def test_staged_batches_never_span_runs_and_take_the_next_run_only_when_done() -> None:
    consumed: list[str] = []

    def staged_runs() -> Iterator[memoryview]:
        for name, size in (("a", 3_000), ("b", 9_000)):
            consumed.append(f"give {name}")
            yield memoryview(bytearray(size))
            consumed.append(f"resume after {name}")  # where a staged pool copies the buffer out

    sizes = []
    for batch in batched(staged_runs(), 4_096, across_runs=False):
        sizes.append([len(piece) for piece in batch])
        consumed.append("used")
    assert sizes == [[3_000], [4_096], [4_096], [808]]
    assert consumed == ["give a", "used", "resume after a", "give b", "used", "used", "used", "resume after b"]


class _TrickleSocket:
    """sendmsg that takes at most `limit` bytes per call, like a socket interrupted mid-batch."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.sent = bytearray()

    def sendmsg(self, views: list[memoryview]) -> int:
        taken = bytes(b"".join(bytes(view) for view in views))[: self.limit]
        self.sent += taken
        return len(taken)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=40), min_size=1, max_size=6), st.integers(1, 50))
def test_sendmsg_all_resumes_partial_sends_exactly(pieces: list[bytes], limit: int) -> None:
    sock = _TrickleSocket(limit)
    sendmsg_all(sock, [memoryview(piece) for piece in pieces])  # type: ignore[arg-type]
    assert bytes(sock.sent) == b"".join(pieces)


def test_recvmsg_exactly_into_fills_scattered_views_from_a_trickling_peer() -> None:
    left, right = socket.socketpair()
    payload = bytes(range(256)) * 40
    targets = [bytearray(1_000), bytearray(7_000), bytearray(2_240)]

    def trickle() -> None:
        for begin in range(0, len(payload), 777):
            left.sendall(payload[begin : begin + 777])

    sender = threading.Thread(target=trickle)
    sender.start()
    try:
        recvmsg_exactly_into(right, [memoryview(target) for target in targets])
    finally:
        sender.join(WAIT_S)
        left.close()
        right.close()
    assert b"".join(targets) == payload


def test_closing_the_batches_early_closes_the_runs_behind_them() -> None:
    released: list[bool] = []

    def staged_runs() -> Iterator[memoryview]:
        try:
            while True:
                yield memoryview(bytearray(8_192))
        finally:
            released.append(True)  # where a staged pool returns its pinned buffer

    batches = batched(staged_runs(), 4_096, across_runs=False)
    next(batches)
    batches.close()
    assert released == [True]
