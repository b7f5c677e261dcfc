"""Child process of test_flood_memory.py: one process's real tracing stack, its export dead, flooded.

    python -m tests.faults.flood_tracing {sidecar|otlp-http|otlp-grpc} SPANS

Starts tracing as a worker does (`start_tracing`), with its spans going to a sidecar socket nobody
listens on, or over OTLP to a closed port, then records SPANS engine steps through the tracer, paced so
the ring never overflows (every span reaches the sink, whose bound is what is under test). Prints one
JSON object: spans produced and emitted, drops by reason, what the sink still holds, and the process's
RSS (VmRSS, bytes) before and after the flood, measured once everything was emitted.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

CHUNK_SPANS = 2048
DRAIN_TIMEOUT_S = 120.0


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"flood: timed out waiting for {what}")
        time.sleep(0.01)  # poll interval


def main(kind: str, spans: int) -> dict:
    if kind.startswith("otlp-"):
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{closed_port()}"
        os.environ["OTEL_EXPORTER_OTLP_PROTOCOL"] = "grpc" if kind == "otlp-grpc" else "http/protobuf"
    from tracer import start_tracing  # after the environment is set: exporters read it
    from tracer.vocabulary import DropReason

    socket_dir = tempfile.mkdtemp(prefix="flood-")
    dead_socket = os.path.join(socket_dir, "nobody-listens.sock") if kind == "sidecar" else None
    session = start_tracing("colocated", "w0", sidecar_socket=dead_socket)
    tracer, pipeline, ring = session.tracer, session.pipeline, session.tracer.ring

    def record(count: int) -> None:
        for _ in range(count):
            tracer.step(tracer.mark(), tracer.mark(), 8, 0, 4096)

    produced = 0

    def flood(count: int) -> None:
        nonlocal produced
        while count > 0:
            n = min(CHUNK_SPANS, count)
            wait_until(lambda: len(ring) < ring.capacity // 4, "the ring to drain")
            record(n)
            produced += n
            count -= n
        wait_until(lambda: pipeline.emitted >= produced, "every span to reach the sink")

    flood(4 * CHUNK_SPANS)  # warm-up: imports, exporter threads, first allocations
    gc.collect()
    rss_before = rss_bytes()
    flood(spans)
    gc.collect()
    rss_after = rss_bytes()

    sink = pipeline.sink
    if kind == "sidecar":
        held = sink.buffered_spans
        cap = sink.max_buffered_spans
    else:
        (processor,) = sink.processors
        held = len(processor._batch_processor._queue)
        cap = processor._batch_processor._max_queue_size
    counted = session.dropped_records.by_reason()  # on either path, with or without a Prometheus catalogue
    dropped = {str(reason): float(counted.get(reason, 0)) for reason in DropReason}
    return {
        "kind": kind,
        "produced": produced,
        "emitted": pipeline.emitted,
        "dropped": dropped,
        "held": held,
        "cap": cap,
        "rss_before": rss_before,
        "rss_after": rss_after,
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]))))
    sys.stdout.flush()
    os._exit(0)  # the exporters would retry the dead endpoint on the way out; nothing is left to check
