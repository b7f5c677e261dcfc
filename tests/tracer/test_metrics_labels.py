"""Process labels on every exported series: the deployment (`namespace`) and the worker."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from reference_server.launch.serve import serve_command, with_namespace
from tracer.export.exposition import exposition
from tracer.metrics import Catalogue, deployment_namespace, process_labels


def test_namespace_comes_from_otel_resource_attributes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "team=x,service.namespace=prod-eu")
    assert deployment_namespace() == "prod-eu"
    assert process_labels("decode-0") == {"namespace": "prod-eu", "worker": "decode-0"}
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES")
    assert deployment_namespace() is None and process_labels() == {}


def test_the_serve_flag_wins_over_an_earlier_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", with_namespace("service.namespace=old,team=x", "new"))
    assert deployment_namespace() == "new"
    assert with_namespace("", "a") == "service.namespace=a"


@pytest.mark.parametrize("bad", ["", "a,b", "a=b"])
def test_serve_refuses_a_namespace_it_cannot_pass_on(bad: str) -> None:
    result = CliRunner().invoke(serve_command, ["--namespace", bad])
    assert result.exit_code == 2 and "--namespace must be a non-empty name" in result.output


def test_exposition_adds_process_labels_without_touching_a_series_own_worker() -> None:
    registry = CollectorRegistry()
    metrics = Catalogue(registry).bind("decode", "decode-0")
    metrics.decode_tokens.inc(3)
    metrics.requests_running.set(2)
    body, content_type = exposition(
        registry, "application/openmetrics-text", {"namespace": "prod", "worker": "decode-0"}
    )
    assert content_type.startswith("application/openmetrics-text")
    samples = [s for f in text_string_to_metric_families(body.decode()) for s in f.samples]
    assert all(s.labels.get("namespace") == "prod" for s in samples)
    tokens = next(s for s in samples if s.name == "splitscope_tokens_total" and s.labels["phase"] == "decode")
    assert tokens.labels == {"namespace": "prod", "phase": "decode", "pool": "decode", "worker": "decode-0"}
    assert tokens.value == 3
    # Without labels, the registry's own exposition, unchanged.
    plain, _ = exposition(registry, None)
    assert b"namespace=" not in plain
