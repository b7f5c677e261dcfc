"""One running sidecar: ingest (Unix socket, OTLP/HTTP, OTLP/gRPC), export thread, scrapers, GPU sampler.

    sidecar = Sidecar(SidecarConfig(unix_socket="run/sidecar.sock", traces_file="traces.jsonl")).start()
    ...
    sidecar.stop()

`start()` binds everything before returning (so a caller may connect at once) and raises OSError /
RuntimeError / ValueError with a clear message when it cannot (port in use, token missing for a
non-loopback bind). The OTLP/HTTP server runs an asyncio loop on its own thread; the Unix ingest and
gRPC use threads; none of them waits on export (ingest_queue.py).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
from dataclasses import dataclass, field
from wsgiref.simple_server import WSGIServer

from aiohttp import web
from prometheus_client import CollectorRegistry

from tracer.engines import span_adapters
from tracer.export.gpu import GpuSampler
from tracer.export.otel import span_processors
from tracer.metrics import NAMESPACE_LABEL, Catalogue, serve_metrics
from tracer.resource import env_resource_attributes
from tracer.sidecar.auth import token_for
from tracer.sidecar.export import SpanExport
from tracer.sidecar.ingest_queue import IngestQueue
from tracer.sidecar.otlp_grpc import start_grpc_server
from tracer.sidecar.otlp_http import DEFAULT_MAX_BODY_BYTES, make_app
from tracer.sidecar.overlap import DEFAULT_HOLD_S, OverlapClassifier
from tracer.sidecar.scrape import EngineScraper, merged_registry
from tracer.sidecar.tail_sampler import TailSampler
from tracer.sidecar.unix_ingest import UnixIngestServer
from tracer.sidecar.worker_series import WorkerSeries
from tracer.vocabulary import RESOURCE_SERVICE_NAMESPACE, DropReason, Mode, Pool

log = logging.getLogger(__name__)


def tune_gc_for_ingest() -> None:
    """Process-wide: make the cyclic garbage collector rare. For a process that is a sidecar only.

    Ingest allocates millions of small, acyclic containers per second (records, attribute dicts) that
    reference counting frees at once; the cyclic collector only spends time scanning them (about 40% of
    decode time at 100k records/s). Objects alive at start-up are frozen out of its scans.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)


@dataclass
class SidecarConfig:
    """Ports 0 pick a free port; None turns that receiver off. `scrape` holds (engine, url) pairs."""

    host: str = "127.0.0.1"
    http_port: int | None = 4318
    grpc_port: int | None = 4317
    unix_socket: str | None = None
    traces_file: str | None = None
    metrics_port: int | None = None
    pool: str = Pool.COLOCATED
    worker: str = "engine"
    mode: str = Mode.COLOCATED
    model: str = ""  # the served model, for request metrics when the engine's spans name none
    scrape: list[tuple[str, str]] = field(default_factory=list)
    scrape_timeout_s: float = 2.0
    max_queued_spans: int = 262_144
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    gpu: bool = True
    environ: dict[str, str] | None = None  # OTEL_* for the OTLP exporter; None reads os.environ
    # How long a finished decode waits for the prefills that overlapped it (overlap.py), span-timeline seconds.
    overlap_hold_s: float = DEFAULT_HOLD_S
    # Local tail sampling (tracer/sidecar/tail_sampler.py): None exports every span.
    sample_rate: float | None = None
    keep_violations: bool = False
    decision_timeout_s: float = 30.0
    max_buffered_spans: int = 200_000


class Sidecar:
    def __init__(self, config: SidecarConfig, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.registry = registry if registry is not None else CollectorRegistry()
        # Span-fed only: queue depth and KV cache use come from an engine scrape or not at all.
        self.catalogue = Catalogue(self.registry, worker_gauges=False)
        dropped = self.catalogue.tracer_dropped
        self._count_drop = lambda reason, n: dropped.labels(reason=reason).inc(n)
        self.queue = IngestQueue(config.max_queued_spans, self._count_drop)
        scraped_engines = {engine for engine, _ in config.scrape}
        self.scrapers = [
            EngineScraper(
                url, engine, pool=config.pool, worker=config.worker, mode=config.mode, timeout_s=config.scrape_timeout_s
            )
            for engine, url in config.scrape
        ]
        # Our workers' spans and snapshots meter catalogues of their own, exposed with their `worker` label.
        namespace = env_resource_attributes(config.environ).get(RESOURCE_SERVICE_NAMESPACE)
        self.worker_series = WorkerSeries(self.catalogue, namespace)
        self.exposed_registry = merged_registry(
            self.registry, self.scrapers, self.worker_series, {NAMESPACE_LABEL: namespace} if namespace else None
        )
        self.export = SpanExport(
            self.queue,
            self.worker_series.recorder_for,
            traces_file=config.traces_file,
            processors=span_processors(
                None,
                config.environ,
                on_drop=lambda n: self._count_drop(DropReason.EXPORT_QUEUE_FULL, n),
                on_export_failed=lambda n: self._count_drop(DropReason.EXPORT_FAILED, n),
            ),
            # One source per engine: when an engine's /metrics is scraped, its families come from there.
            adapters=[
                (adapter, adapter.engine not in scraped_engines)
                for adapter in span_adapters(
                    pool=config.pool, worker=config.worker, mode=config.mode, model=config.model
                )
            ],
            on_error=self._count_drop,
            tail_sampler=self._tail_sampler(config),
            overlap=OverlapClassifier(
                self.catalogue, hold_s=config.overlap_hold_s, prefill_in_one_step=config.mode != Mode.CHUNKED
            ),
        )
        self.unix: UnixIngestServer | None = None
        self.grpc_server = None
        self.http_port: int | None = None
        self.grpc_port: int | None = None
        self.metrics_port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._http_runner: web.AppRunner | None = None
        self._http_thread: threading.Thread | None = None
        self._metrics_server: WSGIServer | None = None
        self._gpu: GpuSampler | None = None

    def _tail_sampler(self, config: SidecarConfig) -> TailSampler | None:
        if config.sample_rate is None and not config.keep_violations:
            return None
        spans, traces = self.catalogue.tail_sampler_spans, self.catalogue.tail_sampler_traces
        kept_spans, dropped_spans = spans.labels(decision="kept"), spans.labels(decision="dropped")

        def on_spans(kept: int, dropped: int) -> None:
            kept_spans.inc(kept)
            dropped_spans.inc(dropped)

        return TailSampler(
            1.0 if config.sample_rate is None else config.sample_rate,
            keep_violations=config.keep_violations,
            decision_timeout_s=config.decision_timeout_s,
            max_buffered_spans=config.max_buffered_spans,
            on_spans=on_spans,
            on_decision=lambda keep, trigger: traces.labels(
                decision="kept" if keep else "dropped", trigger=trigger
            ).inc(),
        )

    def start(self) -> Sidecar:
        config = self.config
        token = token_for([config.host], config.environ)
        if config.pool not in tuple(Pool):
            raise ValueError(f"pool must be colocated, prefill or decode, got {config.pool!r}")
        self.export.start()
        try:
            if config.unix_socket:
                self.unix = UnixIngestServer(
                    config.unix_socket,
                    self.queue,
                    token=token,
                    on_drop=self._count_drop,
                    on_snapshot=self.worker_series.apply_snapshot,
                    on_disconnect=self.worker_series.disconnected,
                ).start()
            if config.grpc_port is not None:
                self.grpc_server, self.grpc_port = start_grpc_server(
                    self.queue, config.host, config.grpc_port, token=token, max_message_bytes=config.max_body_bytes
                )
            if config.http_port is not None:
                self._start_http(token)
            if config.metrics_port is not None:
                self._metrics_server, _ = serve_metrics(self.exposed_registry, config.metrics_port, config.host)
                self.metrics_port = self._metrics_server.server_port
            if config.gpu:
                self._gpu = GpuSampler(self.catalogue).start()
        except BaseException:
            self.stop(1.0)
            raise
        return self

    def _start_http(self, token: str) -> None:
        app = make_app(self.queue, self.exposed_registry, token=token, max_body_bytes=self.config.max_body_bytes)
        loop = asyncio.new_event_loop()
        runner = web.AppRunner(app, auto_decompress=False, access_log=None)  # gzip inflated by us, bounded
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, self.config.host, self.config.http_port)
        try:
            loop.run_until_complete(site.start())
        except OSError as exc:
            loop.run_until_complete(runner.cleanup())
            loop.close()
            raise OSError(f"cannot listen for OTLP/HTTP on {self.config.host}:{self.config.http_port}: {exc}") from None
        self.http_port = runner.addresses[0][1]
        self._loop, self._http_runner = loop, runner
        self._http_thread = threading.Thread(target=loop.run_forever, name="splitscope-sidecar-http", daemon=True)
        self._http_thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop receiving, export what was received, flush exporters. Blocks up to about `timeout_s`."""
        if self.unix is not None:
            self.unix.stop()
        if self.grpc_server is not None:
            self.grpc_server.stop(grace=min(1.0, timeout_s)).wait(timeout_s)
        if self._loop is not None and self._http_runner is not None:
            future = asyncio.run_coroutine_threadsafe(self._http_runner.cleanup(), self._loop)
            try:
                future.result(timeout_s)
            except Exception:  # shutting down: a slow client must not keep us here
                log.warning("splitscope sidecar: OTLP/HTTP server did not stop cleanly")
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._http_thread is not None:
                self._http_thread.join(timeout_s)
            self._loop.close()
            self._loop = None
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        if self._gpu is not None:
            self._gpu.stop()
        self.export.shutdown(timeout_s)
