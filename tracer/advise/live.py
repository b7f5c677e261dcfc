"""The advisor as a running process: `--follow` (tail and decide as windows close) and `--metrics-port`
(serve the held advice to Prometheus until SIGINT or SIGTERM).

Main thread: the poll loop, or a wait; prometheus_client serves scrapes on its own daemon thread. SIGINT
and SIGTERM set the stop event, so the loop ends after the poll in progress and the process exits 0.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Sequence
from typing import TextIO

from prometheus_client import CollectorRegistry

from tracer.advise.build import advise
from tracer.advise.exposition import AdviceExporter
from tracer.advise.follow import ClosedWindow, Follower, replay
from tracer.advise.render import FOLLOW_HEADER, render, window_line
from tracer.metrics import AdviceMetrics, serve_metrics
from tracer.otlp import iter_records, spans_from_record
from tracer.report.build import ReportOptions
from tracer.report.tables import load_traces
from tracer.vocabulary import RESOURCE_SERVICE_NAMESPACE

# Records looked at for `service.namespace` when the traces are read whole (the report's reader drops
# resources): the first spans name it when the exporter sets it at all.
NAMESPACE_PROBE_RECORDS = 50


def stop_on_signals() -> threading.Event:
    """An event set by SIGINT or SIGTERM (installed here; call from the main thread)."""
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    return stop


def start_exporter(host: str, port: int) -> AdviceExporter:
    registry = CollectorRegistry()
    exporter = AdviceExporter(AdviceMetrics(registry))
    server, _ = serve_metrics(registry, port, host)
    print(f"advise: metrics on http://{host}:{server.server_port}/metrics", file=sys.stderr, flush=True)
    return exporter


def follow(
    follower: Follower,
    fmt: str,
    out: TextIO,
    exporter: AdviceExporter | None,
    poll_interval_s: float,
    stop: threading.Event,
) -> None:
    """Poll until `stop`; print each closed window as it closes and publish it."""
    if fmt == "md":
        out.write(FOLLOW_HEADER)
        out.flush()

    def on_window(closed: ClosedWindow) -> None:
        deployed = closed.deployed.label if closed.deployed else ""
        out.write(window_line(closed.window, closed.held, closed.reason, deployed, fmt))
        out.flush()
        if exporter is not None:
            exporter.publish(closed.namespace, closed.window, closed.held, closed.deployed, closed.reason)

    try:
        follower.run(stop, poll_interval_s, on_window)
    finally:
        follower.close()


def serve_offline(
    paths: Sequence[str],
    options: ReportOptions,
    window_s: float,
    hold_windows: int,
    fmt: str,
    out: TextIO,
    exporter: AdviceExporter,
    namespace: str | None,
    stop: threading.Event,
) -> None:
    """Decide every window of `paths` as `advise` does, write the result, publish the windows in order
    (the last window's advice stays), then serve until `stop`."""
    data = load_traces(paths, skip_bad=options.skip_bad)
    result = advise(data, options, window_s, hold_windows)
    out.write(render(result, fmt))
    out.flush()
    for closed in replay(result, data, namespace or probe_namespace(paths) or ""):
        exporter.publish(closed.namespace, closed.window, closed.held, closed.deployed, closed.reason)
    stop.wait()


def probe_namespace(paths: Sequence[str]) -> str | None:
    """`service.namespace` of the first spans that name one, or None."""
    for path in paths:
        for i, (trace_format, _, record) in enumerate(iter_records(path, growing=True)):
            if i >= NAMESPACE_PROBE_RECORDS:
                break
            try:
                spans = spans_from_record(trace_format, record)
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
            for span in spans:
                namespace = span.resource.get(RESOURCE_SERVICE_NAMESPACE)
                if isinstance(namespace, str) and namespace:
                    return namespace
    return None
