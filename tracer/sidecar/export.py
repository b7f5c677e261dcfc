"""The sidecar's export thread: takes batches off the ingest queue, adapts, meters and exports them.

Per span:
- our vocabulary (`splitscope.*`, `text_completion *`): exported unchanged and fed to MetricsRecorder,
  exactly as a worker's in-process LocalSink would;
- an engine's own spans (`tracer.engines`: vLLM's `llm_request` and lifecycle spans, SGLang's trace
  slices): exported unchanged, with the stage spans its adapter makes beside them; the stages (and vLLM's
  metrics-only request span) feed the metrics unless that engine's /metrics is scraped instead (the
  adapter's meter flag off: one source per engine, docs/engines.md);
- anything else: exported unchanged, no metrics.

The prefill and decode stages made from engines' spans (vLLM, SGLang) also go to the request-level
interference classifier (overlap.py): noted while a batch is adapted, classified once per drain (and
when the queue is idle), on this thread. A decode it holds is metered at once but exported only once
classified, carrying estimated stall links to the prefill spans that overlapped it (`_hold_for_links`,
`_export_linked`): links are fixed when a span is made, and those prefills mostly arrive after the
decode (their requests still run), so the span waits for them, at most the classifier's hold. A
separate span carrying the links later would be a second shape every reader must join; links from the
prefills already seen would miss exactly the long prompts whose requests outlast the stalled ones.

Export: `--traces-file` through the codec's fast OTLP/JSON line encoder (tracer.otlp.encode, one line per
resource per drain, appended with tracer.otlp.files.append_line), and any OTLP exporter from the OTEL_* environment through
the SDK's BatchSpanProcessor behind a `tracer.export.local_sink.LocalSink` per resource. Runs on one daemon thread;
an exception in one batch is logged and the thread goes on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor

from tracer import spans as s
from tracer.engines import EngineAdapter
from tracer.export.local_sink import LocalSink, MetricsRecorder
from tracer.otlp.encode import LineEncoder, resource_prefix
from tracer.otlp.files import append_line
from tracer.sidecar.ingest_queue import Batch, IngestQueue
from tracer.sidecar.overlap import OverlapClassifier
from tracer.sidecar.tail_sampler import TailSampler

log = logging.getLogger(__name__)

_RESOURCE_CACHE_LIMIT = 4096
LINE_MAX_SPANS = 4096


def is_ours(span: s.SpanData) -> bool:
    return span.name.startswith("splitscope.") or span.name.startswith(
        tuple(prefix + " " for prefix in s.ROOT_SPAN_PREFIXES)
    )


class SpanExport:
    """Consumer of an IngestQueue. `start()` runs it on a thread; `drain_once()` is the unit of work."""

    def __init__(
        self,
        queue: IngestQueue,
        metrics: MetricsRecorder | Callable[[tuple], MetricsRecorder],
        *,
        traces_file: str | None = None,
        processors: Sequence[SpanProcessor] = (),
        adapters: Sequence[tuple[EngineAdapter, bool]] = (),
        on_error: Callable[[str, int], None] | None = None,
        tail_sampler: TailSampler | None = None,
        overlap: OverlapClassifier | None = None,
    ) -> None:
        self.queue = queue
        # The recorder for a batch's resource (the sidecar meters each worker apart: worker_series.py)
        self.metrics_for = metrics if callable(metrics) else lambda _resource: metrics
        self.traces_file = traces_file
        self.processors = list(processors)
        # (adapter, meter its stages): first match wins; meter False where the engine's /metrics is
        # scraped instead (one source per engine, docs/engines.md)
        self.adapters = list(adapters)
        self._on_error = on_error
        self.tail_sampler = tail_sampler  # between metering and export: metrics see every span
        self.overlap = overlap
        self._encoder = LineEncoder()
        self._prefixes: dict[tuple, str] = {}
        self._sinks: dict[tuple, LocalSink] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.exported_spans = 0
        self.written_lines = 0

    def start(self) -> SpanExport:
        self._thread = threading.Thread(target=self._run, name="splitscope-sidecar-export", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.drain_once(timeout_s=0.2)

    def drain_once(self, timeout_s: float = 0.0) -> int:
        """Process what is queued (waiting up to `timeout_s` for something); returns spans exported."""
        batches = self.queue.take(timeout_s)
        if not batches:
            linked = self._classify_overlap()  # a quiet engine's last requests are classified too
            # and a quiet engine's last traces are decided
            return linked + (self._export_all(self.tail_sampler.expire()) if self.tail_sampler is not None else 0)
        by_resource: dict[tuple, list[s.SpanData]] = {}
        for batch in batches:
            try:
                by_resource.setdefault(batch.resource, []).extend(self._process(batch))
            except Exception:  # one bad batch must not stop the sidecar
                log.exception("splitscope sidecar: failed to process a batch of %d spans", len(batch.spans))
                self._error("sidecar_export_failed", len(batch.spans))
        if self.tail_sampler is None:
            exported = self._export_all(by_resource.items())
        else:
            released = [
                kept for resource, spans in by_resource.items() for kept in self.tail_sampler.offer(resource, spans)
            ]
            exported = self._export_all(released + self.tail_sampler.expire())
        return exported + self._classify_overlap()

    def _export_all(self, groups: Iterable[tuple[tuple, list[s.SpanData]]]) -> int:
        exported = 0
        for resource, spans in groups:
            if spans:
                exported += self._export(resource, spans)
        self.exported_spans += exported
        return exported

    def _classify_overlap(self) -> int:
        """Classify the decodes whose hold has passed; returns the linked decode spans exported."""
        if self.overlap is not None:
            try:
                self.overlap.advance()
            except Exception:  # metering must not stop the export
                log.exception("splitscope sidecar: request-level interference classification failed")
        return self._export_linked()

    def _process(self, batch: Batch) -> list[s.SpanData]:
        """Adapt and meter one batch; returns the spans to export (sampled only)."""
        adapters = self.adapters
        out = []
        metered = []
        resource = dict(batch.resource) if adapters else {}
        for span in batch.spans:
            adaptation = None
            for adapter, meter in adapters:
                adaptation = adapter.adapt(span, resource)
                if adaptation is not None:
                    break
            if adaptation is not None:  # an engine's span: exported as it is, with our stages beside it
                out.append(span)
                out.extend(stage for stage in adaptation.stages if not self._hold_for_links(stage, batch.resource))
                if meter:
                    metered.extend(adaptation.stages)
                    metered.extend(adaptation.metrics_only)
                continue
            if is_ours(span):
                metered.append(span)
            if span.sampled:
                out.append(span)
        self.metrics_for(batch.resource).record_many(metered)
        return out

    def _hold_for_links(self, stage: s.SpanData, resource: tuple) -> bool:
        """Feed `stage` to the overlap classifier; True when the classifier keeps it (a decode waiting for
        the prefills that overlapped it): `_export_linked` exports it then, with its stall links."""
        return self.overlap is not None and self.overlap.add(stage, resource)

    def _export_linked(self) -> int:
        """Export the decode spans the classifier has released with their stall links, by resource; through
        the tail sampler, whose decision on their trace they follow. Returns spans exported."""
        if self.overlap is None:
            return 0
        by_resource: dict[tuple, list[s.SpanData]] = {}
        for resource, span in self.overlap.released():
            by_resource.setdefault(resource, []).append(span)
        if not by_resource:
            return 0
        if self.tail_sampler is None:
            return self._export_all(by_resource.items())
        return self._export_all(
            [kept for resource, spans in by_resource.items() for kept in self.tail_sampler.offer(resource, spans)]
        )

    def _export(self, resource: tuple, spans: list[s.SpanData]) -> int:
        if self.traces_file:
            prefix = self._prefixes.get(resource)
            if prefix is None:
                if len(self._prefixes) >= _RESOURCE_CACHE_LIMIT:
                    self._prefixes.clear()
                prefix = self._prefixes[resource] = resource_prefix(dict(resource))
            for i in range(0, len(spans), LINE_MAX_SPANS):  # bounded lines, whatever one drain brought
                chunk = spans[i : i + LINE_MAX_SPANS]
                try:
                    append_line(self.traces_file, self._encoder.line(prefix, chunk))
                    self.written_lines += 1
                except OSError as exc:
                    log.warning("splitscope sidecar: cannot write %s: %s", self.traces_file, exc)
                    self._error("sidecar_file_write_failed", len(chunk))
        if self.processors:
            sink = self._sinks.get(resource)
            if sink is None:
                if len(self._sinks) >= _RESOURCE_CACHE_LIMIT:
                    self._sinks.clear()
                sink = self._sinks[resource] = LocalSink(Resource(dict(resource)), self.processors, None)
            sink.emit(spans)
        return len(spans)

    def _error(self, reason: str, count: int) -> None:
        if self._on_error is not None:
            self._on_error(reason, count)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the thread, export what is still queued, flush the OTLP exporters. Blocks up to ~timeout_s."""
        self._stop.set()
        self.queue.wake()
        if self._thread is not None:
            self._thread.join(timeout_s)
        while self.drain_once(0.0):
            pass
        if self.overlap is not None:  # nothing more will arrive: the held decodes leave with what is known
            self.overlap.flush()
            self._export_linked()
        if self.tail_sampler is not None:
            self._export_all(self.tail_sampler.flush())
        for processor in self.processors:
            processor.force_flush(int(timeout_s * 1000))
            processor.shutdown()
