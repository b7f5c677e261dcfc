"""End to end: our running components expose every metric the dashboards and rules read (one catalogue, checked), and a
real Prometheus scraping them under load returns data for every dashboard panel.

The stack, shared by the module (real processes, real sockets, real HTTP):
- a disaggregated reference server (`tiny`, 1 prefill + 1 decode) with its metrics exporter
  (`--exporter-port`, the deployment deploy/prometheus.yml scrapes): router and workers ship their spans and
  gauge snapshots to it over its Unix socket, and it alone is scraped;
- a colocated reference server (`tiny`, 1 worker) recording its own metrics, scraped at its router, so a
  colocated pool has steps with and without prefill (the interference panels);
- a Prometheus scraping the exporter and the colocated router every second, with the committed rules.

The two servers are two deployments (`--namespace`), as two teams sharing one Prometheus: every series a
server exports carries its namespace and every worker's its `worker`, and the rules keep them apart.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from reference_server.launch.process import ServerProcess, free_port
from tests.e2e.live import (
    BackgroundLoad,
    exposed_families,
    finite_values,
    missing_families,
)
from tests.prom import PrometheusHandle, running_prometheus
from tracer.alerts.rules import RULES_PATH
from tracer.dashboards import advice, interference, overview
from tracer.dashboards.catalogue import (
    dashboard_queries,
    grafana_to_promql,
    referenced_metrics,
)
from tracer.load import LengthSpec, LoadConfig
from tracer.metrics import ADVICE_FAMILIES

PRESET = "tiny"
NAMESPACES = {"disaggregated": "team-disagg", "colocated": "team-coloc"}
LOAD_S = 6.0
PANEL_WAIT_S = 60.0

# Panels that legitimately show nothing after a healthy run on this machine, with the reason.
RARE_DATA = {
    (
        "splitscope-kv-transfer",
        "Failures by reason",
    ): "no KV transfer fails in a healthy run; the series appear with the first failure",
}
# Fed only by engines watched through the sidecar (request spans of stock vLLM, SGLang); this stack runs
# our own workers, whose step timing those panels stand in for (tests/e2e/test_request_interference_live.py).
REQUEST_LEVEL_ONLY = {(interference.UID, title) for title in interference.REQUEST_PANELS}
# Fed by the advisor (`splitscope advise --metrics-port`), a process of its own that this stack does not
# run: tests/advise/test_follow_synthetic.py runs these panels' queries against its own Prometheus scraping one
# (all but the confidence target, absent while the advisor's bootstrap is off; tests/advise/test_exposition.py).
ADVISOR_ONLY = {(overview.UID, title) for title in advice.PANELS}
# Only while the components report no GPU telemetry (splitscope_gpu_telemetry_up 0, e.g. a CPU machine);
# the "GPU telemetry" panel itself must still show that 0.
GPU_ONLY = {
    ("splitscope-gpu", "GPUs seen"),
    ("splitscope-gpu", "GPU utilisation"),
    ("splitscope-gpu", "GPU memory used"),
}


@dataclass
class Stack:
    disaggregated: ServerProcess
    colocated: ServerProcess
    exporter_port: int  # the disaggregated server's metrics exporter
    prom: PrometheusHandle

    @property
    def exporter_metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.exporter_port}/metrics"


def _load(server: ServerProcess, prompt_tokens: int, output_tokens: int) -> BackgroundLoad:
    # Several requests overlap, so colocated steps come both with and without a new prompt's prefill.
    return BackgroundLoad(
        LoadConfig(
            url=server.url,
            model=PRESET,
            rate_rps=4.0,
            duration_s=LOAD_S,
            prompt=LengthSpec(prompt_tokens),
            output=LengthSpec(output_tokens),
            seed=5,
            timeout_s=60,
        )
    )


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("e2e-stack")
    exporter_port = free_port()
    disaggregated = ServerProcess(
        [
            "--preset",
            PRESET,
            "--mode",
            "disaggregated",
            "--prefill-workers",
            "1",
            "--decode-workers",
            "1",
            "--exporter-port",
            str(exporter_port),
            "--namespace",
            NAMESPACES["disaggregated"],
        ],
        log_path=work / "disaggregated.log",
    )
    colocated = ServerProcess(
        ["--preset", PRESET, "--mode", "colocated", "--workers", "1", "--namespace", NAMESPACES["colocated"]],
        log_path=work / "colocated.log",
    )
    try:
        with ThreadPoolExecutor(2) as pool:  # both import torch and build a model: start them side by side
            for started in [pool.submit(s.start) for s in (disaggregated, colocated)]:
                started.result()
        targets = [f"127.0.0.1:{exporter_port}", colocated.url.removeprefix("http://")]
        with running_prometheus(targets, rule_files=[RULES_PATH]) as prom:
            prom.wait_targets_up(timeout_s=30)
            loads = [_load(disaggregated, 32, 16).start(), _load(colocated, 16, 32).start()]
            for load in loads:
                result = load.join()
                assert result.summary.ok > 0 and result.summary.errors == 0, result.summary
            yield Stack(disaggregated, colocated, exporter_port, prom)
    finally:
        for server in (disaggregated, colocated):
            server.stop()


def test_every_metric_a_dashboard_or_rule_reads_is_exposed(stack: Stack) -> None:
    referenced = referenced_metrics() - set(ADVICE_FAMILIES)  # the advisor's, exposed by its own process
    # The catalogue check is only as good as the parse of the dashboards and rules behind it.
    assert {
        "splitscope_step_duration_seconds",
        "splitscope_kv_transfer_failures_total",
        "gen_ai_server_time_to_first_token_seconds",
        "splitscope_gpu_telemetry_up",
    } <= referenced

    # The exporter alone holds every metric of its server, as the router of a server without one does.
    exporter = exposed_families(stack.exporter_metrics_url)
    assert missing_families(sorted(referenced), exporter) == []
    assert missing_families(sorted(referenced), exposed_families(stack.colocated.url + "/metrics")) == []
    # Span-derived families really come from it (not only their HELP lines), and each worker's series, gauges
    # included, keep their worker and deployment.
    assert exporter["gen_ai_server_time_to_first_token_seconds"].samples
    kv_bytes = exporter["splitscope_kv_transfer_bytes"].samples
    assert {s.labels.get("worker") for s in kv_bytes if s.name.endswith("_total") and s.value > 0} == {"prefill-0"}
    waiting = {(s.labels["worker"], s.labels["namespace"]) for s in exporter["splitscope_requests_waiting"].samples}
    assert waiting == {("prefill-0", NAMESPACES["disaggregated"]), ("decode-0", NAMESPACES["disaggregated"])}


def test_every_dashboard_panel_returns_data_from_a_live_prometheus(stack: Stack) -> None:
    queries = dashboard_queries()
    panels = {(uid, title) for uid, title, _ in queries}
    assert set(RARE_DATA) | GPU_ONLY | REQUEST_LEVEL_ONLY | ADVISOR_ONLY <= panels, (
        "an allow-listed panel no longer exists"
    )
    telemetry_up = finite_values(stack.prom.query("max(splitscope_gpu_telemetry_up)"))
    assert telemetry_up, "no component exposes splitscope_gpu_telemetry_up"
    exempt = set(RARE_DATA) | REQUEST_LEVEL_ONLY | ADVISOR_ONLY | (GPU_ONLY if telemetry_up[0] == 0 else set())

    pending = {(uid, title, grafana_to_promql(expr)) for uid, title, expr in queries if (uid, title) not in exempt}
    assert all("$" not in promql for _, _, promql in pending)
    deadline = time.monotonic() + PANEL_WAIT_S
    # Rates need two scrapes of an increase inside their window: poll every panel until each has data.
    while pending and time.monotonic() < deadline:
        pending = {
            (uid, title, promql) for uid, title, promql in pending if not finite_values(stack.prom.query(promql))
        }
        if pending:
            time.sleep(0.5)  # poll interval: Prometheus scrapes every second
    assert sorted(pending) == [], "panels without data"


def test_committed_rules_evaluate_cleanly_on_live_data(stack: Stack) -> None:
    stack.prom.wait_for_rules_evaluated(timeout_s=30)
    # Two evaluations after the load: errors such as many-to-many matches only show with real series.
    stack.prom.wait_for("pool:splitscope_step_duration_seconds:interference_ratio5m", bool, timeout_s=30)
    groups = stack.prom.rule_groups()
    unhealthy = [(r["name"], r.get("lastError")) for g in groups for r in g["rules"] if r["health"] != "ok"]
    assert unhealthy == []
    # Recording rules that join several families have values on real data.
    for record in (
        "deployment:splitscope_kv_transfer:ttft_share5m",
        "pool:splitscope_worker_busy:ratio5m",
        "pool:splitscope_step_duration_seconds:prefill_time_share5m",
    ):
        assert finite_values(stack.prom.query(record)), f"{record} has no value"
    assert "TelemetryAbsent" not in {a["labels"]["alertname"] for a in stack.prom.alerts()}
    # Each deployment's pools are judged on their own: one busy ratio per (namespace, pool), none over 1.
    busy = stack.prom.query("pool:splitscope_worker_busy:ratio5m")
    pools = {(s["metric"].get("namespace"), s["metric"]["pool"]) for s in busy}
    assert pools == {("team-disagg", "prefill"), ("team-disagg", "decode"), ("team-coloc", "colocated")}
    assert all(0 <= v <= 1 for v in finite_values(busy)), busy


def test_every_worker_series_keeps_its_worker_and_namespace(stack: Stack) -> None:
    """Nothing is summed across processes: Prometheus stores each worker's series apart, whether its router
    joined them or the exporter metered them from the worker's spans."""
    steps = stack.prom.query("splitscope_step_duration_seconds_count")
    labelled = {(s["metric"].get("namespace"), s["metric"]["pool"], s["metric"].get("worker")) for s in steps}
    assert labelled == {
        ("team-disagg", "prefill", "prefill-0"),
        ("team-disagg", "decode", "decode-0"),
        ("team-coloc", "colocated", "colocated-0"),
    }
