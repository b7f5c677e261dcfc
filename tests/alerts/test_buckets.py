"""alerts.buckets and `alerts check --metrics-url`: histograms without the SLO edge are named."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.prom import serving_registry
from tests.vllm_layouts import VLLM_TTFT_BUCKETS_S
from tracer.alerts.buckets import missing_slo_edges
from tracer.alerts.cli import alerts_group
from tracer.metrics import Catalogue
from tracer.sidecar import scrape
from tracer.sidecar.scrape import map_families, warn_missing_slo_edges


def _vllm_like() -> CollectorRegistry:
    registry = CollectorRegistry()
    Histogram(
        "gen_ai_server_time_to_first_token_seconds",
        "TTFT",
        ["gen_ai_request_model", "mode"],
        buckets=VLLM_TTFT_BUCKETS_S,
        registry=registry,
    ).labels("llama", "colocated").observe(0.3)
    Histogram(
        "splitscope_inter_token_latency_seconds", "ITL", ["pool"], buckets=(0.01, 0.2, 1.0), registry=registry
    ).labels("decode").observe(0.05)
    return registry


def _families(registry: CollectorRegistry) -> list:
    return list(text_string_to_metric_families(generate_latest(registry).decode()))


def test_engine_layouts_without_the_slo_edge_are_named_with_their_outcome() -> None:
    warnings = missing_slo_edges(_families(_vllm_like()))
    assert len(warnings) == 2
    ttft, itl = sorted(warnings)
    assert ttft.startswith("gen_ai_server_time_to_first_token_seconds buckets (0.001, ")
    assert "lack the 2 s SLO edge; the burn rules judge it at 1 s" in ttft
    assert "lack the 100 ms SLO edge" in itl and "75 ms fallback edge; the burn rules leave it out" in itl


def test_our_own_catalogue_has_every_slo_edge() -> None:
    registry = CollectorRegistry()
    catalogue = Catalogue(registry)
    catalogue.ttft.labels(gen_ai_request_model="tiny", mode="colocated").observe(0.4)
    catalogue.bind("colocated", "w0").inter_token_latency.observe(0.02)
    assert missing_slo_edges(_families(registry)) == []


@pytest.fixture
def vllm_like_url(port: int) -> Iterator[str]:
    with serving_registry(_vllm_like(), port) as target:
        yield f"http://{target}/metrics"


def test_alerts_check_warns_about_an_exposition_without_the_slo_edge(vllm_like_url: str) -> None:
    result = CliRunner().invoke(alerts_group, ["check", "--skip-tests", "--metrics-url", vllm_like_url])
    assert result.exit_code == 0, result.output
    assert f"warning: {vllm_like_url}: gen_ai_server_time_to_first_token_seconds buckets" in result.stderr
    unreachable = "http://127.0.0.1:9/metrics"
    bad = CliRunner().invoke(alerts_group, ["check", "--skip-tests", "--metrics-url", unreachable])
    assert bad.exit_code != 0 and f"cannot read metrics from {unreachable}" in bad.stderr


VLLM_FIXTURE = Path(__file__).with_name("fixtures") / "vllm-latency-histograms.txt"


def test_the_sidecar_warns_once_about_vllms_ttft_buckets(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real vLLM exposition (the TTFT and ITL families of a captured vLLM worker exposition), mapped by the sidecar: its
    TTFT buckets lack 2 s (judged at 1 s), its ITL buckets have 100 ms (no warning)."""
    # "Once" is per process: a sidecar test that ran first may have warned already.
    monkeypatch.setattr(scrape, "_SLO_EDGE_WARNED", set())
    families = map_families(
        VLLM_FIXTURE.read_text(encoding="utf-8"), "vllm", pool="colocated", worker="v0", mode="colocated"
    )
    assert {f.name for f in families} == {
        "gen_ai_server_time_to_first_token_seconds",
        "splitscope_inter_token_latency_seconds",
    }
    with caplog.at_level(logging.WARNING, logger="tracer.sidecar.scrape"):
        warn_missing_slo_edges("vllm", families)
        warn_missing_slo_edges("vllm", families)  # the next scrape: nothing new to say
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1, warnings
    assert "vllm engine: gen_ai_server_time_to_first_token_seconds buckets" in warnings[0]
    assert "lack the 2 s SLO edge; the burn rules judge it at 1 s" in warnings[0]
