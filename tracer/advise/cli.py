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
    "sim_requests",
    "skip_bad",
)
DEFAULT_HOLD = 3


@click.command("advise")
@click.argument("traces", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
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
@click.option("--format", "fmt", type=click.Choice(["md", "json"]), default="md", show_default=True)
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True), help="Write here instead of stdout.")
def advise_command(traces, window_s, hold_windows, confidence_resamples, fmt, output, **report) -> None:  # type: ignore[no-untyped-def]
    """Decide each WINDOW of TRACES as `splitscope report` would, and hold the advice until a different
    one wins --hold windows in a row.

    A window with too few requests is decided on itself merged with the windows before it (reason
    carried_fits). TRACES are read once, in the formats `report` reads."""
    from tracer.advise.build import advise_files
    from tracer.advise.render import headline, render
    from tracer.report.build import DEFAULT_MAX_BATCH, ReportOptions
    from tracer.report.simulate import SLO
    from tracer.report.tables import TraceDataError
    from tracer.traces import TraceFileError

    try:
        options = ReportOptions(
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
        )
        result = advise_files(list(traces), options, window_s, hold_windows)
    except (TraceFileError, TraceDataError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    text = render(result, fmt)
    if output:
        Path(output).write_text(text, encoding="utf-8")
        click.echo(f"{headline(result)} (written to {output})", err=True)
    else:
        click.echo(text, nl=False)


_shared = [p for p in report_command.params if p.name in REPORT_OPTIONS]
if len(_shared) != len(REPORT_OPTIONS):  # a renamed report option must not vanish from advise silently
    raise ImportError("tracer.report.cli no longer defines every option advise shares")
advise_command.params[1:1] = _shared  # after TRACES, before advise's own options
