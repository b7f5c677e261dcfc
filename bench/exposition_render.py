"""What one /metrics render of a worker's catalogue costs, by renderer, on a fresh and a long-running worker.

A worker renders its exposition on a thread beside its engine thread, holding the GIL while it does
(bench/metrics_scrape.py measures what that does to latency). Its latency histograms take the request's
trace id as an exemplar, and a bucket keeps its latest one, so a worker that has served a while carries an
exemplar on every bucket it has seen (about a third of its lines); a fresh one on a few.

Renderers, timed in this one run, on the same registry:
- `collect only`: prometheus_client's collect() alone (building a Sample per line), the floor for any
  renderer that reads the registry through the library;
- `prometheus_client`: the library's own encoder over the same registry;
- `Exposition`: tracer/export/exposition.py, the cached renderer every worker and the sidecar serve (a worker's
  also adds its `worker` and `namespace` labels, which cost nothing per render: they are part of each
  series' cached text).

Run: `python bench/exposition_render.py` from bench/ or the repository root (a few seconds).
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest as text_latest
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest

from tracer.export.exposition import Exposition
from tracer.metrics import Catalogue, exemplar

OPENMETRICS_ACCEPT = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def worker_registry(requests: int, seed: int = 1) -> CollectorRegistry:
    """A colocated worker's catalogue after `requests` requests (log-normal latencies, one trace id each)."""
    registry = CollectorRegistry()
    catalogue = Catalogue(registry)
    metrics = catalogue.bind("colocated", "colocated-0")
    rng = random.Random(seed)
    ttft, tpot, duration = (
        family.labels(gen_ai_request_model="small", mode="colocated")
        for family in (catalogue.ttft, catalogue.tpot, catalogue.request_duration)
    )
    for _ in range(requests):
        latency_s, trace = rng.lognormvariate(-3.0, 1.2), exemplar(rng.getrandbits(128))
        for stage in metrics.stage.values():
            stage.observe(latency_s, trace)
        ttft.observe(latency_s, trace)
        tpot.observe(latency_s / 10, trace)
        duration.observe(latency_s * 5, trace)
        metrics.step_with_prefill.observe(latency_s)
        metrics.step_without_prefill.observe(latency_s / 3)
        metrics.inter_token_latency.observe_many([latency_s / 10] * 8)
        metrics.prefill_tokens.inc(128)
        metrics.decode_tokens.inc(64)
        catalogue.step_tokens.labels(pool="colocated").observe(rng.randint(1, 300))
    metrics.requests_running.set(3)
    metrics.kv_cache_usage.set(0.4)
    return registry


def ms_per_call(call: Callable[[], object], repeat: int) -> float:
    """Best of five means of `repeat` calls, in milliseconds (the best: the least disturbed by the machine)."""
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(repeat):
            call()
        best = min(best, (time.perf_counter() - started) * 1000 / repeat)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=50, help="renders per timing")
    args = parser.parse_args()
    print(
        "| worker | format | lines | exemplars | collect only ms | prometheus_client ms | Exposition ms | library / ours |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, requests in (("fresh (10 requests)", 10), ("long-running (3000 requests)", 3000)):
        registry = worker_registry(requests)
        for format_name, accept, library in (
            ("OpenMetrics", OPENMETRICS_ACCEPT, openmetrics_latest),
            ("text 0.0.4", None, text_latest),
        ):
            renderer = Exposition(registry)
            body, _ = renderer.render(accept)
            assert body == library(registry), "the renderer no longer matches the library"
            collect_ms = ms_per_call(lambda: list(registry.collect()), args.repeat)
            library_ms = ms_per_call(lambda: library(registry), args.repeat)
            ours_ms = ms_per_call(lambda: renderer.render(accept), args.repeat)
            lines, exemplars = body.count(b"\n"), body.count(b" # {")
            print(
                f"| {name} | {format_name} | {lines} | {exemplars} | {collect_ms:.2f} |"
                f" {library_ms:.2f} | {ours_ms:.2f} | {library_ms / ours_ms:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
