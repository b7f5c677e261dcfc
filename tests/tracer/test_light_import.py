"""An engine pays for the hot path and the sidecar client, nothing else (README: "use the tracer")."""

from __future__ import annotations

import subprocess
import sys
import textwrap

HEAVY = ("opentelemetry.sdk", "opentelemetry", "prometheus_client", "numpy", "torch", "grpc", "aiohttp")


def _heavy_modules_after(code: str) -> list[str]:
    probe = textwrap.dedent(code) + textwrap.dedent(f"""
        import sys
        print(",".join(m for m in {HEAVY!r} if m in sys.modules))
    """)
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [m for m in result.stdout.strip().split(",") if m]


def test_the_engine_facing_api_imports_no_sdk_no_metrics_library_no_numpy_no_torch():
    assert (
        _heavy_modules_after("""
        from tracer import NoopTracer, RecordingTracer, TraceContext, Tracer, start_tracing
        from tracer.records import RecordRing, StageRecord, StepRecord
        from tracer.sidecar.client import SidecarSink
        from tracer.spans import ATTR_PREFILL_TOKENS, SpanData
        from tracer.vocabulary import Pool, Stage
    """)
        == []
    )


def test_tracing_off_and_the_local_path_differ_only_in_what_they_load():
    assert (
        _heavy_modules_after("""
        from tracer import start_tracing
        start_tracing("colocated", "w0", enabled=False).tracer.stage("queue", None, 0, 1)
    """)
        == []
    )
    loaded = _heavy_modules_after("""
        from tracer import start_tracing
        start_tracing("colocated", "w0", processors=[]).shutdown(1.0)
    """)
    assert {"opentelemetry.sdk", "prometheus_client"} <= set(loaded)  # local export: SDK and metrics, on demand
    assert "torch" not in loaded  # host timing needs no torch


def test_both_tracers_satisfy_the_protocol_an_engine_types_against():
    from tracer import NoopTracer, RecordingTracer, Tracer
    from tracer.records import RecordRing
    from tracer.timing import HostClock

    assert isinstance(RecordingTracer(HostClock(), RecordRing(8)), Tracer)
    assert isinstance(NoopTracer(), Tracer)
    assert not isinstance(object(), Tracer)
