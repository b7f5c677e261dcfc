"""Scrape an engine's /metrics and re-yield what has the same meaning under our names and labels.

`EngineScraper` is a prometheus_client Collector: each time our /metrics is collected it fetches the
engine's exposition (blocking, `timeout_s`), parses it with prometheus_client's own parser, and maps it
through engine_metrics.py. A histogram keeps the engine's bucket boundaries, so one of our families may
hold series with different buckets (ours from spans, the engine's from a scrape): each series is a
valid histogram on its own, and PromQL's histogram_quantile works per series (docs/engines.md).

`MergedCollector` yields our catalogue's families and the scraped ones as one exposition: a family both
produce is written once, and a scraped series whose labels the catalogue already has is left out (the
catalogue wins), so the exposition never repeats a family or a series. It ends with the scrapes' health,
`splitscope_engine_scrape_up{engine}` and `splitscope_engine_scrape_duration_seconds{engine}`: an engine
that is down has no mapped series at all (nothing reads as measured), and its failure and its recovery
are logged once each.
"""

from __future__ import annotations

import logging
import math
import time
import urllib.request
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from tracer.engines.metrics import (
    COUNTER,
    ENGINE_INDEX_LABELS,
    ENGINES,
    GAUGE,
    HISTOGRAM,
    MODEL_LABELS,
    FamilyMap,
)
from tracer.metrics import ENGINE_SCRAPE_DURATION, ENGINE_SCRAPE_UP
from tracer.slo_buckets import missing_slo_edges

log = logging.getLogger(__name__)

MAX_EXPOSITION_BYTES = 32 * 1024 * 1024
_HELP = "Mapped from {engine} metrics by the splitscope sidecar"


class ScrapeError(RuntimeError):
    pass


def fetch(url: str, timeout_s: float) -> str:
    """The exposition text at `url`; ScrapeError on any failure (network, status, size)."""
    request = urllib.request.Request(url, headers={"Accept": "text/plain;version=0.0.4"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310 (a configured URL)
            body = response.read(MAX_EXPOSITION_BYTES + 1)
    except (OSError, ValueError) as exc:
        raise ScrapeError(f"cannot scrape {url}: {exc}") from None
    if len(body) > MAX_EXPOSITION_BYTES:
        raise ScrapeError(f"{url} answered more than {MAX_EXPOSITION_BYTES} bytes")
    return body.decode("utf-8", errors="replace")


def map_families(text: str, engine: str, *, pool: str, worker: str, mode: str) -> list[Metric]:
    """Our families from one engine exposition. Raises ValueError for an unknown engine or bad text."""
    try:
        mappings = ENGINES[engine]
    except KeyError:
        raise ValueError(f"unknown engine {engine!r}; one of {', '.join(sorted(ENGINES))}") from None
    by_source: dict[str, list[FamilyMap]] = defaultdict(list)
    for m in mappings:
        by_source[m.source].append(m)
    config = {"pool": pool, "worker": worker, "mode": mode}
    # target name -> (kind, doc, {label values tuple: accumulated value})
    out: dict[str, _Target] = {}
    families = list(text_string_to_metric_families(text))
    present = {family.name for family in families}
    for family in families:
        for m in by_source.get(family.name, ()):
            if m.unless in present:
                continue
            target = out.get(m.target)
            if target is None:
                target = out[m.target] = _Target(m.kind, _HELP.format(engine=engine), m.labels)
            _accumulate(target, family, m, config)
    return [target.to_metric(name) for name, target in out.items()]


class _Target:
    def __init__(self, kind: str, documentation: str, labels: tuple[str, ...]) -> None:
        self.kind = kind
        self.documentation = documentation
        self.labels = labels
        self.values: dict[tuple[str, ...], float] = {}
        self.histograms: dict[tuple[str, ...], dict[str, Any]] = {}

    def to_metric(self, name: str) -> Metric:
        metric = Metric(name, self.documentation, self.kind)
        if self.kind == HISTOGRAM:
            for values, h in self.histograms.items():
                labels = dict(zip(self.labels, values))
                for le, count in sorted(h["buckets"].items(), key=lambda kv: float(kv[0])):
                    metric.add_sample(name + "_bucket", {**labels, "le": le}, count)
                metric.add_sample(name + "_count", labels, h["count"])
                metric.add_sample(name + "_sum", labels, h["sum"])
        else:
            suffix = "_total" if self.kind == COUNTER else ""
            for values, value in self.values.items():
                metric.add_sample(name + suffix, dict(zip(self.labels, values)), value)
        return metric


def _target_labels(m: FamilyMap, source_labels: dict[str, str], config: dict[str, str]) -> tuple[str, ...]:
    values = []
    for label in m.labels:
        if label in m.fixed:
            values.append(m.fixed[label])
        elif label in m.copy:
            values.append(source_labels.get(m.copy[label], ""))
        elif label == "gen_ai_request_model":
            values.append(next((source_labels[k] for k in MODEL_LABELS if k in source_labels), ""))
        elif label == "worker":
            index = next((source_labels[k] for k in ENGINE_INDEX_LABELS if k in source_labels), "")
            # Engine cores of one instance report separately: keep them apart as worker "w/1", "w/2" ...
            values.append(config["worker"] if index in ("", "0") else f"{config['worker']}/{index}")
        else:
            values.append(config.get(label, ""))
    return tuple(values)


def _series_labels(sample: Sample) -> dict[str, str]:
    return {k: v for k, v in sample.labels.items() if k != "le"}


def _accumulate(target: _Target, family: Metric, m: FamilyMap, config: dict[str, str]) -> None:
    matched = [
        sample
        for sample in family.samples
        if all(sample.labels.get(k) == v for k, v in m.match.items()) and not sample.name.endswith("_created")
    ]
    if m.kind in (GAUGE, COUNTER):
        wanted = family.name + (
            "_" + m.from_sample if m.from_sample else ("_total" if family.type == "counter" else "")
        )
        for sample in matched:
            if sample.name != wanted or math.isnan(sample.value):
                continue
            key = _target_labels(m, _series_labels(sample), config)
            value = sample.value * m.scale
            if key in target.values and m.aggregate == "max":
                target.values[key] = max(target.values[key], value)
            else:
                target.values[key] = target.values.get(key, 0.0) + value
        return
    # Histogram: gather each source series, then add it into its target series if the buckets agree.
    series: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}
    for sample in matched:
        labels = _series_labels(sample)
        h = series.setdefault(
            tuple(sorted(labels.items())), {"labels": labels, "buckets": {}, "count": 0.0, "sum": 0.0}
        )
        if sample.name == family.name + "_bucket":
            h["buckets"][_le(sample.labels["le"], m.scale)] = sample.value
        elif sample.name == family.name + "_count":
            h["count"] = sample.value
        elif sample.name == family.name + "_sum":
            h["sum"] = sample.value * m.scale
    for h in series.values():
        if "+Inf" not in h["buckets"]:
            continue  # not a complete histogram series
        key = _target_labels(m, h["labels"], config)
        existing = target.histograms.get(key)
        if existing is None:
            target.histograms[key] = {"buckets": dict(h["buckets"]), "count": h["count"], "sum": h["sum"]}
        elif existing["buckets"].keys() == h["buckets"].keys():
            for le, count in h["buckets"].items():
                existing["buckets"][le] += count
            existing["count"] += h["count"]
            existing["sum"] += h["sum"]
        else:
            log.warning("splitscope sidecar: %s series with other buckets than %s; left out", family.name, m.target)


def _le(value: str, scale: float = 1.0) -> str:
    """Bucket bounds in Prometheus' canonical float text ('1.0', '+Inf'), whatever the engine wrote,
    times `scale` (unit conversion), rounded to 12 significant digits so 5 ms reads 0.005, not 0.005000000000000001."""
    bound = float(value)
    return "+Inf" if math.isinf(bound) else repr(float(f"{bound * scale:.12g}"))


_SLO_EDGE_WARNED: set[str] = set()


def warn_missing_slo_edges(engine: str, families: list[Metric]) -> None:
    """Log once per layout when an engine's TTFT/ITL buckets lack the SLO edge the burn rules count at."""
    for warning in missing_slo_edges(families):
        if warning not in _SLO_EDGE_WARNED:
            _SLO_EDGE_WARNED.add(warning)
            log.warning("splitscope sidecar: %s engine: %s", engine, warning)


class EngineScraper:
    """Collector for one engine endpoint. `collect` runs on whatever thread renders /metrics (blocking
    up to `timeout_s`); it records whether that scrape worked (`up`) and how long it took
    (`duration_s`), read from any thread."""

    def __init__(self, url: str, engine: str, *, pool: str, worker: str, mode: str, timeout_s: float = 2.0) -> None:
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}; one of {', '.join(sorted(ENGINES))}")
        self.url = url
        self.engine = engine
        self.pool, self.worker, self.mode = pool, worker, mode
        self.timeout_s = timeout_s
        self.last_error = ""
        self.up: bool | None = None  # None: never scraped
        self.duration_s = 0.0

    def collect(self) -> Iterator[Metric]:
        started = time.perf_counter()
        try:
            text = fetch(self.url, self.timeout_s)
            families = map_families(text, self.engine, pool=self.pool, worker=self.worker, mode=self.mode)
        except (ScrapeError, ValueError) as exc:
            self.duration_s = time.perf_counter() - started
            if str(exc) != self.last_error:  # one line per change of state, not per scrape
                log.warning("splitscope sidecar: %s", exc)
            self.last_error = str(exc)
            self.up = False
            return iter(())
        self.duration_s = time.perf_counter() - started
        if self.up is False:
            log.warning("splitscope sidecar: %s scrape of %s recovered", self.engine, self.url)
        self.last_error = ""
        self.up = True
        warn_missing_slo_edges(self.engine, families)
        return iter(families)


def scrape_health(scrapers: Iterable[EngineScraper]) -> list[Metric]:
    """`splitscope_engine_scrape_up{engine}` and `..._scrape_duration_seconds{engine}` of the scrapes just
    made. Several scrapers of one engine: up is the lowest (one down is down), duration the longest."""
    up: dict[str, float] = {}
    duration: dict[str, float] = {}
    for scraper in scrapers:
        if scraper.up is None:
            continue
        up[scraper.engine] = min(up.get(scraper.engine, 1.0), 1.0 if scraper.up else 0.0)
        duration[scraper.engine] = max(duration.get(scraper.engine, 0.0), scraper.duration_s)
    up_family = GaugeMetricFamily(
        ENGINE_SCRAPE_UP, "1 when the last scrape of the engine's /metrics worked", labels=["engine"]
    )
    duration_family = GaugeMetricFamily(
        ENGINE_SCRAPE_DURATION, "Seconds the last engine scrape took", labels=["engine"]
    )
    for engine in sorted(up):
        up_family.add_metric([engine], up[engine])
        duration_family.add_metric([engine], duration[engine])
    return [up_family, duration_family]


class MergedCollector(Collector):
    """Our registry's families, then `workers`' (each worker's series, tracer.sidecar.worker_series), plus
    scraped ones, merged by family name (the catalogue wins); `labels` (the deployment's `namespace`) added
    to every series that does not carry its own."""

    def __init__(
        self,
        registry: CollectorRegistry,
        scrapers: Iterable[EngineScraper],
        workers: Collector | None = None,
        labels: dict[str, str] | None = None,
    ) -> None:
        self.registry = registry
        self.scrapers = list(scrapers)
        self.workers = workers
        self.labels = dict(labels or {})

    def collect(self) -> Iterator[Metric]:
        for family in self._collect():
            if self.labels:
                family.samples = [s._replace(labels={**self.labels, **s.labels}) for s in family.samples]
            yield family

    def _collect(self) -> Iterator[Metric]:
        ours = {family.name: family for family in self.registry.collect()}
        for family in self.workers.collect() if self.workers is not None else ():
            if family.name in ours:
                _merge_into(ours[family.name], family)
            else:
                ours[family.name] = family
        extra: dict[str, Metric] = {}
        for scraper in self.scrapers:
            for family in scraper.collect():
                if family.name in extra:
                    _merge_into(extra[family.name], family)
                else:
                    extra[family.name] = family
        for name, family in ours.items():
            if name in extra:
                _merge_into(family, extra.pop(name))
            yield family
        yield from extra.values()
        if self.scrapers:
            yield from scrape_health(self.scrapers)


def _series_key(sample: Sample) -> tuple:
    return tuple(sorted(_series_labels(sample).items()))


def _merge_into(into: Metric, other: Metric) -> None:
    if into.type != other.type:
        log.warning("splitscope sidecar: scraped %s is a %s, ours a %s; left out", into.name, other.type, into.type)
        return
    present = {_series_key(sample) for sample in into.samples}
    into.samples.extend(sample for sample in other.samples if _series_key(sample) not in present)


def merged_registry(
    registry: CollectorRegistry,
    scrapers: Iterable[EngineScraper],
    workers: Collector | None = None,
    labels: dict[str, str] | None = None,
) -> CollectorRegistry:
    """A registry to expose: `registry` (the catalogue) merged with the workers' and the scrapers' families."""
    merged = CollectorRegistry(auto_describe=False)
    merged.register(MergedCollector(registry, scrapers, workers, labels))
    return merged
