"""The cached /metrics renderer against prometheus_client's own encoders, byte for byte."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Info, Summary
from prometheus_client.exposition import generate_latest as text_latest
from prometheus_client.metrics_core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from prometheus_client.registry import Collector
from prometheus_client.samples import Exemplar

from tracer.export.exposition import Exposition
from tracer.metrics import Catalogue, exemplar

OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
PROCESS_LABELS = {"namespace": "prod", "worker": "decode-0"}


class _Timestamped(Collector):
    """A family whose samples carry timestamps (as a federating or forwarding collector writes them)."""

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("forwarded_queue_depth", "Queue depth as the engine reported it", labels=["q"])
        family.add_metric(["a"], 3.0, timestamp=1_700_000_000.25)
        yield family


class _ForwardedExemplars(Collector):
    """A histogram whose exemplars have no timestamp and label values that need escaping."""

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily("forwarded_latency_seconds", "Latency as the engine reported it")
        odd = Exemplar({"trace_id": "ab", "note": 'a "quoted"\\path\nline'}, 0.04)
        family.add_metric([], [("0.05", 2.0, odd), ("+Inf", 3.0, Exemplar({"trace_id": "cd"}, 1.5))], 1.6)
        yield family


def _registry() -> tuple[CollectorRegistry, Catalogue]:
    registry = CollectorRegistry()
    catalogue = Catalogue(registry)
    Counter("odd_labels", "Label values that need escaping", ["path"], registry=registry).labels(
        path='a "quoted"\\path\nwith a newline'
    ).inc(2)
    Info("build", "Build information", registry=registry).info({"version": "1.2", "commit": "abc"})
    Enum("engine_state", "Engine state", states=["up", "down"], registry=registry).state("down")
    Summary("upload_seconds", "Uploads", registry=registry).observe(0.3)
    Gauge("temperature_celsius", "Doc with a \\ backslash\nand a newline", unit="celsius", registry=registry).set(-2.5)
    registry.register(_Timestamped())
    registry.register(_ForwardedExemplars())
    Counter("retries", "Retries, each with the trace that retried", registry=registry).inc(exemplar={"trace_id": "ef"})
    return registry, catalogue


def _feed(catalogue: Catalogue, scale: float) -> None:
    metrics = catalogue.bind("decode", "decode-0")
    metrics.decode_tokens.inc(3 * scale)
    metrics.requests_running.set(2 * scale)
    metrics.inter_token_latency.observe_many([0.01 * scale, 0.02, 0.3])
    metrics.step_without_prefill.observe_many([0.015] * int(4 * scale))
    metrics.stage["prefill"].observe(0.2 * scale)
    ttft = catalogue.ttft.labels(gen_ai_request_model="small", mode="disaggregated")
    ttft.observe(0.05 * scale, exemplar(0xABC + int(scale)))
    catalogue.step_tokens.labels(pool="decode").observe(17 * scale)
    catalogue.pool_workers.labels(pool="decode").set(1e21 * scale)  # Go-style exponent formatting


class _WithLabels:
    """The families with `labels` merged into every sample (the series' own values win): the reference."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self.registry, self.labels = registry, labels

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            family.samples = [s._replace(labels={**self.labels, **s.labels}) for s in family.samples]
            yield family


@pytest.mark.parametrize("labels", [{}, PROCESS_LABELS])
@pytest.mark.parametrize("accept", [OPENMETRICS, None, "text/plain"])
def test_every_render_matches_the_library_encoders_as_values_change(labels: dict, accept: str | None) -> None:
    registry, catalogue = _registry()
    renderer = Exposition(registry, labels)
    reference = _WithLabels(registry, labels)
    library = openmetrics_latest if accept == OPENMETRICS else text_latest
    for scale in (1.0, 2.5, 7.0):  # the second and third renders come from the cached series texts
        _feed(catalogue, scale)
        body, content_type = renderer.render(accept)
        assert body == library(reference)  # type: ignore[arg-type]
        assert content_type.startswith("application/openmetrics-text" if accept == OPENMETRICS else "text/plain")


def test_a_series_own_label_wins_over_the_process_label() -> None:
    registry, catalogue = _registry()
    catalogue.bind("decode", "decode-7").requests_running.set(1)
    body, _ = Exposition(registry, {"worker": "decode-0"}).render(OPENMETRICS)
    assert b'splitscope_requests_running{pool="decode",worker="decode-7"} 1.0\n' in body
    assert b'splitscope_requests_running{pool="decode",worker="decode-0"}' not in body


@pytest.mark.parametrize("accept", [OPENMETRICS, None])
def test_no_source_renders_an_empty_exposition_in_the_format_asked_for(accept: str | None) -> None:
    body, content_type = Exposition(None).render(accept)
    library = openmetrics_latest if accept == OPENMETRICS else text_latest
    assert (body, content_type.split(";")[0]) == (
        library(CollectorRegistry()),
        "application/openmetrics-text" if accept else "text/plain",
    )
