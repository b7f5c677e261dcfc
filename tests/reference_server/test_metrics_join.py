"""The router's /metrics join (reference_server.serving.metrics_proxy): every process's series kept apart, nothing
summed, one valid exposition, checked by prometheus_client's strict OpenMetrics parser and by Prometheus's
own text parser (promtool)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from reference_server.serving.metrics_proxy import join_expositions
from tracer.export.exposition import exposition
from tracer.metrics import Catalogue, exemplar

OPENMETRICS = "application/openmetrics-text; version=1.0.0"


def _process(worker: str | None, tokens: int) -> CollectorRegistry:
    """One process's catalogue: a worker of pool colocated (or the router when `worker` is None)."""
    registry = CollectorRegistry()
    catalogue = Catalogue(registry)
    if worker is None:
        catalogue.pool_workers.labels(pool="colocated").set(2)
        catalogue.ttft.labels(gen_ai_request_model="tiny", mode="colocated").observe(0.3, exemplar(7))
    else:
        metrics = catalogue.bind("colocated", worker)
        metrics.decode_tokens.inc(tokens)
        metrics.step_with_prefill.observe_many([0.05] * tokens)
        metrics.requests_running.set(tokens)
    return registry


def _bodies(accept: str | None) -> list[bytes]:
    bodies = [exposition(_process(None, 0), accept, {"namespace": "prod"})[0]]
    for worker, tokens in (("w0", 5), ("w1", 7)):
        bodies.append(exposition(_process(worker, tokens), accept, {"namespace": "prod", "worker": worker})[0])
    return bodies


def test_joined_openmetrics_keeps_every_workers_series_apart_and_parses_strictly() -> None:
    text = join_expositions(_bodies(OPENMETRICS), openmetrics=True).decode()
    assert text.endswith("# EOF\n") and text.count("# EOF") == 1
    families = list(text_string_to_metric_families(text))  # raises on a repeated or interleaved family
    names = [f.name for f in families]
    assert len(names) == len(set(names))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s for f in families for s in f.samples}
    tokens = {k[1]: s.value for k, s in samples.items() if k[0] == "splitscope_tokens_total"}
    assert tokens[(("namespace", "prod"), ("phase", "decode"), ("pool", "colocated"), ("worker", "w0"))] == 5
    assert tokens[(("namespace", "prod"), ("phase", "decode"), ("pool", "colocated"), ("worker", "w1"))] == 7
    # A series that had its own worker label keeps it once; the router's series carry no worker.
    running = [s for f in families for s in f.samples if s.name == "splitscope_requests_running"]
    assert sorted(s.labels["worker"] for s in running) == ["w0", "w1"]
    ttft = [s for f in families for s in f.samples if s.name == "gen_ai_server_time_to_first_token_seconds_bucket"]
    assert ttft and all("worker" not in s.labels and s.labels["namespace"] == "prod" for s in ttft)
    assert any(s.exemplar is not None and s.exemplar.labels["trace_id"] == format(7, "032x") for s in ttft)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is installed by scripts/setup.sh")
def test_joined_text_format_is_what_prometheus_parses() -> None:
    text = join_expositions(_bodies(None), openmetrics=False)
    assert b"# EOF" not in text
    result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, timeout=60, check=False)
    # promtool lints too (naming advice); a parse error is what must never appear.
    assert (
        b"parsing error" not in result.stdout + result.stderr
        and b"error while linting" not in result.stdout + result.stderr
    ), result
    type_lines = [line.split()[2] for line in text.decode().splitlines() if line.startswith("# TYPE")]
    assert len(type_lines) == len(set(type_lines))
    assert 'splitscope_tokens_total{namespace="prod",phase="decode",pool="colocated",worker="w1"} 7.0' in text.decode()


def test_a_missing_worker_leaves_the_others_and_an_empty_body_is_harmless() -> None:
    router, w0, _ = _bodies(OPENMETRICS)
    text = join_expositions([router, w0, b""], openmetrics=True).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert {s.labels.get("worker") for s in families["splitscope_tokens"].samples} == {"w0"}
