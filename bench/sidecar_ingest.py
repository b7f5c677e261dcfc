"""Sidecar ingest throughput, measured in one run (records or spans per second, and ratios).

1. Unix socket -> file: a worker process blasts pre-encoded frames (wire.py) of a realistic record mix
   (per request: queue, prefill, decode with 16 inter-token gaps, and 8 engine-step records) into a
   running sidecar; the figure is records per second from the first byte sent to the last span written
   to --traces-file (metrics recorded for every record). Target: >= 100k records/s on 2 cores.
   The same records through the SDK path (LocalSink -> BatchSpanProcessor -> OtlpJsonFileExporter, what
   a worker exporting in-process does) give the ratio of the fast path to the SDK path.
2. OTLP receive -> file: a client process posts pre-encoded OTLP/HTTP protobuf requests (512 spans each,
   the SDK's default batch) over one keep-alive connection, and the same through OTLP/gRPC; the figure
   is spans per second from the first request to the last span written.

The ingest queue is sized to hold the whole run, so nothing is dropped and the figure is the export
thread's sustained capacity (drops are printed; they must be 0).

    .venv/bin/python bench/sidecar_ingest.py [--requests 40000] [--otlp-spans 102400]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from opentelemetry.sdk.trace.export import BatchSpanProcessor
from prometheus_client import CollectorRegistry

from tracer import spans as s
from tracer.export.local_sink import LocalSink, MetricsRecorder
from tracer.export.otel import OtlpJsonFileExporter, make_resource, to_readable_span
from tracer.metrics import Catalogue
from tracer.sidecar import wire
from tracer.sidecar.server import Sidecar, SidecarConfig, tune_gc_for_ingest

RECORDS_PER_REQUEST = 11


def record_mix(requests: int) -> list[s.SpanData]:
    out = []
    t = 1_700_000_000_000_000_000
    common = {s.ATTR_POOL: "colocated", s.ATTR_WORKER: "w0", s.ATTR_TIMING_SOURCE: "cuda"}
    for r in range(requests):
        trace_id, parent = s.new_trace_id(), s.new_span_id()
        out.append(s.SpanData(s.SPAN_QUEUE, 1, trace_id, s.new_span_id(), parent, t, t + 2_000_000, dict(common)))
        out.append(
            s.SpanData(
                s.SPAN_PREFILL,
                1,
                trace_id,
                s.new_span_id(),
                parent,
                t + 2_000_000,
                t + 40_000_000,
                {
                    **common,
                    s.ATTR_PREFILL_TOKENS: 512 + r % 1024,
                    s.ATTR_PREFILL_CACHED_TOKENS: 64,
                    s.ATTR_PREFILL_CHUNKS: 1,
                },
            )
        )
        gaps = [0.02 + (i % 3) * 0.001 for i in range(16)]
        out.append(
            s.SpanData(
                s.SPAN_DECODE,
                1,
                trace_id,
                s.new_span_id(),
                parent,
                t + 40_000_000,
                t + 400_000_000,
                {
                    **common,
                    s.ATTR_OUTPUT_TOKENS: 17,
                    s.ATTR_DECODE_ITL_P50_S: 0.021,
                    s.ATTR_DECODE_ITL_P99_S: 0.022,
                    s.ATTR_DECODE_ITL_MAX_S: 0.022,
                    s.ATTR_DECODE_STALLS: 0,
                },
                samples={"itl_gaps_s": gaps},
            )
        )
        for i in range(8):
            out.append(
                s.SpanData(
                    s.SPAN_STEP,
                    1,
                    99,
                    s.new_span_id(),
                    0,
                    t + i * 25_000_000,
                    t + i * 25_000_000 + 20_000_000,
                    {
                        **common,
                        s.ATTR_STEP_DECODE_REQUESTS: 8,
                        s.ATTR_STEP_PREFILL_TOKENS: 512 if i == 0 else 0,
                        s.ATTR_STEP_CONTEXT_TOKENS: 4000 + i,
                    },
                )
            )
        t += 10_000_000
    return out


def wait_exported(sidecar: Sidecar, count: int, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sidecar.export.exported_spans < count:
        if time.monotonic() > deadline:
            raise SystemExit(f"only {sidecar.export.exported_spans} of {count} exported")
        time.sleep(0.002)


def dropped(sidecar: Sidecar) -> float:
    return sum(
        sidecar.registry.get_sample_value("splitscope_tracer_dropped_records_total", {"reason": r}) or 0.0
        for r in ("sidecar_queue_full", "sidecar_bad_frame", "sidecar_export_failed")
    )


# Both clients: connect to the sidecar at `path`, handshake, say "go", then wait for the start line.
_CONNECT = """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    sock.sendall(wire.encode_handshake("", {"service.name": "bench-worker"}))
    assert wire.decode_answer(sock.recv(1024)) is None
    sys.stdout.write("go\\n"); sys.stdout.flush()
    sys.stdin.readline()
"""

UNIX_CLIENT = textwrap.dedent(
    """
    import socket, sys
    from tracer.sidecar import wire
    path, frames_file = sys.argv[1], sys.argv[2]
    data = open(frames_file, "rb").read()
"""
    + _CONNECT
    + """
    sock.sendall(data)
    sock.close()
"""
)


PACED_CLIENT = textwrap.dedent(
    """
    import socket, sys, time
    from tracer.sidecar import wire
    path, frames_file, frame_records, rate = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    data = open(frames_file, "rb").read()
    frames, offset = [], 0
    while offset < len(data):
        (length,) = wire.FRAME_HEADER.unpack_from(data, offset)
        frames.append(data[offset : offset + 4 + length])
        offset += 4 + length
"""
    + _CONNECT
    + """
    start = time.perf_counter()
    for i, frame in enumerate(frames):
        due = start + i * frame_records / rate
        while time.perf_counter() < due:
            time.sleep(0.0005)
        sock.sendall(frame)
    sys.stdout.write(f"{time.perf_counter() - start}\\n"); sys.stdout.flush()
    sock.close()
"""
)


def bench_unix_paced(records: list[s.SpanData], workdir: Path, rate: float) -> tuple[float, float, float]:
    """Send at `rate` records/s with the default queue bound: (seconds sending, lag after the last send
    until all were written, drops)."""
    frames_file = workdir / "frames.bin"
    frames_file.write_bytes(b"".join(wire.encode_frame(records[i : i + 512]) for i in range(0, len(records), 512)))
    sock, traces = workdir / "paced.sock", workdir / "paced.jsonl"
    sidecar = Sidecar(
        SidecarConfig(
            http_port=None, grpc_port=None, unix_socket=str(sock), traces_file=str(traces), gpu=False, environ={}
        )
    ).start()
    client = subprocess.Popen(
        [sys.executable, "-c", PACED_CLIENT, str(sock), str(frames_file), "512", str(rate)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert client.stdout.readline().strip() == "go"
    client.stdin.write("\n")
    client.stdin.flush()
    sending_s = float(client.stdout.readline())
    sent_at = time.perf_counter()
    drops = dropped(sidecar)
    if drops == 0:
        wait_exported(sidecar, len(records))
    lag_s = time.perf_counter() - sent_at
    client.wait(60)
    drops = dropped(sidecar)
    sidecar.stop()
    return sending_s, lag_s, drops


def bench_unix(records: list[s.SpanData], workdir: Path) -> tuple[float, float]:
    frames = b"".join(wire.encode_frame(records[i : i + 512]) for i in range(0, len(records), 512))
    frames_file = workdir / "frames.bin"
    frames_file.write_bytes(frames)
    sock, traces = workdir / "bench.sock", workdir / "unix.jsonl"
    sidecar = Sidecar(
        SidecarConfig(
            http_port=None,
            grpc_port=None,
            unix_socket=str(sock),
            traces_file=str(traces),
            gpu=False,
            max_queued_spans=len(records) + 1,
            environ={},
        )
    ).start()
    client = subprocess.Popen(
        [sys.executable, "-c", UNIX_CLIENT, str(sock), str(frames_file)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert client.stdout.readline().strip() == "go"
    start = time.perf_counter()
    client.stdin.write("\n")
    client.stdin.flush()
    wait_exported(sidecar, len(records))
    elapsed = time.perf_counter() - start
    client.wait(60)
    drops = dropped(sidecar)
    sidecar.stop()
    return len(records) / elapsed, drops


def bench_sdk_path(records: list[s.SpanData], workdir: Path) -> float:
    # The queue holds the whole run, so this measures the SDK path's capacity, not its drops.
    processor = BatchSpanProcessor(
        OtlpJsonFileExporter(workdir / "sdk.jsonl"),
        max_queue_size=len(records) + 1,
        max_export_batch_size=512,
        schedule_delay_millis=500,
    )
    sink = LocalSink(make_resource("bench-worker"), [processor], MetricsRecorder(Catalogue(CollectorRegistry())))
    start = time.perf_counter()
    for i in range(0, len(records), 512):
        sink.emit(records[i : i + 512])
    sink.shutdown(600.0)
    return len(records) / (time.perf_counter() - start)


OTLP_CLIENT = textwrap.dedent("""
    import http.client, sys
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
    protocol, port, body_file, n = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    body = open(body_file, "rb").read()
    sys.stdout.write("go\\n"); sys.stdout.flush()
    sys.stdin.readline()
    if protocol == "http":
        conn = http.client.HTTPConnection("127.0.0.1", port)
        for _ in range(n):
            conn.request("POST", "/v1/traces", body, {"Content-Type": "application/x-protobuf"})
            response = conn.getresponse(); response.read()
            assert response.status == 200, response.status
    else:
        stub = trace_service_pb2_grpc.TraceServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
        for _ in range(n):
            stub.Export(request, timeout=30)
""")


def bench_otlp(protocol: str, total_spans: int, workdir: Path) -> tuple[float, float]:
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    resource = make_resource("bench-worker")
    batch = [to_readable_span(d, resource) for d in record_mix(512 // RECORDS_PER_REQUEST + 1)[:512]]
    body_file = workdir / "otlp.bin"
    body_file.write_bytes(encode_spans(batch).SerializeToString())
    requests = total_spans // 512
    traces = workdir / f"otlp-{protocol}.jsonl"
    sidecar = Sidecar(
        SidecarConfig(
            http_port=0 if protocol == "http" else None,
            grpc_port=0 if protocol == "grpc" else None,
            traces_file=str(traces),
            gpu=False,
            max_queued_spans=requests * 512 + 1,
            environ={},
        )
    ).start()
    port = sidecar.http_port if protocol == "http" else sidecar.grpc_port
    client = subprocess.Popen(
        [sys.executable, "-c", OTLP_CLIENT, protocol, str(port), str(body_file), str(requests)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert client.stdout.readline().strip() == "go"
    start = time.perf_counter()
    client.stdin.write("\n")
    client.stdin.flush()
    wait_exported(sidecar, requests * 512)
    elapsed = time.perf_counter() - start
    assert client.wait(60) == 0
    drops = dropped(sidecar)
    sidecar.stop()
    return requests * 512 / elapsed, drops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40_000, help="requests in the record mix (11 records each)")
    parser.add_argument("--otlp-spans", type=int, default=102_400)
    parser.add_argument("--paced-seconds", type=int, default=3, help="seconds of the paced 100k records/s run")
    args = parser.parse_args()
    records = record_mix(args.requests)
    tune_gc_for_ingest()  # as `splitscope sidecar` does; the SDK path below gets the same setting
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        unix_rate, unix_drops = bench_unix(records, workdir)
        paced = bench_unix_paced(records[: args.paced_seconds * 100_000], workdir, 100_000)
        sdk_rate = bench_sdk_path(records[: min(len(records), 110_000)], workdir)
        http_rate, http_drops = bench_otlp("http", args.otlp_spans, workdir)
        grpc_rate, grpc_drops = bench_otlp("grpc", args.otlp_spans, workdir)
    print(f"machine: {os.cpu_count()} cores; records: {len(records):,} ({RECORDS_PER_REQUEST} per request)")
    print(
        f"unix socket -> file : {unix_rate:>10,.0f} records/s  (target 100,000: {unix_rate / 100_000:.2f}x; drops {unix_drops:.0f})"
    )
    print(
        f"paced 100,000 records/s for {paced[0]:.1f} s (default queue bound): drops {paced[2]:.0f}, "
        f"last record written {paced[1] * 1000:.0f} ms after the last one was sent"
    )
    print(
        f"SDK path (in-process LocalSink -> file): {sdk_rate:>10,.0f} records/s; fast path / SDK path = {unix_rate / sdk_rate:.1f}x"
    )
    print(f"OTLP/HTTP protobuf -> file : {http_rate:>10,.0f} spans/s (drops {http_drops:.0f})")
    print(f"OTLP/gRPC -> file          : {grpc_rate:>10,.0f} spans/s (drops {grpc_drops:.0f})")


if __name__ == "__main__":
    main()
