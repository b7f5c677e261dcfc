"""tracer.metrics: the bulk histogram exposes exactly what prometheus_client's Histogram would."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest

from tracer.metrics import TOKEN_BUCKETS_S, BulkHistogram


def _lines(text: str) -> list[str]:
    """Exposition lines without `_created`, with sums rounded (the bulk path adds in another order)."""
    out = []
    for line in text.splitlines():
        if "_created" in line:
            continue
        if "_sum{" in line:
            series, value = line.rsplit(" ", 1)
            line = f"{series} {float(value):.9g}"
        out.append(line)
    return out


def test_bulk_histogram_exposition_equals_prometheus_client_histogram():
    rng = random.Random(1)
    values = [rng.choice(TOKEN_BUCKETS_S) for _ in range(50)] + [rng.uniform(0, 3) for _ in range(500)]
    reference, bulk = CollectorRegistry(), CollectorRegistry()
    expected = Histogram("x_seconds", "gaps", ["pool"], buckets=TOKEN_BUCKETS_S, registry=reference)
    actual = BulkHistogram("x_seconds", "gaps", ["pool"], buckets=TOKEN_BUCKETS_S, registry=bulk)
    for value in values:
        expected.labels(pool="decode").observe(value)
    child = actual.labels(pool="decode")
    child.observe_many(values[:100])
    for value in values[100:110]:
        child.observe(value)
    child.observe_many(values[110:])
    child.observe_many([])
    assert _lines(generate_latest(bulk).decode()) == _lines(generate_latest(reference).decode())
    assert _lines(openmetrics_latest(bulk).decode()) == _lines(openmetrics_latest(reference).decode())
