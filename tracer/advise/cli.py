"""`splitscope advise`: the split decision per time window of the traces, held against flapping."""

from __future__ import annotations

from pathlib import Path

import click

from tracer.cli.options import Duration
from tracer.report.cli import report_command

# The report's SLO and layout options, shared as they are (same names, types, defaults and help).
REPORT_OPTIONS = (
    "slo_ttft",
    "slo_itl",
    "itl_stat",
    "attainment",
    "gpus",
    "link_gbps",
    "kv_bytes_per_token",
    "max_batch",
    "margin",
    "router",
    "step_model",
    "model_config",
    "sim_requests",
    "skip_bad",
)
DEFAULT_HOLD = 3
DEFAULT_GRACE = "30s"
DEFAULT_POLL_INTERVAL = "1s"


@click.command("advise")
@click.argument("traces", nargs=-1, type=click.Path(dir_okay=False))
@click.option(
    "--window", "window_s", type=Duration(), required=True, help="Window length (e.g. 5m), by request start time."
)
@click.option(
    "--hold",
    "hold_windows",
    type=click.IntRange(min=1),
    default=DEFAULT_HOLD,
    show_default=True,
    help="Windows in a row a different advice must win before the held advice changes.",
)
@click.option(
    "--confidence-resamples",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Bootstrap re-runs per window (0 skips it, else at least 20). Off by default: 20 re-runs cost "
    "several seconds more per window, whose decision alone costs a few seconds of one core.",
)
@click.option(
    "--follow",
    is_flag=True,
    help="Tail TRACES as they grow (files may appear later, rotate or be truncated) and decide each window "
    "when spans past its end plus --grace have been read. Runs until SIGINT/SIGTERM.",
)
@click.option(
    "--grace",
    "grace_s",
    type=Duration(),
    default=DEFAULT_GRACE,
    show_default=True,
    help="With --follow: how far past a window's end the spans read must reach before it closes (requests "
    "still running, exporter batching).",
)
@click.option(
    "--poll-interval",
    "poll_interval_s",
    type=Duration(),
    default=DEFAULT_POLL_INTERVAL,
    show_default=True,
    help="With --follow: how often the files are read for new spans.",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(min=0, max=65535),
    help="Serve the held advice on /metrics (splitscope_advice_*). Without --follow: decide every window, "
    "then serve the last window's advice until SIGINT/SIGTERM. 0 picks a free port (printed on stderr).",
)
@click.option("--metrics-host", default="127.0.0.1", show_default=True, help="Address --metrics-port binds.")
@click.option(
    "--otlp-port",
    type=click.IntRange(min=0, max=65535),
    help="With --follow: also take OTLP/HTTP trace exports (POST /v1/traces, protobuf or JSON) on this port, "
    "as from an OpenTelemetry Collector's otlphttp exporter or an SDK; TRACES may then be none. 0 picks a "
    "free port (printed on stderr).",
)
@click.option("--otlp-host", default="127.0.0.1", show_default=True, help="Address --otlp-port binds.")
@click.option(
    "--namespace",
    help="The deployment advised on: the `namespace` label of the metrics (default: service.namespace of the "
    "traces' resource, else empty); with --follow, spans whose resource names another namespace are skipped.",
)
@click.option("--format", "fmt", type=click.Choice(["md", "json"]), default="md", show_default=True)
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True), help="Write here instead of stdout.")
def advise_command(  # type: ignore[no-untyped-def]
    traces,
    window_s,
    hold_windows,
    confidence_resamples,
    follow,
    grace_s,
    poll_interval_s,
    metrics_port,
    metrics_host,
    otlp_port,
    otlp_host,
    namespace,
    fmt,
    output,
    **report,
) -> None:
    """Decide each WINDOW of TRACES as `splitscope report` would, and hold the advice until a different
    one wins --hold windows in a row.

    A window with too few requests is decided on itself merged with the windows before it (reason
    carried_fits). TRACES are read once, in the formats `report` reads; with --follow they are tailed
    (and OTLP exports taken on --otlp-port) and each window is decided when it closes (one output line per
    window)."""
    from tracer.otlp import TraceFileError
    from tracer.report.tables import TraceDataError

    if otlp_port is not None and not follow:
        raise click.UsageError("--otlp-port takes spans as they come: it needs --follow")
    if not traces and otlp_port is None:
        raise click.UsageError("give TRACES (trace files) or, with --follow, --otlp-port")
    if not follow:
        missing = [path for path in traces if not Path(path).is_file()]
        if missing:
            raise click.BadParameter(f"Path {missing[0]!r} does not exist.", param_hint="'TRACES...'")
    try:
        options = _report_options(report, confidence_resamples)
        if follow or metrics_port is not None:
            _run_live(traces, options, window_s, hold_windows, follow, grace_s, poll_interval_s, metrics_port,
                      metrics_host, otlp_port, otlp_host, namespace, fmt, output)  # fmt: skip
            return
        from tracer.advise.build import advise_files
        from tracer.advise.render import headline, render

        result = advise_files(list(traces), options, window_s, hold_windows)
    except (TraceFileError, TraceDataError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    text = render(result, fmt)
    if output:
        Path(output).write_text(text, encoding="utf-8")
        click.echo(f"{headline(result)} (written to {output})", err=True)
    else:
        click.echo(text, nl=False)


def _report_options(report, confidence_resamples):  # type: ignore[no-untyped-def]
    from tracer.report.build import DEFAULT_MAX_BATCH, ReportOptions
    from tracer.report.simulate import SLO

    return ReportOptions(
        slo=SLO(report["slo_ttft"], report["slo_itl"], report["itl_stat"], report["attainment"]),
        gpus=report["gpus"],
        link_gbps=report["link_gbps"],
        kv_bytes_per_token=report["kv_bytes_per_token"],
        max_batch=report["max_batch"] or DEFAULT_MAX_BATCH,
        margin=report["margin"],
        skip_bad=report["skip_bad"],
        sim_requests=report["sim_requests"],
        confidence_resamples=confidence_resamples,
        router=report["router"],
        step_model=report["step_model"],
        model_config=report["model_config"],
    )


def _run_live(  # type: ignore[no-untyped-def]
    traces, options, window_s, hold_windows, follow, grace_s, poll_interval_s, metrics_port, metrics_host,
    otlp_port, otlp_host, namespace, fmt, output,
) -> None:  # fmt: skip
    """--follow and/or --metrics-port: runs until SIGINT/SIGTERM, writing to `output` or stdout."""
    import sys

    from tracer.advise import live
    from tracer.advise.follow import Follower
    from tracer.advise.otlp_in import OtlpInbox

    stop = live.stop_on_signals()
    out = open(output, "w", encoding="utf-8") if output else sys.stdout  # noqa: SIM115
    try:
        inbox = OtlpInbox(otlp_host, otlp_port) if otlp_port is not None else None
        follower = (
            Follower(list(traces), options, window_s, hold_windows, grace_s, namespace=namespace, inbox=inbox)
            if follow
            else None
        )
        exporter = live.start_exporter(metrics_host, metrics_port) if metrics_port is not None else None
        if follower is not None:
            live.follow(follower, fmt, out, exporter, poll_interval_s, stop)
        else:
            assert exporter is not None
            live.serve_offline(list(traces), options, window_s, hold_windows, fmt, out, exporter, namespace, stop)
    finally:
        if output:
            out.close()


_shared = [p for p in report_command.params if p.name in REPORT_OPTIONS]
if len(_shared) != len(REPORT_OPTIONS):  # a renamed report option must not vanish from advise silently
    raise ImportError("tracer.report.cli no longer defines every option advise shares")
advise_command.params[1:1] = _shared  # after TRACES, before advise's own options
