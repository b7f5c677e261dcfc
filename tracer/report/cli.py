"""`splitscope report`: traces (and optionally Prometheus) -> split decision, as Markdown, HTML or JSON."""

from __future__ import annotations

from pathlib import Path

import click

from tracer.cli.options import Duration


@click.command("report")
@click.argument("traces", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--slo-ttft", type=click.FloatRange(min=0, min_open=True), required=True, help="Time-to-first-token SLO, seconds."
)
@click.option(
    "--slo-itl", type=click.FloatRange(min=0, min_open=True), required=True, help="Inter-token latency SLO, seconds."
)
@click.option(
    "--itl-stat",
    type=click.Choice(["p99", "max", "mean"]),
    default="p99",
    show_default=True,
    help="Per-request gap statistic the ITL SLO applies to.",
)
@click.option(
    "--attainment",
    type=click.FloatRange(0, 1, min_open=True),
    default=0.9,
    show_default=True,
    help="Fraction of requests that must meet both SLOs.",
)
@click.option("--gpus", type=click.IntRange(min=1), help="GPUs to lay out (default: the workers seen).")
@click.option(
    "--link-gbps",
    type=click.FloatRange(min=0, min_open=True),
    help="Link per prefill worker, Gb/s (default: measured, else 100).",
)
@click.option(
    "--kv-bytes-per-token",
    type=click.FloatRange(min=0, min_open=True),
    help="KV cache bytes per token (default: measured, else Llama-3-8B bf16).",
)
@click.option(
    "--window", "window_s", type=Duration(), help="Hysteresis window (e.g. 5m): a change must hold in most windows."
)
@click.option(
    "--max-batch",
    type=click.IntRange(min=1),
    help="Requests one worker runs at once (vLLM --max-num-seqs, SGLang --max-running-requests); default 256.",
)
@click.option(
    "--margin",
    type=click.FloatRange(min=0),
    default=0.15,
    show_default=True,
    help="Goodput gain a layout change needs.",
)
@click.option(
    "--prometheus", "prometheus_url", help="Prometheus base URL for extra evidence (per-pool busy ratio, queues)."
)
@click.option(
    "--since", "since_s", type=Duration(), default="10m", show_default=True, help="Range for the Prometheus queries."
)
@click.option(
    "--metrics-file",
    type=click.Path(exists=True, dir_okay=False),
    help="A capture of the engine's /metrics (Prometheus text): vLLM's inter-token and tokens-per-step histograms.",
)
@click.option("--skip-bad", is_flag=True, help="Skip and count bad lines/spans instead of failing.")
@click.option(
    "--sim-requests", type=click.IntRange(min=10), default=300, show_default=True, help="Requests per simulation."
)
@click.option(
    "--confidence-resamples",
    type=click.IntRange(min=0),
    default=20,
    show_default=True,
    help="Bootstrap re-runs behind the confidence figure (at least 20; 0 skips it).",
)
@click.option(
    "--router",
    type=click.Choice(["least-outstanding", "round-robin", "session"]),
    default="least-outstanding",
    show_default=True,
    help="How the simulated router places requests on a pool's workers (the reference router: least-outstanding).",
)
@click.option(
    "--step-model",
    type=click.Choice(["auto", "linear", "roofline"]),
    default="auto",
    show_default=True,
    help="How decode batches larger than the traces saw are priced: linear extrapolates the fitted slopes "
    "(compute-bound hardware, a CPU); roofline prices them as a GPU runs them (memory-bound until the knee, "
    "compute-bound past it); auto: roofline when the stage spans were timed by CUDA events, else linear "
    "(an engine's adapted spans are host-timed: say roofline for vLLM or SGLang on a GPU).",
)
@click.option(
    "--model-config",
    type=click.Path(exists=True, dir_okay=False),
    help="The served model's Hugging Face config.json. With the roofline step model the fit then prices "
    "decode attention by the KV read and a prompt's attention by its arithmetic, from the model's bytes and "
    "FLOPs (what small traced batches and whole prompts cannot show); the KV size of a transfer comes from it too.",
)
@click.option(
    "--why-missed/--no-why-missed",
    default=None,
    help="The section on why requests missed the SLO; it reads the trace files a second time, span by span."
    " Default: built when the traces total at most 100 MiB.",
)
@click.option("--format", "fmt", type=click.Choice(["md", "html", "json"]), default="md", show_default=True)
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True), help="Write here instead of stdout.")
def report_command(
    traces,
    slo_ttft,
    slo_itl,
    itl_stat,
    attainment,
    gpus,
    link_gbps,
    kv_bytes_per_token,
    window_s,
    max_batch,
    margin,
    prometheus_url,
    since_s,
    metrics_file,
    skip_bad,
    sim_requests,
    confidence_resamples,
    router,
    step_model,
    model_config,
    why_missed,
    fmt,
    output,
) -> None:  # type: ignore[no-untyped-def]
    """Read TRACES and decide: stay colocated, enable chunked prefill, split (P:D), rebalance or merge.

    TRACES are OTLP/JSON lines or the OpenTelemetry Collector file exporter's protobuf files (`format:
    proto`), recognised by content."""
    from tracer.otlp import TraceFileError
    from tracer.report.build import DEFAULT_MAX_BATCH, ReportOptions, build_report
    from tracer.report.prometheus import PrometheusError, pool_evidence
    from tracer.report.render import headline, render
    from tracer.report.simulate import SLO
    from tracer.report.tables import TraceDataError

    extra: tuple[str, ...] = ()
    try:
        if prometheus_url:
            extra = tuple(pool_evidence(prometheus_url, since_s))
        options = ReportOptions(
            slo=SLO(slo_ttft, slo_itl, itl_stat, attainment),
            gpus=gpus,
            link_gbps=link_gbps,
            kv_bytes_per_token=kv_bytes_per_token,
            window_s=window_s,
            max_batch=max_batch or DEFAULT_MAX_BATCH,
            margin=margin,
            skip_bad=skip_bad,
            sim_requests=sim_requests,
            extra_evidence=extra,
            metrics_file=metrics_file,
            confidence_resamples=confidence_resamples,
            router=router,
            step_model=step_model,
            model_config=model_config,
            why_missed=why_missed,
        )
        report = build_report(list(traces), options)
    except (TraceFileError, TraceDataError, PrometheusError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    text = render(report, fmt)
    if output:
        Path(output).write_text(text, encoding="utf-8")
        click.echo(f"{headline(report)} (report written to {output})", err=True)
    else:
        click.echo(text, nl=False)
