"""deploy/: no container engine here, so parse the files and check what compose would mount and bind."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import click
import pytest
import yaml

from reference_server.launch.serve import serve_command
from tracer.alerts.promtool import promtool_path
from tracer.alerts.rules import RULES_PATH
from tracer.dashboards.build import GENERATED_DIR
from tracer.sidecar.main import sidecar_command

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY = REPO_ROOT / "deploy"

# The project's default ports (architecture.md §8 and deploy/prometheus.yml): what the compose stack must agree with.
SIDECAR_OTLP_GRPC, SIDECAR_OTLP_HTTP, SIDECAR_METRICS = 4317, 4318, 9464
ROUTER_PORT, EXPORTER_PORT = 8000, 9400
ADVISOR_METRICS = 9465  # `splitscope advise --metrics-port` as deploy/ runs it (beside the sidecar's 9464)
PROMETHEUS_PORT, GRAFANA_PORT, TEMPO_QUERY_PORT = 9090, 3000, 3200


def _yaml(relative: str) -> dict:
    return yaml.safe_load((DEPLOY / relative).read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def compose() -> dict:
    return _yaml("compose.yaml")


def test_every_bind_mount_and_build_file_exists(compose: dict) -> None:
    named_volumes = set(compose.get("volumes") or {})
    checked = 0
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source in named_volumes:
                continue
            assert (DEPLOY / source).exists(), f"{name}: mounted {source} does not exist"
            checked += 1
        build = service.get("build")
        if build:
            context = DEPLOY / build["context"]
            assert (context / build["dockerfile"]).is_file(), f"{name}: no {build['dockerfile']}"
    assert checked >= 7


def test_compose_mounts_the_rules_dashboards_and_provisioning_we_generate(compose: dict) -> None:
    mounts = {
        (DEPLOY / v.split(":")[0]).resolve(): v.split(":")[1]
        for s in compose["services"].values()
        for v in s.get("volumes", [])
        if v.startswith(".")
    }
    assert mounts[RULES_PATH.resolve()] == "/etc/splitscope/alerts/rules.yaml"
    assert mounts[(DEPLOY / "prometheus.yml").resolve()] == "/etc/splitscope/deploy/prometheus.yml"
    # prometheus.yml names the rules relative to itself; the two mount points keep that relation.
    assert _yaml("prometheus.yml")["rule_files"] == ["../alerts/rules.yaml"]
    provider = _yaml("grafana/provisioning/dashboards/splitscope.yaml")["providers"][0]
    assert mounts[GENERATED_DIR.resolve()] == provider["options"]["path"]


def test_prometheus_config_is_valid_and_scrapes_our_default_ports() -> None:
    result = subprocess.run(
        [promtool_path(), "check", "config", str(DEPLOY / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    jobs = {job["job_name"]: job for job in _yaml("prometheus.yml")["scrape_configs"]}
    targets = {job: [t for sc in cfg["static_configs"] for t in sc["targets"]] for job, cfg in jobs.items()}
    # The server's metrics exporter holds every worker's series (each keeps its `worker` label), and the
    # sidecar's /metrics answers on its OTLP/HTTP port: one target per server and per sidecar, so no series is
    # scraped twice (the router's port, which answers the same series, is not a target).
    assert targets == {
        "splitscope-server": [f"127.0.0.1:{EXPORTER_PORT}"],
        "splitscope-sidecar": [f"127.0.0.1:{_default(sidecar_command, 'http_port')}"],
        "splitscope-advisor": [f"127.0.0.1:{ADVISOR_METRICS}"],
    }
    # The advisor host's collector config shows the same port in the command it documents.
    assert f"--metrics-port {ADVISOR_METRICS}" in (DEPLOY / "otel-collector-advisor.yaml").read_text()
    assert ADVISOR_METRICS != SIDECAR_METRICS
    assert f"--port {ROUTER_PORT} --exporter-port {EXPORTER_PORT}" in (DEPLOY / "prometheus.yml").read_text()
    assert _default(serve_command, "port") == ROUTER_PORT
    assert _default(sidecar_command, "http_port") == SIDECAR_OTLP_HTTP
    assert all(re.fullmatch(r"splitscope-[a-z]+", job) for job in jobs)  # TelemetryAbsent's job regex


def _default(command: click.Command, option: str) -> object:
    return next(p.default for p in command.params if p.name == option)


def test_ports_named_in_compose_match_the_defaults(compose: dict) -> None:
    services = compose["services"]
    assert all(s.get("network_mode") == "host" for s in services.values())
    prometheus_args = " ".join(services["prometheus"]["command"])
    assert f"--web.listen-address=127.0.0.1:{PROMETHEUS_PORT}" in prometheus_args
    assert "--enable-feature=exemplar-storage" in prometheus_args
    assert services["grafana"]["environment"]["GF_SERVER_HTTP_PORT"] == str(GRAFANA_PORT)
    sidecar = services["sidecar"]
    assert sidecar["command"][0] == "sidecar"
    assert sidecar["command"][sidecar["command"].index("--metrics-port") + 1] == str(SIDECAR_METRICS)

    collector = _yaml("otel-collector.yaml")
    collector_ports = {
        int(proto["endpoint"].rsplit(":", 1)[1]) for proto in collector["receivers"]["otlp"]["protocols"].values()
    }
    # The sidecar owns the standard OTLP ports on the host; the collector must not take them.
    assert collector_ports.isdisjoint({SIDECAR_OTLP_GRPC, SIDECAR_OTLP_HTTP})
    http_port = int(collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"].rsplit(":", 1)[1])
    assert sidecar["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == f"http://127.0.0.1:{http_port}"

    tempo = _yaml("tempo.yaml")
    tempo_otlp = tempo["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    assert collector["exporters"]["otlp/tempo"]["endpoint"] == tempo_otlp
    assert int(tempo_otlp.rsplit(":", 1)[1]) not in {SIDECAR_OTLP_GRPC, SIDECAR_OTLP_HTTP}
    assert tempo["server"]["http_listen_port"] == TEMPO_QUERY_PORT

    datasources = {d["type"]: d for d in _yaml("grafana/provisioning/datasources/splitscope.yaml")["datasources"]}
    assert datasources["prometheus"]["url"] == f"http://127.0.0.1:{PROMETHEUS_PORT}"
    assert datasources["tempo"]["url"] == f"http://127.0.0.1:{TEMPO_QUERY_PORT}"


def test_collector_writes_otlp_json_lines_and_forwards_traces() -> None:
    collector = _yaml("otel-collector.yaml")
    pipeline = collector["service"]["pipelines"]["traces"]
    assert pipeline["receivers"] == ["otlp"]
    file_exporters = [e for e in pipeline["exporters"] if e.split("/")[0] == "file"]
    assert file_exporters and collector["exporters"][file_exporters[0]]["format"] == "json"
    assert any(e.split("/")[0] in {"otlp", "otlphttp"} for e in pipeline["exporters"])
    # Bounded memory: the collector refuses data instead of growing (architecture.md §9).
    assert pipeline["processors"][0] == "memory_limiter"
