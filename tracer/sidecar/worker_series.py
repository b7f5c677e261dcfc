"""Each connected worker's series in the sidecar, kept apart by its `worker` label, as its own /metrics would.

A worker that ships to the sidecar names itself in its resource (`splitscope.worker`, and the deployment's
`service.namespace`). Its spans are metered into a catalogue of its own, and its metrics snapshots (the
gauges and counters it sets itself: queue depth, KV cache use, drops; wire.py) land in the same catalogue.
On /metrics every series of that catalogue carries `worker` and `namespace`, so the sidecar exposes exactly
the series the router's join of its workers' expositions does (reference_server/serving/metrics_proxy.py), and
rules and dashboards read either the same way. Nothing is summed across processes.

Sources without a worker name (the router, OTLP from engines) keep the sidecar's own catalogue, as before,
unless they name another deployment than the sidecar's own: those get a catalogue labelled with their
`namespace`, so a sidecar that was not told its deployment still keeps a router's series in it.

Lifetimes: a worker's catalogue lives as long as the sidecar, so its counters carry on across the worker's
reconnects and restarts (Prometheus sees no reset); its gauges are removed when its connection ends (a
gauge that outlived its worker would read as measured). A snapshot's counters add what grew since that
process's previous snapshot, keyed by the resource (whose instance id is new in every process).

Thread safety: `recorder_for` runs on the export thread, `apply_snapshot` / `disconnected` on connection
threads, `collect` on scrape threads; one lock guards the maps, and prometheus_client's metrics lock their
own values.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from tracer.export.local_sink import MetricsRecorder
from tracer.metrics import NAMESPACE_LABEL, WORKER_LABEL, Catalogue
from tracer.sidecar.wire import MetricsSnapshot
from tracer.vocabulary import ATTR_WORKER, RESOURCE_SERVICE_NAMESPACE

Resource = tuple[tuple[str, Any], ...]
_SeriesKey = tuple[str, tuple[tuple[str, str], ...]]
_POOL_WORKER = {"pool", WORKER_LABEL}


class _Source:
    """One catalogue and what a snapshot needs to update it."""

    def __init__(self, catalogue: Catalogue, labels: dict[str, str]) -> None:
        self.catalogue = catalogue
        self.labels = labels  # added to every series on /metrics ({} for the sidecar's own)
        self.recorder = MetricsRecorder(catalogue)
        self.families = catalogue.process_set()


class WorkerSeries(Collector):
    """Per-worker catalogues beside the sidecar's own (`default`); a Collector of the workers' families."""

    def __init__(self, default: Catalogue, namespace: str | None = None) -> None:
        """`default`: the sidecar's own catalogue, of deployment `namespace` (None: not known)."""
        self._default = _Source(default, {})
        self._namespace = namespace or ""
        self._workers: dict[tuple[str, str], _Source] = {}
        self._by_resource: dict[Resource, _Source] = {}
        # per process (resource): each counter series' total in its last snapshot
        self._counter_totals: dict[Resource, dict[_SeriesKey, float]] = {}
        # per process: the gauge series its snapshots set, removed when it disconnects
        self._gauges_set: dict[Resource, set[_SeriesKey]] = {}
        self._lock = threading.Lock()

    def _source(self, resource: Resource) -> _Source:
        source = self._by_resource.get(resource)
        if source is not None:
            return source
        with self._lock:
            attributes = dict(resource)
            worker = str(attributes.get(ATTR_WORKER) or "")
            namespace = str(attributes.get(RESOURCE_SERVICE_NAMESPACE) or "")
            if not worker and namespace in ("", self._namespace):
                source = self._default
            else:
                source = self._workers.get((namespace, worker))
                if source is None:
                    labels = {WORKER_LABEL: worker} if worker else {}
                    if namespace:
                        labels[NAMESPACE_LABEL] = namespace
                    source = self._workers[(namespace, worker)] = _Source(
                        Catalogue(CollectorRegistry(auto_describe=False)), labels
                    )
            self._by_resource[resource] = source
        return source

    def recorder_for(self, resource: Resource) -> MetricsRecorder:
        """The recorder that meters spans of `resource`. Export thread."""
        return self._source(resource).recorder

    def apply_snapshot(self, resource: Resource, snapshot: MetricsSnapshot) -> None:
        """Set the gauges and add the counters' growth of one process's snapshot. Connection thread.

        Raises ValueError (before changing anything) for a family that is not a process's own or labels
        that are not that family's: the connection is then closed as sending a bad frame.
        """
        source = self._source(resource)
        updates = []
        for name, labels, value in snapshot.samples:
            metric = source.families.get(name)
            if metric is None:
                raise ValueError(f"metrics snapshot: {name!r} is not a family a process sets itself")
            if set(labels) != set(metric._labelnames):
                raise ValueError(
                    f"metrics snapshot: {name} takes labels {list(metric._labelnames)}, got {list(labels)}"
                )
            updates.append((name, metric, labels, value))
        if source is not self._default:  # the worker's series exist from its first snapshot, as in its own catalogue
            workers = {
                (labels["pool"], labels[WORKER_LABEL]) for *_, labels, _ in updates if _POOL_WORKER <= labels.keys()
            }
            for pool, worker in workers:
                source.recorder.bind_worker(pool, worker)
        with self._lock:
            totals = self._counter_totals.setdefault(resource, {})
            gauges = self._gauges_set.setdefault(resource, set())
            for name, metric, labels, value in updates:
                key = (name, tuple(sorted(labels.items())))
                if isinstance(metric, Gauge):
                    (metric.labels(**labels) if labels else metric).set(value)
                    gauges.add(key)
                elif isinstance(metric, Counter):
                    grown = value - totals.get(key, 0.0)
                    if grown > 0:  # a new process's first snapshot counts in full (its key is new)
                        (metric.labels(**labels) if labels else metric).inc(grown)
                    totals[key] = value

    def disconnected(self, resource: Resource) -> None:
        """Remove the labelled gauges `resource`'s snapshots set (its values end with its connection)."""
        source = self._by_resource.get(resource)
        if source is None:
            return
        with self._lock:
            for name, labels in self._gauges_set.pop(resource, set()):
                metric = source.families[name]
                if labels:  # an unlabelled gauge cannot be removed; it keeps its last value
                    try:
                        metric.remove(*(dict(labels)[label] for label in metric._labelnames))
                    except KeyError:
                        pass

    def collect(self) -> Iterator[Metric]:
        """Every worker catalogue's families, each worker's series labelled with it, one family per name."""
        with self._lock:
            sources = list(self._workers.values())
        merged: dict[str, Metric] = {}
        for source in sources:
            for family in source.catalogue.registry.collect():
                samples = [sample._replace(labels={**source.labels, **sample.labels}) for sample in family.samples]
                into = merged.get(family.name)
                if into is None:
                    family.samples = samples
                    merged[family.name] = family
                else:
                    into.samples.extend(samples)
        yield from merged.values()
