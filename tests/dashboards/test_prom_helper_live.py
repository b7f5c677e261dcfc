"""tests/prom.py against a real prometheus_client exposition over HTTP; then every dashboard query and
every rule through the real Prometheus engine (a query it rejects fails the test)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from tests.prom import PrometheusError, running_prometheus, serving_registry
from tracer.alerts.rules import RULES_PATH
from tracer.dashboards.catalogue import dashboard_queries, grafana_to_promql, rule_queries
from tracer.metrics import Catalogue


@pytest.fixture
def catalogue_exposition(port: int):
    registry = CollectorRegistry()
    catalogue = Catalogue(registry)
    catalogue.pool_workers.labels(pool="colocated").set(2)
    catalogue.step_duration.labels(pool="colocated", prefill_in_step="true").observe(0.2)
    with serving_registry(registry, port) as target:
        yield target


def test_helper_scrapes_and_prometheus_accepts_every_dashboard_and_rule_query(catalogue_exposition: str) -> None:
    with running_prometheus([catalogue_exposition], rule_files=[RULES_PATH]) as prom:
        prom.wait_targets_up(timeout_s=30)
        assert prom.targets_up() == {f"http://{catalogue_exposition}/metrics": True}
        workers = prom.wait_for('splitscope_pool_workers{pool="colocated"}', lambda r: len(r) == 1)
        assert float(workers[0]["value"][1]) == 2.0
        assert workers[0]["metric"]["job"] == prom.job

        with pytest.raises(PrometheusError, match="parse error"):
            prom.query("sum(rate(splitscope_pool_workers[5m])")

        rejected = []
        for uid, title, expr in dashboard_queries():
            try:
                prom.query(grafana_to_promql(expr))
            except PrometheusError as exc:
                rejected.append(f"{uid} / {title}: {exc}")
        for name, expr in rule_queries():
            try:
                prom.query(expr)
            except PrometheusError as exc:
                rejected.append(f"rule {name}: {exc}")
        assert rejected == []

        # The committed rules load and evaluate without errors.
        groups = prom.wait_for_rules_evaluated(timeout_s=30)
        unhealthy = [(r["name"], r.get("lastError")) for g in groups for r in g["rules"] if r["health"] != "ok"]
        assert unhealthy == []
        # Targets up and splitscope_* series present: the telemetry alert (pending only if an evaluation ran
        # before the first scrape) goes away.
        prom.wait_for('ALERTS{alertname="TelemetryAbsent"}', lambda r: r == [], timeout_s=30)
        assert "TelemetryAbsent" not in {a["labels"]["alertname"] for a in prom.alerts()}
