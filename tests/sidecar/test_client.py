"""SidecarSink: never blocks, bounded, counts drops, reconnects; the sidecar's Unix ingest end to end."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading

import pytest

from tests.sidecar.conftest import spans_when, wait_for
from tracer import spans as s
from tracer.sidecar import wire
from tracer.sidecar.client import SidecarSink
from tracer.sidecar.ingest_queue import Batch, IngestQueue


def _steps(n: int, start_ns: int = 1_000) -> list[s.SpanData]:
    attrs = {s.ATTR_POOL: "decode", s.ATTR_WORKER: "d0", s.ATTR_STEP_PREFILL_TOKENS: 0}
    return [s.SpanData(s.SPAN_STEP, 1, 7, i + 1, 0, start_ns + i, start_ns + i + 10, dict(attrs)) for i in range(n)]


def test_with_no_sidecar_emit_returns_buffers_boundedly_and_counts_drops(tmp_path):
    drops = []
    sink = SidecarSink(tmp_path / "absent.sock", on_drop=drops.append, max_buffered_spans=100, max_backoff_s=0.05)
    try:
        for _ in range(10):
            sink.emit(_steps(30))  # 300 spans into a 100-span buffer, nobody listening
        assert sink.buffered_spans <= 100
        assert sum(drops) == 300 - sink.buffered_spans and sum(drops) >= 200
        wait_for(lambda: sink.last_error, what="a failed connection attempt")
        assert not sink.connected
    finally:
        sink.shutdown(0.2)
    assert sum(drops) == 300  # what was still buffered at shutdown is dropped and counted too


def test_a_sidecar_that_stops_reading_never_blocks_emit(tmp_path):
    path = str(tmp_path / "stuck.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    accepted = []

    def accept_and_stall() -> None:  # answers the handshake, then never reads again
        conn, _ = listener.accept()
        conn.recv(wire.HANDSHAKE_MAX_BYTES)
        conn.sendall(wire.encode_answer(None))
        accepted.append(conn)

    threading.Thread(target=accept_and_stall, daemon=True).start()
    drops = []
    sink = SidecarSink(path, on_drop=drops.append, max_buffered_spans=4096, send_timeout_s=0.5, resource={})
    try:
        big = _steps(2048)
        for _ in range(200):  # ~200 MB offered to a peer that reads nothing: emit must keep returning
            sink.emit(big)
        assert sink.buffered_spans <= 4096 and sum(drops) > 0
    finally:
        sink.shutdown(0.2)
        listener.close()
        for conn in accepted:
            conn.close()


def test_sink_reconnects_when_the_sidecar_appears_and_after_it_restarts(make_sidecar, tmp_path):
    path = str(tmp_path / "late.sock")
    drops = []
    sink = SidecarSink(path, on_drop=drops.append, max_backoff_s=0.05)
    try:
        sink.emit(_steps(5))  # buffered while nobody listens
        sidecar = make_sidecar(http_port=None, grpc_port=None, unix_socket=path)
        spans_when(tmp_path / "traces.jsonl", 5)
        assert sink.connects == 1 and not drops
        sidecar.stop(2.0)  # the sidecar goes away ...
        for _ in range(50):
            sink.emit(_steps(1, start_ns=10_000))  # ... the worker keeps serving
        wait_for(lambda: not sink.connected, what="the sink to notice the sidecar is gone")
        make_sidecar(http_port=None, grpc_port=None, unix_socket=path, traces_file=str(tmp_path / "second.jsonl"))
        sink.emit(_steps(3, start_ns=20_000))
        wait_for(lambda: sink.connects == 2, what="a reconnect")
        spans_when(tmp_path / "second.jsonl", 3)
    finally:
        sink.shutdown(1.0)
    assert sink.sent_spans + sink.dropped_spans == 5 + 50 + 3  # every span either arrived or was counted


def test_session_in_a_subprocess_ships_spans_through_the_socket(make_sidecar, tmp_path):
    sock = str(tmp_path / "w.sock")
    sidecar = make_sidecar(http_port=None, grpc_port=None, unix_socket=sock)
    worker = textwrap.dedent(f"""
        from tracer import TraceContext, start_tracing
        from tracer import spans as s
        session = start_tracing("prefill", "p0", sidecar_socket={sock!r})
        ctx = TraceContext.new_root().child(0x42)
        session.tracer.stage("queue", ctx, 0, 2_000_000)
        session.tracer.stage("prefill", ctx, 2_000_000, 50_000_000, {{s.ATTR_PREFILL_TOKENS: 100}})
        for i in range(20):
            session.tracer.step(i * 1000, i * 1000 + 500, 1, 100 if i % 2 else 0, 10)
        session.shutdown(5.0)
        import sys
        heavy = [m for m in ("opentelemetry.sdk", "prometheus_client", "numpy", "torch") if m in sys.modules]
        print(session.dropped_records.by_reason(), heavy)
    """)
    result = subprocess.run([sys.executable, "-c", worker], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    # Nothing dropped on the worker side, and the whole sidecar path ran without the SDK or metrics libraries.
    assert result.stdout.strip() == "{} []"
    spans = spans_when(tmp_path / "traces.jsonl", 22)
    assert sorted({span.name for span in spans}) == [s.SPAN_PREFILL, s.SPAN_QUEUE, s.SPAN_STEP]
    prefill = next(span for span in spans if span.name == s.SPAN_PREFILL)
    assert prefill.parent_span_id == f"{0x42:016x}" and prefill.duration_s == pytest.approx(0.048)
    assert prefill.resource["service.name"] == "splitscope-prefill"  # as the worker would name itself
    # Metered as the worker's own series: labelled with the worker that named itself in its handshake.
    registry = sidecar.exposed_registry
    assert (
        registry.get_sample_value(
            "splitscope_step_duration_seconds_count", {"pool": "prefill", "prefill_in_step": "true", "worker": "p0"}
        )
        == 10
    )
    assert (
        registry.get_sample_value(
            "splitscope_stage_duration_seconds_count", {"stage": "queue", "pool": "prefill", "worker": "p0"}
        )
        == 1
    )
    assert (
        registry.get_sample_value(
            "splitscope_step_duration_seconds_count", {"pool": "prefill", "prefill_in_step": "true"}
        )
        is None
    )


def test_malformed_frames_close_only_that_connection(make_sidecar, tmp_path):
    path = str(tmp_path / "bad.sock")
    sidecar = make_sidecar(http_port=None, grpc_port=None, unix_socket=path)
    for payload in (b"\xc1garbage", wire.encode_frame(_steps(1))[4:].replace(b"splitscope.step", b"\xff" * 15)):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(path)
            conn.sendall(wire.encode_handshake("", {}))
            assert wire.decode_answer(conn.recv(1024)) is None
            conn.sendall(wire.FRAME_HEADER.pack(len(payload)) + payload)
            assert conn.recv(1024) == b""  # the sidecar closed this connection
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(path)
        conn.sendall(b"GET / HTTP/1.0\n")
        assert "handshake" in wire.decode_answer(conn.recv(1024))
    assert (
        sidecar.registry.get_sample_value("splitscope_tracer_dropped_records_total", {"reason": "sidecar_bad_frame"})
        == 2
    )
    sink = SidecarSink(path)
    try:
        sink.emit(_steps(4))
        spans_when(tmp_path / "traces.jsonl", 4)  # good clients are unaffected
    finally:
        sink.shutdown(1.0)


@pytest.mark.parametrize(
    "bad",
    [
        [["x", 1, -1, 1, 1, 0, 0, 1, {}, [], "", {}, True]],
        [["x", 1, 0, 0, 1, 0, 0, 1, {}, [], "", {}, True]],
        [["x", 1, 0, 1, 1, 0, 5, 1, {}, [], "", {}, True]],
        [["x", 1, 0, 1, 1, 0, 0, 1, {}, [], "", {"itl_gaps_s": ["nan?"]}, True]],
        [["x", 1, 0, 1, 1, 0, 0, 1, {}, [], "", {}, True, [[0, -1, 2, {}]]]],
        [["x", 1, 0, 1, 1, 0, 0, 1, {}, [], "", {}, True, [], "extra"]],
        {"not": "a list"},
    ],
    ids=[
        "negative-id",
        "zero-trace-id",
        "ends-before-start",
        "samples-not-numbers",
        "negative-link-id",
        "too-many-fields",
        "not-a-list",
    ],
)
def test_decode_payload_rejects_malformed_records(bad):
    import msgspec

    with pytest.raises(wire.WireError):
        wire.decode_payload(msgspec.msgpack.encode(bad))


def test_wire_round_trip_keeps_every_field():
    span = s.SpanData(
        "splitscope.decode",
        1,
        (1 << 127) + 5,
        (1 << 63) + 1,
        9,
        100,
        200,
        {"a": [1, 2], "b": 0.5, "c": None},
        events=[("splitscope.decode.stall", 150, {"gap_s": 0.07})],
        error_type="oom",
        samples={"itl_gaps_s": [0.01, 0.02]},
        sampled=False,
        links=[((1 << 127) + 7, (1 << 63) + 3, {s.ATTR_LINK_STALLED_NS: 70_000_000})],
    )
    (back,) = wire.decode_payload(wire.encode_frame([span])[4:])
    assert back == span


def test_a_record_without_links_is_the_older_clients_record():
    """A span without links goes out as the 13 fields a version-2 client sends, and such a record
    (from an older client) reads back with no links."""
    import msgspec

    span = s.SpanData("splitscope.step", 1, 5, 6, 0, 100, 200, {"a": 1})
    (record,) = msgspec.msgpack.decode(wire.encode_frame([span])[4:])
    assert len(record) == 13
    (back,) = wire.decode_payload(msgspec.msgpack.encode([record]))
    assert back == span and back.links == []


def test_ingest_queue_is_bounded_by_spans_and_counts_refusals():
    refused = []
    queue = IngestQueue(10, lambda reason, n: refused.append((reason, n)))
    assert queue.offer(Batch((), _steps(6))) and not queue.offer(Batch((), _steps(6)))
    assert queue.offer(Batch((), _steps(4))) and len(queue) == 10
    assert refused == [("sidecar_queue_full", 6)]
    assert [len(b.spans) for b in queue.take(0.0)] == [6, 4] and len(queue) == 0
