"""End to end: our running components expose every metric the dashboards and rules read (STYLE 11), and a
real Prometheus scraping them under load returns data for every dashboard panel.

The stack, shared by the module (real processes, real sockets, real HTTP):
- a disaggregated reference server (`tiny`, 1 prefill + 1 decode) shipping its spans to a real sidecar over
  its Unix socket, as a deployment with a sidecar runs: span-derived metrics (TTFT, stages, KV bytes) are
  the sidecar's, engine gauges and step metrics stay with the server's router (which merges its workers);
- a colocated reference server (`tiny`, 1 worker) recording its own metrics, so a colocated pool has steps
  with and without prefill (the interference panels);
- a Prometheus scraping the two routers and the sidecar every second, with the committed rules.

The two servers are two deployments (`--namespace`), as two teams sharing one Prometheus: every series a
server exports carries its namespace and every worker's its `worker`, and the rules keep them apart.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from reference_server.process import ServerProcess
from tests.e2e.live import (
    BackgroundLoad,
    exposed_families,
    finite_values,
    missing_families,
)
from tests.prom import PrometheusHandle, running_prometheus
from tracer.alerts.rules import RULES_PATH
from tracer.dashboards import interference
from tracer.dashboards.catalogue import (
    dashboard_queries,
    grafana_to_promql,
    referenced_metrics,
)
from tracer.load import LengthSpec, LoadConfig
from tracer.sidecar.server import Sidecar, SidecarConfig

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
    sidecar: Sidecar
    prom: PrometheusHandle

    @property
    def sidecar_metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.sidecar.http_port}/metrics"


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
    socket_path = str(work / "sidecar.sock")
    sidecar = Sidecar(SidecarConfig(http_port=0, grpc_port=None, unix_socket=socket_path, gpu=True, environ={}))
    sidecar.start()
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
            "--sidecar-socket",
            socket_path,
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
        targets = [s.url.removeprefix("http://") for s in (disaggregated, colocated)]
        targets.append(f"127.0.0.1:{sidecar.http_port}")
        with running_prometheus(targets, rule_files=[RULES_PATH]) as prom:
            prom.wait_targets_up(timeout_s=30)
            loads = [_load(disaggregated, 32, 16).start(), _load(colocated, 16, 32).start()]
            for load in loads:
                result = load.join()
                assert result.summary.ok > 0 and result.summary.errors == 0, result.summary
            yield Stack(disaggregated, colocated, sidecar, prom)
    finally:
        for server in (disaggregated, colocated):
            server.stop()
        sidecar.stop(2.0)


def test_every_metric_a_dashboard_or_rule_reads_is_exposed(stack: Stack) -> None:
    referenced = referenced_metrics()
    # The catalogue check is only as good as the parse of the dashboards and rules behind it.
    assert {
        "splitscope_step_duration_seconds",
        "splitscope_kv_transfer_failures_total",
        "gen_ai_server_time_to_first_token_seconds",
        "splitscope_gpu_telemetry_up",
    } <= referenced

    with_sidecar = exposed_families(stack.disaggregated.url + "/metrics") | exposed_families(stack.sidecar_metrics_url)
    assert missing_families(sorted(referenced), with_sidecar) == []
    # A server without a sidecar records every metric itself.
    assert missing_families(sorted(referenced), exposed_families(stack.colocated.url + "/metrics")) == []
    # Span-derived families really come from the sidecar in that deployment (not only their HELP lines).
    sidecar_families = exposed_families(stack.sidecar_metrics_url)
    assert sidecar_families["gen_ai_server_time_to_first_token_seconds"].samples
    assert sidecar_families["splitscope_kv_transfer_bytes"].samples


def test_every_dashboard_panel_returns_data_from_a_live_prometheus(stack: Stack) -> None:
    queries = dashboard_queries()
    panels = {(uid, title) for uid, title, _ in queries}
    assert set(RARE_DATA) | GPU_ONLY | REQUEST_LEVEL_ONLY <= panels, "an allow-listed panel no longer exists"
    telemetry_up = finite_values(stack.prom.query("max(splitscope_gpu_telemetry_up)"))
    assert telemetry_up, "no component exposes splitscope_gpu_telemetry_up"
    exempt = set(RARE_DATA) | REQUEST_LEVEL_ONLY | (GPU_ONLY if telemetry_up[0] == 0 else set())

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
    """Nothing is summed across processes: Prometheus stores each worker's series apart. (The sidecar's
    span-derived series are the sidecar's own and are left out here.)"""
    sidecar = f"127.0.0.1:{stack.sidecar.http_port}"
    steps = stack.prom.query(f'splitscope_step_duration_seconds_count{{instance!="{sidecar}"}}')
    labelled = {(s["metric"].get("namespace"), s["metric"]["pool"], s["metric"].get("worker")) for s in steps}
    assert {
        ("team-disagg", "prefill", "prefill-0"),
        ("team-disagg", "decode", "decode-0"),
        ("team-coloc", "colocated", "colocated-0"),
    } <= labelled
    assert all(worker for _, _, worker in labelled), labelled
