"""`splitscope explain`: per request, TTFT in parts and decode stalls with their causes, as Markdown or JSON."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("explain")
@click.argument("traces", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--trace-id",
    "trace_ids",
    multiple=True,
    help="Explain this request's trace (32 hex digits; repeatable). Default: the --worst N.",
)
@click.option(
    "--worst",
    type=click.IntRange(min=1),
    default=5,
    show_default=True,
    help="Without --trace-id: explain this many of the worst requests.",
)
@click.option(
    "--by",
    type=click.Choice(["ttft", "itl"]),
    default="itl",
    show_default=True,
    help="What makes a request worst: its time to first token, or its p99 inter-token gap.",
)
@click.option("--skip-bad", is_flag=True, help="Skip and count bad lines/spans instead of failing.")
@click.option("--format", "fmt", type=click.Choice(["md", "json"]), default="md", show_default=True)
@click.option("-o", "--out", type=click.Path(dir_okay=False, writable=True), help="Write here instead of stdout.")
def explain_command(trace_ids, worst, by, skip_bad, fmt, out, traces) -> None:  # type: ignore[no-untyped-def]
    """Why was a request slow? Read TRACES and, for each chosen request, split its time to first token
    into front-end, queue (and behind whom), prefill, KV transfer, decode-worker wait and unexplained,
    and list its decode stalls as time windows with the requests whose prefills filled them.

    TRACES are OTLP/JSON lines or the OpenTelemetry Collector file exporter's protobuf files."""
    from tracer.explain.build import explain
    from tracer.explain.read import load
    from tracer.explain.render import render
    from tracer.explain.select import SelectionError, choose
    from tracer.otlp import TraceFileError
    from tracer.report.tables import TraceDataError

    try:
        data = load(list(traces), skip_bad=skip_bad)
        result = explain(data, choose(data, trace_ids, worst, by), by)
    except (TraceFileError, TraceDataError, SelectionError) as exc:
        raise click.ClickException(str(exc)) from None
    text = render(result, fmt)
    if out:
        Path(out).write_text(text, encoding="utf-8")
        click.echo(f"{len(result['requests'])} request(s) explained (written to {out})", err=True)
    else:
        click.echo(text, nl=False)
