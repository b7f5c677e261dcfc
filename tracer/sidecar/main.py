"""`splitscope sidecar`: run the sidecar in the foreground until SIGINT / SIGTERM."""

from __future__ import annotations

import logging
import os
import signal
import threading
from urllib.parse import urlsplit

import click

from tracer.vocabulary import Mode, Pool

ENGINES = ("vllm", "sglang", "dynamo")


def _scrape_target(value: str) -> tuple[str, str]:
    engine, sep, url = value.partition("=")
    if not sep or engine not in ENGINES or not url.startswith(("http://", "https://")):
        raise click.BadParameter(f"expected ENGINE=URL with ENGINE one of {', '.join(ENGINES)}, got {value!r}")
    return engine, url


def _exports_to_itself(host: str, ports: list[int]) -> str | None:
    """The OTLP endpoint from the environment when it points back at this sidecar (an export loop)."""
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not endpoint:
        return None
    parts = urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
    local = {host, "127.0.0.1", "localhost", "::1"}
    return endpoint if parts.hostname in local and parts.port in ports else None


@click.command("sidecar", context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address for OTLP and /metrics. Not loopback: needs $SPLITSCOPE_SIDECAR_TOKEN.",
)
@click.option(
    "--http-port", type=click.IntRange(0, 65535), default=4318, show_default=True, help="OTLP/HTTP (and /metrics) port."
)
@click.option("--grpc-port", type=click.IntRange(0, 65535), default=4317, show_default=True, help="OTLP/gRPC port.")
@click.option("--no-http", is_flag=True, help="Do not listen for OTLP/HTTP.")
@click.option("--no-grpc", is_flag=True, help="Do not listen for OTLP/gRPC.")
@click.option(
    "--socket",
    "unix_socket",
    type=click.Path(dir_okay=False),
    help="Unix socket for workers' compact records (start_tracing(sidecar_socket=...)).",
)
@click.option("--traces-file", type=click.Path(dir_okay=False), help="Append OTLP/JSON lines here.")
@click.option("--metrics-port", type=click.IntRange(0, 65535), help="Also serve /metrics on this port.")
@click.option(
    "--pool",
    type=click.Choice([pool.value for pool in Pool]),
    default=Pool.COLOCATED.value,
    show_default=True,
    help="The engine's role, for adapted spans and scraped metrics.",
)
@click.option("--worker", default="engine", show_default=True, help="The engine instance's name (splitscope.worker).")
@click.option(
    "--mode",
    type=click.Choice([mode.value for mode in Mode]),
    default=Mode.COLOCATED.value,
    show_default=True,
    help="Deployment mode label for request metrics.",
)
@click.option(
    "--model",
    default="",
    help="The served model's name, for request metrics when the engine's spans name none "
    "(vLLM 0.32) and no --scrape of it gives one.",
)
@click.option(
    "--scrape",
    "scrape",
    multiple=True,
    metavar="ENGINE=URL",
    help="Map an engine's /metrics into ours, e.g. vllm=http://127.0.0.1:8000/metrics (repeatable).",
)
@click.option(
    "--scrape-timeout",
    type=click.FloatRange(0.1, 60),
    default=2.0,
    show_default=True,
    help="Seconds per engine scrape.",
)
@click.option(
    "--max-queued-spans", type=click.IntRange(1), default=262_144, show_default=True, help="Ingest queue bound."
)
@click.option(
    "--max-body-bytes",
    type=click.IntRange(1024),
    default=4 * 1024 * 1024,
    show_default=True,
    help="Largest OTLP request, after decompression.",
)
@click.option(
    "--overlap-hold",
    type=click.FloatRange(0.001, 3600),
    default=30.0,
    show_default=True,
    help="Seconds of the engine's timeline a finished decode waits for the prefills that overlapped it "
    "(request-level interference; its span leaves then, with stall links to them); later ones are counted "
    "as late.",
)
@click.option("--no-gpu", is_flag=True, help="Do not sample GPUs through NVML.")
@click.option(
    "--sample-rate",
    type=click.FloatRange(0.0, 1.0),
    default=None,
    help="Tail sampling: export this share of whole traces (by trace id); step spans pass (sampled at the source).",
)
@click.option(
    "--keep-violations",
    is_flag=True,
    help="Tail sampling: export every trace whose root has splitscope.slo.violated or any error, whole.",
)
@click.option(
    "--decision-timeout",
    type=click.FloatRange(0.1, 600),
    default=30.0,
    show_default=True,
    help="Seconds a trace waits for its root span before it is decided without it.",
)
@click.option(
    "--max-buffered-spans",
    type=click.IntRange(1),
    default=200_000,
    show_default=True,
    help="Spans waiting for their trace's decision; past it the oldest trace is decided at once.",
)
def sidecar_command(
    host,
    http_port,
    grpc_port,
    no_http,
    no_grpc,
    unix_socket,
    traces_file,
    metrics_port,
    pool,
    worker,
    mode,
    model,
    scrape,
    scrape_timeout,
    max_queued_spans,
    max_body_bytes,
    overlap_hold,
    no_gpu,
    sample_rate,
    keep_violations,
    decision_timeout,
    max_buffered_spans,
) -> None:
    """Receive telemetry beside a serving engine (OTLP, vLLM spans, our workers' records) and emit splitscope's."""
    from tracer.sidecar.server import Sidecar, SidecarConfig, tune_gc_for_ingest

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    targets = [_scrape_target(value) for value in scrape]
    ports = [p for p, off in ((http_port, no_http), (grpc_port, no_grpc)) if not off and p]
    loop_endpoint = _exports_to_itself(host, ports)
    if loop_endpoint:
        raise click.ClickException(
            f"OTEL_EXPORTER_OTLP_ENDPOINT={loop_endpoint} points at this sidecar (an export loop)"
        )
    config = SidecarConfig(
        host=host,
        http_port=None if no_http else http_port,
        grpc_port=None if no_grpc else grpc_port,
        unix_socket=unix_socket,
        traces_file=traces_file,
        metrics_port=metrics_port,
        pool=pool,
        worker=worker,
        mode=mode,
        model=model,
        scrape=targets,
        scrape_timeout_s=scrape_timeout,
        max_queued_spans=max_queued_spans,
        max_body_bytes=max_body_bytes,
        gpu=not no_gpu,
        overlap_hold_s=overlap_hold,
        sample_rate=sample_rate,
        keep_violations=keep_violations,
        decision_timeout_s=decision_timeout,
        max_buffered_spans=max_buffered_spans,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        sidecar = Sidecar(config).start()
    except (OSError, RuntimeError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    tune_gc_for_ingest()  # only once it runs: a sidecar that failed to start leaves the process as it was
    listening = [
        f"otlp/http {host}:{sidecar.http_port}" if sidecar.http_port else "",
        f"otlp/grpc {host}:{sidecar.grpc_port}" if sidecar.grpc_port else "",
        f"unix {unix_socket}" if unix_socket else "",
        f"metrics {host}:{sidecar.metrics_port}" if sidecar.metrics_port else "",
    ]
    click.echo("splitscope sidecar listening: " + ", ".join(x for x in listening if x), err=True)
    try:
        stop.wait()
    finally:
        click.echo("splitscope sidecar: stopping, flushing exports", err=True)
        sidecar.stop()
