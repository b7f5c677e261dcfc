"""dashboards/: committed JSON equals a fresh render; structure every dashboard must have."""

from __future__ import annotations

import json
import tomllib
from importlib import metadata
from pathlib import Path

import promql_parser
import pytest
from click.testing import CliRunner

from tracer.alerts.settings import DEFAULT_SETTINGS
from tracer.dashboards.build import DASHBOARDS, GENERATED_DIR, load_generated, render_all, stale_files
from tracer.dashboards.catalogue import dashboard_queries, grafana_to_promql
from tracer.dashboards.cli import dashboards_group
from tracer.dashboards.common import TRACES_DATASOURCE_UID

REPO_ROOT = Path(__file__).resolve().parents[2]
LATENCY_HISTOGRAMS = (
    "gen_ai_server_time_to_first_token_seconds",
    "gen_ai_server_time_per_output_token_seconds",
    "gen_ai_server_request_duration_seconds",
    "splitscope_stage_duration_seconds",
    "splitscope_inter_token_latency_seconds",
    "splitscope_step_duration_seconds",
)
# What each dashboard must show (the list), by panel title.
REQUIRED_PANELS = {
    "splitscope-overview": {
        "Time to first token",
        "Inter-token latency",
        "End-to-end request duration",
        "Throughput",
        "Goodput (TTFT within SLO)",
        "SLO attainment",
        "Layout advice (splitscope advise)",  # the advisor's row
        "Held advice",
        "Advice against the deployed layout",
        "Advice gain and confidence",
    },
    "splitscope-stages": {"Stage time p95", "Queue depth", "Busy ratio per pool"},
    "splitscope-kv-transfer": {"Bytes per second", "Transfer duration", "Effective bandwidth", "Failures by reason"},
    "splitscope-interference": {"Step time with and without prefill", "Interference ratio", "Decode stalls"},
    "splitscope-gpu": {"GPU utilisation", "GPU memory used"},
    "splitscope-tracer-health": {"Dropped records per second", "Pending records"},
}


def test_committed_json_is_a_fresh_render() -> None:
    assert stale_files() == [], "dashboards/generated is stale: run `splitscope dashboards build`"


def test_rendering_twice_gives_the_same_bytes() -> None:
    assert render_all() == render_all()


def test_sdk_version_is_the_pinned_one() -> None:
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    pins = [
        d for d in pyproject["project"]["optional-dependencies"]["dashboards"] if d.startswith("grafana-foundation-sdk")
    ]
    assert pins == [f"grafana-foundation-sdk=={metadata.version('grafana-foundation-sdk')}"]


def test_cli_build_writes_and_check_detects_stale_json(tmp_path: Path) -> None:
    runner = CliRunner()
    built = runner.invoke(dashboards_group, ["build", "--out", str(tmp_path)])
    assert built.exit_code == 0, built.output
    assert sorted(p.name for p in tmp_path.glob("*.json")) == sorted(DASHBOARDS)
    assert runner.invoke(dashboards_group, ["build", "--check", "--out", str(tmp_path)]).exit_code == 0

    edited = tmp_path / "gpu.json"
    edited.write_text(edited.read_text(encoding="utf-8").replace("GPU memory used", "GPU memory"), encoding="utf-8")
    stale = runner.invoke(dashboards_group, ["build", "--check", "--out", str(tmp_path)])
    assert stale.exit_code != 0
    assert "gpu.json" in stale.output

    (tmp_path / "gpu.json").unlink()
    assert runner.invoke(dashboards_group, ["build", "--check", "--out", str(tmp_path)]).exit_code != 0


def test_committed_check_passes_through_the_cli() -> None:
    result = CliRunner().invoke(dashboards_group, ["build", "--check"])
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="module")
def dashboards() -> dict[str, dict]:
    return {model["uid"]: model for model in load_generated(GENERATED_DIR).values()}


def test_each_dashboard_has_required_panels_variables_and_unique_ids(dashboards: dict[str, dict]) -> None:
    assert set(dashboards) == set(REQUIRED_PANELS)
    for uid, model in dashboards.items():
        titles = {panel["title"] for panel in model["panels"]}
        assert REQUIRED_PANELS[uid] <= titles, (uid, REQUIRED_PANELS[uid] - titles)
        variables = {v["name"]: v for v in model["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"
        assert variables["datasource"]["query"] == "prometheus"
        for name in ("model", "pool"):
            assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*"
        ids = [panel["id"] for panel in model["panels"]]
        assert len(ids) == len(set(ids)), uid
        for panel in model["panels"]:
            if panel["type"] == "row":  # a row groups the panels after it; it queries nothing
                assert "targets" not in panel or not panel["targets"], (uid, panel["title"])
                continue
            assert panel["datasource"]["uid"] == "${datasource}", (uid, panel["title"])
            ref_ids = [t["refId"] for t in panel["targets"]]
            assert all(ref_ids) and len(ref_ids) == len(set(ref_ids)), (uid, panel["title"])


def test_latency_percentile_queries_carry_exemplars(dashboards: dict[str, dict]) -> None:
    checked = 0
    for model in dashboards.values():
        for panel in model["panels"]:
            if panel["type"] != "timeseries":
                continue
            for target in panel["targets"]:
                expr = target["expr"]
                if "histogram_quantile" in expr and any(f"{h}_bucket" in expr for h in LATENCY_HISTOGRAMS):
                    # A step serves many requests: its histogram has no exemplar to show (tracer/metrics.py).
                    carries = "splitscope_step_duration_seconds_bucket" not in expr
                    assert target["exemplar"] is carries, (model["uid"], panel["title"], expr)
                    checked += 1
    assert checked >= 10


def test_slo_lines_come_from_the_alert_settings(dashboards: dict[str, dict]) -> None:
    panels = {p["title"]: p for p in dashboards["splitscope-overview"]["panels"]}
    for title, slo in (
        ("Time to first token", DEFAULT_SETTINGS.ttft_slo_s),
        ("Inter-token latency", DEFAULT_SETTINGS.itl_slo_s),
    ):
        steps = panels[title]["fieldConfig"]["defaults"]["thresholds"]["steps"]
        assert steps[-1]["value"] == slo


def test_every_panel_query_parses_as_promql() -> None:
    queries = dashboard_queries()
    assert len(queries) > 40
    for uid, title, expr in queries:
        promql_parser.parse(grafana_to_promql(expr))  # raises ValueError with the parser's message


def test_grafana_variables_are_replaced_by_values_prometheus_accepts() -> None:
    expr = 'rate(x_bucket{pool=~"$pool", gen_ai_request_model=~"${model}"}[$__rate_interval])'
    assert grafana_to_promql(expr) == 'rate(x_bucket{pool=~".*", gen_ai_request_model=~".*"}[1m])'


def test_exemplars_link_to_the_provisioned_traces_datasource() -> None:
    import yaml

    provisioning = REPO_ROOT / "deploy/grafana/provisioning/datasources/splitscope.yaml"
    datasources = {d["uid"]: d for d in yaml.safe_load(provisioning.read_text(encoding="utf-8"))["datasources"]}
    assert datasources[TRACES_DATASOURCE_UID]["type"] in {"tempo", "jaeger"}
    prometheus = next(d for d in datasources.values() if d["type"] == "prometheus")
    destinations = prometheus["jsonData"]["exemplarTraceIdDestinations"]
    assert {"name": "trace_id", "datasourceUid": TRACES_DATASOURCE_UID} in destinations
    from tracer.metrics import exemplar

    assert set(exemplar(1)) == {"trace_id"}, "exemplar label must match the provisioned destination"
    assert json.dumps(destinations)  # plain data, provisioned as is
