"""The installs users make most, each alone: the wheel with its own requirements and nothing else.

test_wheel.py lends the wheel this test environment's packages, so it cannot see an extra that forgot one
(the report extra once lacked prometheus_client: `splitscope report` died on import). Here each case gets
a fresh virtual environment and `pip install "<wheel>[extra]"` resolves that extra's requirements as a
user's pip does (from pip's cache where it holds them), then its command runs from a folder that is not
the repository: the base install (the engine's import), `report` and `sidecar`. bench/extras_alone.py does
the same for the other extras (bench/RESULTS.md, "Extras installed alone").

Slow (an install each, tens of seconds) and untimed: tests/conftest.py marks tests/packaging/ so.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import urllib.request
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import wait_for
from tests.sidecar.conftest import http_get, spans_when
from tracer import spans as s
from tracer.sidecar.auth import TOKEN_ENV

# A cold pip cache downloads every requirement; the default 300 s per test is for warm ones.
pytestmark = pytest.mark.timeout(900)

# What the base distribution promises an engine it leaves out (pyproject.toml, `dependencies`).
NOT_IN_BASE = ("opentelemetry.sdk", "prometheus_client", "numpy", "torch")


def _clean_environ() -> dict[str, str]:
    """This process's environment without what would point a child at this environment or a collector."""
    drop = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", TOKEN_ENV)
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("OTEL_")}


def _fresh_install(wheel: Path, extra: str | None, where: Path) -> Path:
    """A new virtual environment (with its own pip) holding the wheel and that extra's requirements."""
    env = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True, capture_output=True, timeout=300)
    requirement = f"{wheel}[{extra}]" if extra else str(wheel)
    # --no-compile: no .pyc for packages the command never imports (about 10 s of each install).
    installed = subprocess.run(
        [
            str(env / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "-q",
            "--only-binary",
            ":all:",
            "--no-compile",
            requirement,
        ],
        capture_output=True,
        text=True,
        timeout=800,
        env=_clean_environ(),
        stdin=subprocess.DEVNULL,
    )
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    return env


def _run(env: Path, *args: str, cwd: Path, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(env / "bin" / args[0]), *args[1:]],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=_clean_environ(),
        stdin=subprocess.DEVNULL,
    )


def _absent(env: Path, modules: tuple[str, ...], cwd: Path) -> list[str]:
    """Which of `modules` this environment cannot import (installed nowhere it looks)."""
    probe = textwrap.dedent(f"""
        import importlib.util, json
        def absent(name):
            try:  # a dotted name whose parent is missing raises rather than answering None
                return importlib.util.find_spec(name) is None
            except ModuleNotFoundError:
                return True
        print(json.dumps([m for m in {list(modules)!r} if absent(m)]))
    """)
    result = _run(env, "python", "-c", probe, cwd=cwd)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def base_env(wheel, tmp_path_factory) -> Path:
    return _fresh_install(wheel, None, tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def report_env(wheel, tmp_path_factory) -> Path:
    return _fresh_install(wheel, "report", tmp_path_factory.mktemp("report"))


@pytest.fixture(scope="module")
def sidecar_env(wheel, tmp_path_factory) -> Path:
    return _fresh_install(wheel, "sidecar", tmp_path_factory.mktemp("sidecar"))


def test_the_base_install_traces_without_the_sdk(base_env, tmp_path):
    assert _absent(base_env, NOT_IN_BASE, tmp_path) == list(NOT_IN_BASE)  # not even installed
    record = textwrap.dedent(f"""
        import json, sys
        import tracer
        from tracer import TraceContext, start_tracing
        from tracer import spans as s
        assert tracer.__file__.startswith(sys.prefix), tracer.__file__  # the wheel, not the repository
        ctx = TraceContext.new_root()
        off = start_tracing("colocated", "w0", enabled=False)
        off.tracer.stage("prefill", ctx.child(s.new_span_id()), 0, 1_000_000)
        # The sidecar path with no sidecar listening: the record is built, shipped, and counted as lost.
        session = start_tracing("colocated", "w0", sidecar_socket={str(tmp_path / "nobody.sock")!r})
        session.tracer.stage("prefill", ctx.child(s.new_span_id()), 0, 1_000_000)
        session.shutdown(5.0)
        loaded = sorted(m for m in {list(NOT_IN_BASE)!r} if m in sys.modules)
        print(json.dumps({{"tracer": type(off.tracer).__name__, "dropped": session.dropped_records.by_reason(),
                          "loaded": loaded}}))
    """)
    recorded = _run(base_env, "python", "-c", record, cwd=tmp_path)
    assert recorded.returncode == 0, recorded.stderr
    assert json.loads(recorded.stdout) == {"tracer": "NoopTracer", "dropped": {"sidecar_unreachable": 1}, "loaded": []}

    help_text = _run(base_env, "splitscope", "--help", cwd=tmp_path)
    assert help_text.returncode == 0, help_text.stderr
    assert "(not installed: pip install 'splitscope[alerts]')" in help_text.stdout  # names the extra


def _write_traces(path: Path) -> None:
    """40 requests and their worker stages as OTLP/JSON lines, written by this tree's tracer here (the
    export extra writes trace files; a report-only install reads them)."""
    record = textwrap.dedent(f"""
        from tracer import TraceContext, start_tracing
        from tracer import spans as s
        session = start_tracing("colocated", "w0", traces_file={str(path)!r})
        router = start_tracing(None, None, traces_file={str(path)!r})
        tracer, ms = session.tracer, 1_000_000
        for i in range(40):
            t0 = i * 50 * ms
            ctx = TraceContext.new_root()
            root = s.new_span_id()
            child = ctx.child(root)
            tracer.stage("queue", child, t0, t0 + ms)
            tracer.stage("prefill", child, t0 + ms, t0 + 11 * ms, {{s.ATTR_PREFILL_TOKENS: 200 + 10 * i}})
            tracer.step(t0 + ms, t0 + 11 * ms, 1, 200 + 10 * i, 300)
            router.tracer.request(ctx, root, t0, t0 + 30 * ms, t0 + 11 * ms, model="tiny", mode="colocated",
                                  request_id=f"r{{i}}", input_tokens=200 + 10 * i, output_tokens=8)
        session.shutdown(5.0)
        router.shutdown(5.0)
    """)
    subprocess.run(
        [sys.executable, "-c", record],
        cwd=path.parent,
        check=True,
        env=_clean_environ(),
        timeout=120,
        capture_output=True,
    )


def test_the_report_extra_alone_reads_a_trace_file(report_env, tmp_path):
    assert _absent(report_env, ("torch",), tmp_path) == ["torch"]
    traces = tmp_path / "traces.jsonl"
    _write_traces(traces)
    slo = ("--slo-ttft", "0.5", "--slo-itl", "0.1")
    report = _run(
        report_env, "splitscope", "report", str(traces), *slo, "--format", "json", cwd=tmp_path, timeout_s=300
    )
    assert report.returncode == 0, report.stdout[-2000:] + report.stderr[-2000:]
    result = json.loads(report.stdout)
    assert result["read"]["requests"] == 40 and result["read"]["steps"] == 40
    # The HTML report draws its plots with matplotlib, imported only there.
    page = tmp_path / "report.html"
    html = _run(
        report_env, "splitscope", "report", str(traces), *slo, "--format", "html", "-o", str(page), cwd=tmp_path
    )
    assert html.returncode == 0, html.stderr[-2000:]
    assert "data:image/png;base64," in page.read_text()


def _kv(key: str, value: str | int) -> KeyValue:
    any_value = AnyValue(int_value=value) if isinstance(value, int) else AnyValue(string_value=value)
    return KeyValue(key=key, value=any_value)


def _one_prefill_span() -> bytes:
    """An OTLP/HTTP body: one prefill span in our vocabulary, as a worker's SDK would export it."""
    t0, ms = 1_700_000_000_000_000_000, 1_000_000
    span = Span(
        trace_id=bytes(range(1, 17)),
        span_id=bytes(range(1, 9)),
        name=s.SPAN_PREFILL,
        kind=Span.SPAN_KIND_INTERNAL,
        start_time_unix_nano=t0,
        end_time_unix_nano=t0 + 40 * ms,
        attributes=[_kv(s.ATTR_POOL, "colocated"), _kv(s.ATTR_WORKER, "w0"), _kv(s.ATTR_PREFILL_TOKENS, 100)],
    )
    resource = Resource(attributes=[_kv("service.name", "worker-a")])
    request = ExportTraceServiceRequest(
        resource_spans=[ResourceSpans(resource=resource, scope_spans=[ScopeSpans(spans=[span])])]
    )
    return request.SerializeToString()


def _stage_count(port: int, stage: str) -> float:
    """splitscope_stage_duration_seconds_count{stage, pool="colocated"} on the sidecar's /metrics, summed
    over workers (a compact record names its worker; an OTLP span without the resource attribute none)."""
    _, body = http_get(f"http://127.0.0.1:{port}/metrics")
    return sum(
        sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
        if sample.name == "splitscope_stage_duration_seconds_count"
        and sample.labels.get("stage") == stage
        and sample.labels.get("pool") == "colocated"
    )


def test_the_sidecar_extra_alone_receives_otlp_and_worker_records(sidecar_env, base_env, tmp_path):
    """OTLP/HTTP from a worker's SDK, and compact records from a base install's tracer (an engine's
    install beside a sidecar's), both metered and written."""
    assert _absent(sidecar_env, ("torch",), tmp_path) == ["torch"]
    traces, sock = tmp_path / "traces.jsonl", tmp_path / "sidecar.sock"
    command = ["sidecar", "--http-port", "0", "--grpc-port", "0", "--socket", str(sock), "--traces-file", str(traces)]
    process = subprocess.Popen(
        [str(sidecar_env / "bin" / "splitscope"), *command, "--no-gpu"],
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=_clean_environ(),
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(process.stderr.readline, "")), daemon=True)
    reader.start()
    try:

        def listening() -> re.Match | None:
            return next(filter(None, (re.search(r"listening: otlp/http 127\.0\.0\.1:(\d+)", x) for x in lines)), None)

        wait_for(lambda: listening() or process.poll() is not None, 60, "the sidecar's listening line")
        assert process.poll() is None, "".join(lines)
        port = int(listening().group(1))

        post = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/traces",
            data=_one_prefill_span(),
            headers={"Content-Type": "application/x-protobuf"},
            method="POST",
        )
        with urllib.request.urlopen(post, timeout=10) as response:
            assert response.status == 200
        wait_for(lambda: _stage_count(port, "prefill") == 1, 10, "the OTLP prefill span on /metrics")

        ship = textwrap.dedent(f"""
            import json
            from tracer import TraceContext, start_tracing
            from tracer import spans as s
            session = start_tracing("colocated", "w1", sidecar_socket={str(sock)!r})
            session.tracer.stage("queue", TraceContext.new_root().child(s.new_span_id()), 0, 2_000_000)
            session.shutdown(5.0)
            print(json.dumps(session.dropped_records.by_reason()))
        """)
        shipped = _run(base_env, "python", "-c", ship, cwd=tmp_path)
        assert shipped.returncode == 0 and json.loads(shipped.stdout) == {}, shipped.stdout + shipped.stderr
        wait_for(lambda: _stage_count(port, "queue") == 1, 10, "the base install's queue record on /metrics")
        assert {span.name for span in spans_when(traces, 2)} == {s.SPAN_PREFILL, s.SPAN_QUEUE}

        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        reader.join(10)
        assert any("stopping" in line for line in lines), "".join(lines)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
