"""`splitscope serve --exporter-port`: the metrics exporter every process ships to, and its lifecycle."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import REPO_ROOT, wait_for
from tests.reference_server.server_harness import Server, http, pid_alive
from tracer.metrics import NAMESPACE_LABEL


def _samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, body, _ = http("GET", url)
    assert status == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


def _value(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def _children(pid: int) -> set[int]:
    return {int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}


def test_the_exporter_serves_every_process_s_series_and_stops_after_flushing_their_spans(tmp_path):
    env = {**os.environ, "OTEL_RESOURCE_ATTRIBUTES": "service.namespace=team-x"}
    server = Server(tmp_path, "--mode", "colocated", "--workers", "2", "--exporter-port", "0", env=env)
    try:
        exporter_port = int(re.search(r"exporter /metrics on :(\d+)", server.log()).group(1))
        exporter_url = f"http://127.0.0.1:{exporter_port}/metrics"
        (exporter_pid,) = _children(server.process.pid) - set(server.worker_pids)
        assert os.getpriority(os.PRIO_PROCESS, exporter_pid) == 19  # its CPU yields to serving

        produced = 0
        for prompt in ("one request", "and another, a little longer"):
            status, body, _ = server.complete({"prompt": prompt, "max_tokens": 6, "ignore_eos": True})
            assert status == 200
            produced += json.loads(body)["usage"]["completion_tokens"]

        # Every request the client got an answer for, metered from the router's spans, and every token from
        # the workers' (the client's counts are the ground truth; router and workers ship on their own
        # connections, so wait for both); each worker's gauges as it reports them on its router's join.
        def ttft_count(samples: dict) -> float | None:
            labels = {"gen_ai_request_model": "tiny", "mode": "colocated", "namespace": "team-x"}
            return _value(samples, "gen_ai_server_time_to_first_token_seconds_count", **labels)

        def decode_tokens(samples: dict) -> float:
            tokens = "splitscope_tokens_total"
            return sum(v for (name, labels), v in samples.items() if name == tokens and ("phase", "decode") in labels)

        def settled() -> dict | None:
            samples = _samples(exporter_url)
            return samples if (ttft_count(samples) or 0) >= 2 and decode_tokens(samples) >= produced else None

        samples = wait_for(settled, 15, "both requests and their tokens in the exporter's series")
        assert ttft_count(samples) == 2
        assert decode_tokens(samples) == produced  # every token the client got, counted where it was made
        joined = _samples(f"http://127.0.0.1:{server.metrics_port}/metrics")
        for worker in ("colocated-0", "colocated-1"):
            labels = {"pool": "colocated", "worker": worker, NAMESPACE_LABEL: "team-x"}
            for gauge in (
                "splitscope_requests_waiting",
                "splitscope_requests_running",
                "splitscope_kv_cache_usage_ratio",
            ):
                assert _value(samples, gauge, **labels) == _value(joined, gauge, **labels) is not None, (gauge, worker)
        assert _value(samples, "splitscope_pool_workers", pool="colocated", namespace="team-x") == 2

        assert server.stop(signal.SIGTERM) == 0
        assert not pid_alive(exporter_pid)
        # The exporter wrote the spans of router and workers, flushed as they stopped.
        names = {span.name for span in server.spans()}
        assert {"text_completion tiny", "splitscope.prefill", "splitscope.decode", "splitscope.step"} <= names
    finally:
        server.close()


def test_a_dead_exporter_is_reported_once_and_the_server_serves_on(tmp_path):
    server = Server(tmp_path, "--mode", "colocated", "--workers", "1", "--exporter-port", "0")
    try:
        (exporter_pid,) = _children(server.process.pid) - set(server.worker_pids)
        os.kill(exporter_pid, signal.SIGKILL)
        wait_for(lambda: "the metrics exporter exited with status -9" in server.log(), 15, "the launcher's error line")
        status, body, _ = server.complete({"prompt": "still here", "max_tokens": 4, "ignore_eos": True})
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 4
        assert server.stop(signal.SIGTERM) == 0  # stopping a dead exporter is no error
        assert server.log().count("the metrics exporter exited") == 1
    finally:
        server.close()


def test_exporter_port_with_a_sidecar_socket_is_refused_in_one_line():
    result = subprocess.run(
        [sys.executable, "-m", "tracer.cli.main", "serve", "--exporter-port", "0", "--sidecar-socket", "/tmp/x.sock"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "--exporter-port runs its own sidecar" in result.stderr and "Traceback" not in result.stderr
