"""What the request-level interference classifier (tracer/sidecar/overlap.py) costs the sidecar's ingest.

The sidecar's sustained ingest is its export thread's capacity (bench/sidecar_ingest.py): one thread takes
batches off the ingest queue, adapts vLLM's `llm_request` spans into our stage spans, meters them and writes
OTLP/JSON lines to --traces-file. This drives that thread (SpanExport, the sidecar's own) with stock vLLM
request spans (512 per batch, as the SDK's BatchSpanProcessor sends them) from one worker under steady
overlapping load (Poisson arrivals at 8 requests/s of the spans' timeline, prompts of 100-2000 tokens,
30-300 output tokens), once with the classifier and once without, alternating rounds in one run, and
prints llm_request spans per second for each and the share of throughput the classifier costs. Every
round ends with every decode classified (the hold passes), so the classification work is all counted.
On a shared machine the rounds' wall-clock rates vary with other load, so the run also reports the share
of the export thread's own CPU time (time.thread_time) spent inside the classifier, in the same rounds.

    .venv/bin/python bench/overlap_cost.py [--requests 60000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from prometheus_client import CollectorRegistry

from tracer import spans as s
from tracer.engines import vllm
from tracer.engines.vllm import VllmAdapter
from tracer.export.local_sink import MetricsRecorder
from tracer.metrics import Catalogue
from tracer.sidecar.export import SpanExport
from tracer.sidecar.ingest_queue import Batch, IngestQueue
from tracer.sidecar.overlap import OverlapClassifier

BATCH_SPANS = 512
EPOCH_NS = 1_780_000_000_000_000_000


class TimedClassifier(OverlapClassifier):
    """The classifier, counting the export thread's CPU seconds spent in it."""

    cpu_s = 0.0

    def add(self, stage: s.SpanData, resource: object = None) -> bool:
        started = time.thread_time()
        held = super().add(stage, resource)
        self.cpu_s += time.thread_time() - started
        return held

    def advance(self) -> int:
        started = time.thread_time()
        done = super().advance()
        self.cpu_s += time.thread_time() - started
        return done


class _Clock:
    """Monotonic time that can be pushed past the hold at the end of a round."""

    def __init__(self) -> None:
        self.offset_s = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset_s


def request_spans(requests: int, seed: int = 0) -> list[s.SpanData]:
    """vLLM 0.32 `llm_request` spans of one engine, in the order they finish."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / 8.0, requests))
    prompts = rng.integers(100, 2001, requests)
    outputs = rng.integers(30, 301, requests)
    spans = []
    for arrival_s, prompt, output in zip(arrivals, prompts, outputs):
        queue_s, prefill_s = 0.002, 0.02 + prompt * 1e-5
        decode_s = (output - 1) * 0.025
        ttft_s = queue_s + prefill_s + 0.003
        e2e_s = ttft_s + decode_s
        start_ns = EPOCH_NS + int(arrival_s * 1e9)
        spans.append(
            s.SpanData(
                name=vllm.SPAN_NAME,
                kind=s.KIND_SERVER,
                trace_id=s.new_trace_id(),
                span_id=s.new_span_id(),
                parent_span_id=0,
                start_ns=start_ns,
                end_ns=start_ns + int(e2e_s * 1e9),
                attributes={
                    vllm.ATTR_PROMPT_TOKENS: int(prompt),
                    vllm.ATTR_COMPLETION_TOKENS: int(output),
                    vllm.ATTR_TIME_IN_QUEUE: queue_s,
                    vllm.ATTR_PREFILL: prefill_s,
                    vllm.ATTR_TTFT: ttft_s,
                    vllm.ATTR_DECODE: decode_s,
                    vllm.ATTR_E2E: e2e_s,
                },
            )
        )
    spans.sort(key=lambda span: span.end_ns)
    return spans


def one_round(spans: list[s.SpanData], classify: bool, workdir: Path) -> tuple[float, int, float]:
    """(llm_request spans per second through the export thread, decodes classified, share of the thread's
    CPU time spent in the classifier)."""
    registry = CollectorRegistry()
    catalogue = Catalogue(registry, worker_gauges=False)
    clock = _Clock()
    overlap = TimedClassifier(catalogue, clock_s=clock) if classify else None
    queue = IngestQueue(len(spans) + 1, lambda reason, n: None)
    traces = workdir / f"round-{time.monotonic_ns()}.jsonl"
    export = SpanExport(
        queue,
        MetricsRecorder(catalogue),
        traces_file=str(traces),
        adapters=[(VllmAdapter(worker="vllm-0", models=vllm.ModelNames("bench")), True)],
        overlap=overlap,
    )
    resource = (("service.name", "vllm"),)
    for i in range(0, len(spans), BATCH_SPANS):
        queue.offer(Batch(resource, spans[i : i + BATCH_SPANS]))
    started, cpu_started = time.perf_counter(), time.thread_time()
    while export.drain_once(0.0):
        pass
    if overlap is not None:  # the engine goes quiet: the last holds pass, every decode is classified and
        clock.offset_s += 3600  # its span exported with its stall links
        export.drain_once(0.0)
    elapsed_s, cpu_s = time.perf_counter() - started, time.thread_time() - cpu_started
    traces.unlink()
    classified = sum(
        registry.get_sample_value(
            "splitscope_decode_tpot_seconds_count", {"pool": "colocated", "prefill_overlap": flag}
        )
        or 0
        for flag in ("true", "false")
    )
    return len(spans) / elapsed_s, int(classified), (overlap.cpu_s / cpu_s if overlap is not None else 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=60_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    spans = request_spans(args.requests)
    rates: dict[bool, list[float]] = {False: [], True: []}
    cpu_shares: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        one_round(spans[:2000], True, Path(tmp))  # warm-up (imports, caches)
        for _ in range(args.rounds):
            for classify in (False, True):
                rate, classified, cpu_share = one_round(spans, classify, Path(tmp))
                rates[classify].append(rate)
                if classify:
                    cpu_shares.append(cpu_share)
                if classify and classified != len(spans):
                    raise SystemExit(f"only {classified} of {len(spans)} decodes classified")
    without, with_ = statistics.median(rates[False]), statistics.median(rates[True])
    print(f"llm_request spans: {len(spans)} per round, {args.rounds} rounds each, alternating")
    print(f"without classifier: {without:,.0f} spans/s (rounds: {', '.join(f'{r:,.0f}' for r in rates[False])})")
    print(f"with classifier:    {with_:,.0f} spans/s (rounds: {', '.join(f'{r:,.0f}' for r in rates[True])})")
    print(f"classification costs {100 * (1 - with_ / without):.1f}% of the export thread's throughput (medians)")
    print(
        f"classifier's share of the export thread's CPU time: {100 * statistics.median(cpu_shares):.1f}% "
        f"(rounds: {', '.join(f'{100 * c:.1f}%' for c in cpu_shares)})"
    )


if __name__ == "__main__":
    main()
