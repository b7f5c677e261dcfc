"""Memory stays bounded when export is dead for long enough to fill every buffer (architecture.md §9: every queue
and buffer is bounded; every drop is counted).

The serving tests produce a few thousand spans per outage, far below the buffers' caps. Here one
process's real tracing stack (`start_tracing`, as a worker runs it) gets many times its cap in spans with
its sidecar gone or its OTLP collector's port closed (tests/faults/flood_tracing.py, in a child process so
its RSS is its own). The sink holds no more than its cap, every other span is counted as dropped, and RSS
grows by about the cap's worth, a fraction of what keeping every span would take; that figure is
computed here from the measured size of one span.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tracemalloc

import pytest
from opentelemetry.sdk.resources import Resource

from tests.conftest import REPO_ROOT
from tracer import spans as s
from tracer.export.otel import to_readable_span
from tracer.sidecar import wire

SPANS = {"sidecar": 800_000, "otlp-http": 120_000, "otlp-grpc": 120_000}
OTLP_BATCH_SPANS = 512  # one batch may sit in the dead exporter's retry loop, neither queued nor dropped
OVERHEAD_FACTOR = 2.5  # allocator and container overhead around what a buffer holds
RSS_SLACK_BYTES = 16 << 20
FLOOD_TIMEOUT_S = 240


def step_data(i: int) -> s.SpanData:
    return s.SpanData(
        name=s.SPAN_STEP,
        kind=s.KIND_INTERNAL,
        trace_id=s.new_trace_id(),
        span_id=s.new_span_id(),
        parent_span_id=0,
        start_ns=1_795_000_000_000_000_000 + i,
        end_ns=1_795_000_000_001_000_000 + i,
        attributes={
            s.ATTR_POOL: "colocated",
            s.ATTR_WORKER: "w0",
            s.ATTR_TIMING_SOURCE: "host",
            s.ATTR_STEP_DECODE_REQUESTS: 8,
            s.ATTR_STEP_PREFILL_TOKENS: 0,
            s.ATTR_STEP_CONTEXT_TOKENS: 4096,
        },
    )


def bytes_per_span(kind: str) -> float:
    """What keeping one more step span costs: its encoded frame bytes (sidecar sink), or the traced
    allocations of one SDK ReadableSpan (OTLP export queue)."""
    batch = [step_data(i) for i in range(2000)]
    if kind == "sidecar":
        return sum(len(wire.encode_frame(batch[i : i + 100])) for i in range(0, len(batch), 100)) / len(batch)
    resource = Resource.create({"service.name": "w0"})
    tracemalloc.start()
    try:
        readable = [to_readable_span(d, resource) for d in batch]
        traced, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(readable) == len(batch)
    return traced / len(batch)


@pytest.fixture(scope="module")
def floods() -> dict[str, dict]:
    """Run the three floods side by side; their results by kind."""
    children = {
        kind: subprocess.Popen(
            [sys.executable, "-m", "tests.faults.flood_tracing", kind, str(spans)],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
        )
        for kind, spans in SPANS.items()
    }
    results = {}
    try:
        for kind, child in children.items():
            out, _ = child.communicate(timeout=FLOOD_TIMEOUT_S)
            assert child.returncode == 0, f"flood {kind} exited with {child.returncode}: {out[-2000:]!r}"
            results[kind] = json.loads(out.decode().strip().splitlines()[-1])
    finally:
        for child in children.values():
            if child.poll() is None:
                child.kill()
                child.wait(10)
    return results


@pytest.mark.parametrize("kind", list(SPANS))
def test_a_flood_with_dead_export_stays_within_the_buffer_cap_and_counts_every_drop(floods, kind):
    result = floods[kind]
    produced, held, cap, dropped = result["produced"], result["held"], result["cap"], result["dropped"]
    assert result["emitted"] == produced and dropped["ring_full"] == 0  # every span reached the sink
    assert 0 < held <= cap
    if kind == "sidecar":
        assert dropped["sidecar_unreachable"] == produced - held  # nothing was sent; the rest is counted
    else:
        # At most the one batch the exporter is still retrying is neither held nor counted yet; batches it
        # gave up on are counted (export_failed), as are the spans a full queue displaced.
        lost = dropped["export_queue_full"] + dropped["export_failed"]
        assert produced - held - OTLP_BATCH_SPANS <= lost <= produced - held

    span_bytes = bytes_per_span(kind)
    unbounded_bytes = SPANS[kind] * span_bytes
    bound_bytes = OVERHEAD_FACTOR * cap * span_bytes + RSS_SLACK_BYTES
    assert bound_bytes < unbounded_bytes / 2, "the flood is too small to tell a bounded buffer from an unbounded one"
    growth = result["rss_after"] - result["rss_before"]
    assert growth < bound_bytes, (
        f"{kind}: RSS grew {growth / 2**20:.1f} MiB over {SPANS[kind]} spans; the cap of {cap} spans x "
        f"{span_bytes:.0f} B allows {bound_bytes / 2**20:.0f} MiB, keeping them all would take {unbounded_bytes / 2**20:.0f} MiB"
    )
