"""Start a real Prometheus server for a test: `from tests.prom import running_prometheus`, then
`with running_prometheus(["127.0.0.1:PORT"]) as prom: prom.query(...)`.

The server runs as a child process on a free 127.0.0.1 port with a temporary config and storage folder, is
ready when the context manager yields (it polls /-/ready with a deadline) and is stopped on exit (terminate,
then kill). All handle methods block on HTTP with a timeout; none of them sleeps without a condition.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

# The suite runs as `python -m pytest` from the repository root (scripts/test.sh), so `tests` imports.
from tests.conftest import free_port

_READY_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 10.0
_HTTP_TIMEOUT_S = 10.0
_POLL_INTERVAL_S = 0.1


class PrometheusError(RuntimeError):
    """Prometheus answered with an error (bad query, not ready) or could not be started."""


class PrometheusHandle:
    """A running Prometheus: its base URL, process and the queries tests need."""

    def __init__(self, base_url: str, process: subprocess.Popen[bytes], log_path: Path, job: str) -> None:
        self.base_url = base_url
        self.process = process
        self.log_path = log_path
        self.job = job

    def _get(self, path: str, params: dict[str, str] | None = None) -> Any:
        url = f"{self.base_url}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=_HTTP_TIMEOUT_S) as response:
                body = json.load(response)
        except urllib.error.HTTPError as exc:
            # 400/422 carry Prometheus's own error text: keep it, it is what the test should show.
            try:
                detail = json.load(exc).get("error", "")
            except ValueError:
                detail = ""
            raise PrometheusError(f"GET {path} {params or ''}: HTTP {exc.code}: {detail}") from exc
        if body.get("status") != "success":
            raise PrometheusError(f"GET {path} {params or ''}: {body.get('error', body)}")
        return body["data"]

    def query(self, promql: str) -> list[dict[str, Any]]:
        """Instant query; returns `data.result` (vector: [{'metric': {...}, 'value': [ts, 'str']}]).

        Raises PrometheusError with Prometheus's message when it rejects the query.
        """
        data = self._get("/api/v1/query", {"query": promql})
        result = data["result"]
        # Scalars and strings come back as a bare [ts, value] pair; wrap them so callers see one shape.
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": result}]
        return result

    def query_range(
        self, promql: str, start_unix_s: float, end_unix_s: float, step_s: float = 1.0
    ) -> list[dict[str, Any]]:
        """Range query, as a Grafana panel runs over its time range; returns `data.result`
        (matrix: [{'metric': {...}, 'values': [[ts, 'str'], ...]}]).

        Raises PrometheusError with Prometheus's message when it rejects the query.
        """
        params = {"query": promql, "start": f"{start_unix_s:.3f}", "end": f"{end_unix_s:.3f}", "step": f"{step_s}"}
        return self._get("/api/v1/query_range", params)["result"]

    def wait_for(
        self,
        promql: str,
        predicate: Callable[[list[dict[str, Any]]], bool],
        timeout_s: float = 30.0,
    ) -> list[dict[str, Any]]:
        """Poll `query(promql)` until `predicate(result)` is true; return that result.

        Raises TimeoutError with the last result when the deadline passes.
        """
        deadline = time.monotonic() + timeout_s
        result: list[dict[str, Any]] = []
        while True:
            result = self.query(promql)
            if predicate(result):
                return result
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{promql!r}: condition not met within {timeout_s} s; last result {result}")
            self._check_alive()
            time.sleep(_POLL_INTERVAL_S)

    def alerts(self) -> list[dict[str, Any]]:
        """Active alerts (pending and firing) from /api/v1/alerts."""
        return self._get("/api/v1/alerts")["alerts"]

    def rule_groups(self) -> list[dict[str, Any]]:
        """Loaded rule groups from /api/v1/rules (each rule with its health and lastError)."""
        return self._get("/api/v1/rules")["groups"]

    def wait_for_rules_evaluated(self, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """Block until every loaded rule has been evaluated once (health not "unknown"); return the groups."""
        deadline = time.monotonic() + timeout_s
        while True:
            groups = self.rule_groups()
            if groups and all(r["health"] != "unknown" for g in groups for r in g["rules"]):
                return groups
            if time.monotonic() >= deadline:
                raise TimeoutError(f"rules not evaluated within {timeout_s} s")
            self._check_alive()
            time.sleep(_POLL_INTERVAL_S)

    def targets_up(self) -> dict[str, bool]:
        """scrape URL -> whether its last scrape succeeded (active targets only)."""
        targets = self._get("/api/v1/targets", {"state": "active"})["activeTargets"]
        return {t["scrapeUrl"]: t["health"] == "up" for t in targets}

    def wait_targets_up(self, timeout_s: float = 30.0) -> None:
        """Block until every configured target has been scraped successfully at least once."""
        deadline = time.monotonic() + timeout_s
        while True:
            up = self.targets_up()
            if up and all(up.values()):
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"targets not all up within {timeout_s} s: {up}")
            self._check_alive()
            time.sleep(_POLL_INTERVAL_S)

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def _check_alive(self) -> None:
        if self.process.poll() is not None:
            raise PrometheusError(f"prometheus exited with {self.process.returncode}:\n{self.log()[-4000:]}")


def prometheus_path() -> str:
    path = shutil.which("prometheus")
    if path is None:
        raise PrometheusError("prometheus not found on PATH (scripts/setup.sh installs Debian's package)")
    return path


def _config(
    scrape_targets: Sequence[str],
    rule_files: Sequence[Path],
    scrape_interval_s: float,
    evaluation_interval_s: float,
    job: str,
) -> dict[str, Any]:
    return {
        "global": {
            "scrape_interval": f"{scrape_interval_s:g}s",
            "scrape_timeout": f"{min(scrape_interval_s, 10):g}s",
            "evaluation_interval": f"{evaluation_interval_s:g}s",
        },
        "rule_files": [str(Path(p).resolve()) for p in rule_files],
        "scrape_configs": [{"job_name": job, "static_configs": [{"targets": list(scrape_targets)}]}]
        if scrape_targets
        else [],
    }


def _wait_ready(handle: PrometheusHandle, deadline: float) -> None:
    while True:
        handle._check_alive()
        try:
            with urllib.request.urlopen(f"{handle.base_url}/-/ready", timeout=_HTTP_TIMEOUT_S) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass  # not listening yet, or 503 while the TSDB opens
        if time.monotonic() >= deadline:
            raise PrometheusError(f"prometheus not ready within {_READY_TIMEOUT_S} s:\n{handle.log()[-4000:]}")
        time.sleep(_POLL_INTERVAL_S)


@contextmanager
def running_prometheus(
    scrape_targets: list[str],
    rule_files: Sequence[str | Path] = (),
    scrape_interval_s: float = 1,
    evaluation_interval_s: float = 1,
    job: str = "splitscope",
) -> Iterator[PrometheusHandle]:
    """A Prometheus scraping `scrape_targets` ("host:port", path /metrics) under job `job`, loading
    `rule_files`, ready on return. Stopped, and its temporary folder removed, when the block exits.
    """
    binary = prometheus_path()
    with tempfile.TemporaryDirectory(prefix="splitscope-prom-") as tmp:
        workdir = Path(tmp)
        config_path = workdir / "prometheus.yml"
        config_path.write_text(
            yaml.safe_dump(
                _config(scrape_targets, [Path(p) for p in rule_files], scrape_interval_s, evaluation_interval_s, job),
                sort_keys=False,
            ),
            encoding="utf-8",
        )
        port = free_port()
        log_path = workdir / "prometheus.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config_path}",
                    f"--storage.tsdb.path={workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        handle = PrometheusHandle(f"http://127.0.0.1:{port}", process, log_path, job)
        try:
            _wait_ready(handle, time.monotonic() + _READY_TIMEOUT_S)
            yield handle
        finally:
            process.terminate()
            try:
                process.wait(timeout=_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=_STOP_TIMEOUT_S)


@contextmanager
def serving_registry(registry: Any, port: int) -> Iterator[str]:
    """Serve `registry` on 127.0.0.1:`port` (/metrics) for a live Prometheus; yields the scrape target."""
    from prometheus_client import start_http_server

    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
