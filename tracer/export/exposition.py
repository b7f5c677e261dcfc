"""A process's /metrics answer, rendered fast enough to be scraped beside a running engine.

prometheus_client's encoders format every sample from scratch on every scrape: sort its labels, validate
and escape every label name and value, format the line. A worker's catalogue is about 400 samples, so a
scrape held the worker's GIL for 3-5 ms, and every engine step that wanted it back in that time waited
(bench/metrics_scrape.py: the client-seen gap p99 rose 6-7% under a scrape 3 times a second). Between two
scrapes the series are the same and only their values change, so `Exposition` keeps each series' text up
to its value (the name and the label set) and each family's metadata lines, and formats only the values.

The text is prometheus_client's own: every piece this module keeps is cut out of the library encoder's
output for that one series or family (rendered once, on first sight), so escaping and name rules stay the
library's. The one piece formatted here is an OpenMetrics exemplar (` # {trace_id="..."} value time`),
written as the library writes it: a long-running worker has one on every latency bucket it has seen, a
third of its lines, and rendering each of those lines through the library took 60% of a render
(bench/exposition_render.py). Tests compare whole renders with the library's byte for byte.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Protocol, cast

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, choose_encoder
from prometheus_client.exposition import generate_latest as text_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS_CONTENT_TYPE
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from prometheus_client.samples import Exemplar, Sample
from prometheus_client.utils import floatToGoString

# Samples the text format (0.0.4) moves out of their family into a gauge family of their own, after it.
_TEXT_FORMAT_SPLIT_SUFFIXES = ("_created", "_gsum", "_gcount")
_EOF = "# EOF\n"
# A line rendered with this value ends in " 0.0\n"; what comes before the value is the series' text.
_PROBE_VALUE_TEXT = " 0.0\n"
# Enough for any catalogue; a source that keeps minting new label values only costs a rebuild of the cache.
_MAX_CACHED_SERIES = 100_000
# (openmetrics, sample name, label items as given): one line of an exposition
_SeriesKey = tuple[bool, str, tuple[tuple[str, str], ...]]


class MetricSource(Protocol):
    """What an exposition reads: a CollectorRegistry, or any object whose collect() yields metric families."""

    def collect(self) -> Iterable[Metric]: ...


class _OneFamily:
    """A source holding one family, for rendering one piece with the library's encoder."""

    def __init__(self, family: Metric) -> None:
        self._family = family

    def collect(self) -> list[Metric]:
        return [self._family]


def _library_render(family: Metric, openmetrics: bool) -> str:
    """The library encoder's text for one family, without OpenMetrics' closing `# EOF`."""
    source = cast(CollectorRegistry, _OneFamily(family))  # the encoders only call collect()
    text = (openmetrics_latest if openmetrics else text_latest)(source).decode("utf-8")
    return text.removesuffix(_EOF) if openmetrics else text


def _library_line(family: Metric, sample: Sample, openmetrics: bool) -> str:
    """The library encoder's line for `sample` of `family` (its last line: metadata lines come first)."""
    shallow = copy.copy(family)
    shallow.samples = [sample]
    return _library_render(shallow, openmetrics).rsplit("\n", 2)[-2] + "\n"


class Exposition:
    """Renders `source` as Prometheus text (0.0.4) or OpenMetrics 1.0, with `labels` added to every series;
    a `source` of None renders an empty exposition in the format asked for.

    A series that already has one of `labels` keeps its own value. Output is byte-identical to
    prometheus_client's encoders over the same families. Thread-safe (scrapes may overlap: the caches are
    plain dicts, a race only computes a piece twice); CPU-bound and blocking (about a millisecond for a
    worker's catalogue): call `render` off an event loop that serves requests (`asyncio.to_thread`).
    """

    def __init__(self, source: MetricSource | None, labels: dict[str, str] | None = None) -> None:
        self.source = source  # None (tracing off): an exposition with no families
        self.labels = dict(labels or {})
        # (openmetrics, sample name, label items as given) -> the line up to its value
        self._series: dict[_SeriesKey, str] = {}
        # (openmetrics, name, type, unit, documentation) -> metadata lines
        self._metadata: dict[tuple[bool, str, str, str, str], str] = {}
        # the same key -> (the series' last exemplar, its text)
        self._exemplars: dict[_SeriesKey, tuple[Exemplar, str]] = {}

    def render(self, accept_header: str | None) -> tuple[bytes, str]:
        """(body, content type) for a /metrics answer; OpenMetrics (with exemplars) when the scraper asks."""
        _, content_type = choose_encoder(accept_header or "")
        openmetrics = content_type == OPENMETRICS_CONTENT_TYPE
        if len(self._series) > _MAX_CACHED_SERIES:
            self._series.clear()
            self._exemplars.clear()
        lines: list[str] = []
        for family in self.source.collect() if self.source is not None else ():
            if openmetrics:
                self._openmetrics_family(family, lines)
            else:
                self._text_family(family, lines)
        if openmetrics:
            lines.append(_EOF)
        return "".join(lines).encode("utf-8"), content_type if openmetrics else CONTENT_TYPE_LATEST

    def _openmetrics_family(self, family: Metric, lines: list[str]) -> None:
        lines.append(self._metadata_lines(family, True))
        for sample in family.samples:
            lines.append(self._line(family, sample, True))

    def _text_family(self, family: Metric, lines: list[str]) -> None:
        lines.append(self._metadata_lines(family, False))
        split: dict[str, list[str]] = {}
        for sample in family.samples:
            suffix = next((s for s in _TEXT_FORMAT_SPLIT_SUFFIXES if sample.name == family.name + s), None)
            line = self._line(family, sample, False)
            if suffix is None:
                lines.append(line)
            else:
                split.setdefault(suffix, []).append(line)
        for suffix, split_lines in sorted(split.items()):
            lines.append(self._metadata_lines(Metric(family.name + suffix, family.documentation, "gauge"), False))
            lines.extend(split_lines)

    def _line(self, family: Metric, sample: Sample, openmetrics: bool) -> str:
        exemplar = sample.exemplar if openmetrics else None  # the text format (0.0.4) drops exemplars
        if sample.timestamp is not None or (exemplar is not None and not _common_exemplar(family, sample)):
            return _library_line(family, self._labelled(sample), openmetrics)  # rare: the library's own line
        key = (openmetrics, sample.name, tuple(sample.labels.items()))
        line = self._series_text(key, family, sample, openmetrics) + floatToGoString(sample.value)
        if exemplar is None:
            return line + "\n"
        cached = self._exemplars.get(key)
        if cached is None or cached[0] is not exemplar:  # a bucket keeps its Exemplar until one replaces it
            cached = self._exemplars[key] = (exemplar, _exemplar_text(exemplar))
        return line + cached[1] + "\n"

    def _metadata_lines(self, family: Metric, openmetrics: bool) -> str:
        key = (openmetrics, family.name, family.type, family.unit, family.documentation)
        text = self._metadata.get(key)
        if text is None:
            empty = copy.copy(family)
            empty.samples = []
            text = self._metadata[key] = _library_render(empty, openmetrics)
        return text

    def _series_text(self, key: _SeriesKey, family: Metric, sample: Sample, openmetrics: bool) -> str:
        text = self._series.get(key)
        if text is None:
            probe = self._labelled(sample)._replace(value=0.0, exemplar=None)
            line = _library_line(family, probe, openmetrics)
            text = self._series[key] = line.removesuffix(_PROBE_VALUE_TEXT) + " "
        return text

    def _labelled(self, sample: Sample) -> Sample:
        if not self.labels:
            return sample
        return sample._replace(labels={**self.labels, **sample.labels})


def _common_exemplar(family: Metric, sample: Sample) -> bool:
    """An exemplar where every exposition puts one: a histogram bucket's or a counter's `_total`. Others
    take the library's path, which renders or refuses them as it decides."""
    if family.type == "histogram":
        return sample.name.endswith("_bucket")
    return family.type == "counter" and sample.name.endswith("_total")


def _exemplar_text(exemplar: Exemplar) -> str:
    """` # {labels} value [timestamp]` as the OpenMetrics encoder writes it (label names unescaped, values
    escaped, labels sorted)."""
    labels = ",".join(
        '{}="{}"'.format(name, value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\""))
        for name, value in sorted(exemplar.labels.items())
    )
    value = floatToGoString(exemplar.value)
    if exemplar.timestamp is None:
        return f" # {{{labels}}} {value}"
    return f" # {{{labels}}} {value} {exemplar.timestamp}"


def exposition(
    source: MetricSource, accept_header: str | None, labels: dict[str, str] | None = None
) -> tuple[bytes, str]:
    """One render of `source` (see `Exposition`); a process that is scraped keeps an `Exposition` instead."""
    return Exposition(source, labels).render(accept_header)
