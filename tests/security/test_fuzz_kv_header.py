"""Property-based fuzzing of the KV transfer header parser over real sockets to a KVReceiver.

Extends the unit-level hypothesis tests in tests/reference_server/test_transfer.py (frame bodies and
header fields) to the wire: arbitrary bytes, frames with arbitrary or truncated JSON bodies, valid
headers with fields replaced by arbitrary JSON, and huge declared lengths. The receiver answers each with
an error frame or `ready` (a header that happens to be valid), or closes; it never writes a KV byte it did
not receive, frees every block it allocated, and still completes a real transfer afterwards.
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reference_server.kv_transfer import (
    FAILURE_REASONS,
    TOKEN_ENV_VAR,
    KVSender,
    KVTransferError,
)
from reference_server.kv_transfer.wire import MAGIC, MAX_HEADER_BYTES, read_frame
from tests.reference_server.test_transfer import (
    JSON_VALUES,
    Side,
    make_pool,
    same_bits,
    valid_header,
)

FUZZ_CASES = 300
TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def side() -> Iterator[Side]:
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(TOKEN_ENV_VAR, raising=False)  # no token on either side
        # Short timeouts: a fuzzed header that is valid waits for streams that never come.
        receiver_side = Side(make_pool(fill=0.0), io_timeout_s=2.0, transfer_timeout_s=2.0)
        yield receiver_side
        receiver_side.receiver.close()


def _frame(body: bytes, declared: int | None = None) -> bytes:
    return MAGIC + struct.pack("!I", len(body) if declared is None else declared) + body


def _mutated_header(mutation: dict[str, Any]) -> bytes:
    # json.dumps, not encode_frame: a sender's encoder refuses Infinity, a hostile peer does not.
    return _frame(json.dumps(valid_header() | mutation).encode())


payloads = st.one_of(
    st.binary(max_size=300),
    st.binary(max_size=300).map(_frame),
    JSON_VALUES.map(lambda v: _frame(json.dumps(v).encode())),
    st.dictionaries(st.sampled_from(sorted(valid_header())), JSON_VALUES, min_size=1, max_size=3).map(_mutated_header),
    st.tuples(st.binary(max_size=64), st.integers(65, MAX_HEADER_BYTES)).map(lambda t: _frame(t[0], t[1])),  # truncated
    st.integers(MAX_HEADER_BYTES + 1, 2**32 - 1).map(lambda n: _frame(b"", n)),  # huge declared length
)


def _exchange(address: tuple[str, int], payload: bytes) -> dict[str, Any] | None:
    """Send `payload`, half-close, and return the receiver's first frame (None: it just closed)."""
    with socket.create_connection(address, timeout=TIMEOUT_S) as sock:
        try:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            return None
        try:
            return read_frame(sock, eof_ok=True)
        except KVTransferError as error:
            assert error.reason in ("connection", "timeout"), error  # its answer itself is never malformed
            return None


def test_fuzzed_kv_headers_are_refused_or_validated_over_the_wire(side: Side) -> None:
    """300 fuzzed frames (FUZZ_CASES) on real connections; no byte reaches the pool, every block comes back."""
    replies: list[str] = []

    @settings(max_examples=FUZZ_CASES, deadline=None, database=None)
    @given(payload=payloads)
    def case(payload: bytes) -> None:
        reply = _exchange(side.address, payload)
        if reply is None:
            replies.append("closed")
            return
        assert reply.get("type") in ("error", "ready"), reply
        if reply["type"] == "error":
            assert reply["reason"] in FAILURE_REASONS and reply["detail"], reply
        replies.append(reply.get("reason", reply["type"]))

    case()
    assert len(replies) >= FUZZ_CASES
    assert "bad_header" in replies
    assert side.allocator.wait_all_free(), "blocks of fuzzed transfers were never freed"
    assert side.allocator.double_frees == []
    assert bool((side.pool == 0.0).all()), "a fuzzed frame wrote into the pool"
    source = make_pool()
    with KVSender() as sender:
        sender.send("after-fuzz", source, [3, 5], side.address)
    block_ids, _, _ = side.outcomes.wait_completed("after-fuzz")
    assert same_bits(side.pool[block_ids[0]], source[3]) and same_bits(side.pool[block_ids[1]], source[5])
