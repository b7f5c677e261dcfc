"""`splitscope demo`: the whole loop on this machine — serve, load, trace, report, compare.

1. Serve the `small` model colocated on two workers (`splitscope serve`, real processes) and drive a
   bursty workload at it with the load generator: a steady stream of short prompts whose decodes keep
   running, plus every few seconds a burst of long prompts (the interference the toolkit exists for).
2. Serve the same model as one prefill + one decode worker (the same two "GPUs") and drive the same
   workload (same seed, same arrivals).
3. Build the split-decision report of each run from its traces (Markdown, HTML, JSON) and print a
   side-by-side table (TTFT and inter-token p50/p99, goodput) and the verdict for the colocated
   deployment, with the evidence behind it.

Everything lands under `runs/<timestamp>/`. Progress is shown throughout; about 3 minutes on 2 cores.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import click
from rich.console import Console
from rich.live import Live
from rich.table import Table

from reference_server.launch.process import ServerProcess
from reference_server.launch.serve import ServeConfig
from tracer.load import (
    BurstSpec,
    ClientSLO,
    LengthSpec,
    LoadConfig,
    LoadResult,
    RunProgress,
    run_load_sync,
)
from tracer.load.display import LiveView
from tracer.report.build import Report, ReportOptions, build_report
from tracer.report.render import headline, render
from tracer.report.simulate import SLO
from tracer.vocabulary import Mode


@dataclass(frozen=True)
class DemoWorkload:
    """The demo's traffic: short chats that keep decodes running, and bursts of long prompts."""

    rate_rps: float = 2.0
    duration_s: float = 30.0
    prompt_tokens: int = 96
    output_tokens: int = 64
    burst_every_s: float = 5.0
    burst_count: int = 2
    burst_prompt_tokens: int = 1536
    seed: int = 7


LAYOUTS: dict[str, list[str]] = {
    Mode.COLOCATED: ["--mode", Mode.COLOCATED, "--workers", "2"],
    Mode.DISAGGREGATED: ["--mode", Mode.DISAGGREGATED, "--prefill-workers", "1", "--decode-workers", "1"],
}


def _load_config(url: str, model: str, workload: DemoWorkload, slo: SLO) -> LoadConfig:
    return LoadConfig(
        url=url,
        model=model,
        rate_rps=workload.rate_rps,
        duration_s=workload.duration_s,
        prompt=LengthSpec(workload.prompt_tokens),
        output=LengthSpec(workload.output_tokens),
        burst=BurstSpec(workload.burst_every_s, workload.burst_count, workload.burst_prompt_tokens),
        slo=ClientSLO(ttft_s=slo.ttft_s, itl_s=slo.itl_s),
        seed=workload.seed,
        timeout_s=120.0,
    )


def run_layout(
    name: str, run_dir: Path, preset: str, workload: DemoWorkload, slo: SLO, console: Console
) -> tuple[LoadResult, Report]:
    """Serve one layout, load it, stop it (traces flushed), and report on its traces."""
    layout_dir = run_dir / name
    layout_dir.mkdir(parents=True, exist_ok=True)
    traces = layout_dir / "traces.jsonl"
    console.rule(f"[bold]{name}[/]: {' '.join(LAYOUTS[name])}")
    with console.status(f"starting {name} server ({preset} preset, worker processes load the model)..."):
        server = ServerProcess(
            ["--preset", preset, "--traces-file", str(traces), *LAYOUTS[name]], log_path=layout_dir / "server.log"
        ).start()
    try:
        console.print(
            f"serving on {server.url}; load: {workload.rate_rps:g} req/s x {workload.duration_s:g} s, "
            f"{workload.burst_count} x {workload.burst_prompt_tokens}-token prompts every "
            f"{workload.burst_every_s:g} s"
        )
        progress = RunProgress()
        with Live(LiveView(progress), console=console, refresh_per_second=4, transient=True):
            result = run_load_sync(_load_config(server.url, preset, workload, slo), progress=progress)
        result.write_json(layout_dir / "load.json")
    finally:
        with console.status(f"stopping {name} server (flushing traces)..."):
            server.stop()
    with console.status(f"{name}: fitting costs and simulating layouts..."):
        options = ReportOptions(slo, kv_bytes_per_token=_kv_bytes_per_token(preset), max_batch=ServeConfig.max_batch)
        report = build_report([traces], options)
    for fmt, suffix in (("md", "md"), ("html", "html"), ("json", "json")):
        (layout_dir / f"report.{suffix}").write_text(render(report, fmt))
    console.print(
        f"{name}: {result.summary.ok} ok / {result.summary.errors} errors; report: {layout_dir / 'report.html'}"
    )
    return result, report


def _sized_to(preset: str, workload: DemoWorkload) -> DemoWorkload:
    """The workload with its long prompts cut to what the preset's context holds beside the output (the
    server refuses a longer request, and the bursts are the point of the demo)."""
    from reference_server.model import ModelArgs

    longest = ModelArgs.from_name(preset).max_seq_len - workload.output_tokens
    return replace(workload, burst_prompt_tokens=min(workload.burst_prompt_tokens, longest))


def _kv_bytes_per_token(preset: str) -> int:
    """The served model's KV size: the colocated run's traces hold no transfer to measure it from."""
    import torch

    from reference_server.kv_cache import kv_bytes_per_token
    from reference_server.model import ModelArgs

    return kv_bytes_per_token(ModelArgs.from_name(preset), torch.float32)


def _ms(value_s: float | None) -> str:
    return "-" if value_s is None else f"{value_s * 1e3:.0f}"


def comparison_table(results: dict[str, LoadResult]) -> Table:
    table = Table(title="measured by the client, same workload")
    for column in (
        "layout",
        "ok",
        "errors",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "ITL p50 ms",
        "ITL p99 ms",
        "SLO attainment",
        "goodput req/s",
    ):
        table.add_column(column, justify="right" if column != "layout" else "left")
    for name, result in results.items():
        s = result.summary
        ttft, itl = s.latency["ttft_s"], s.latency["itl_s"]
        table.add_row(
            name,
            str(s.ok),
            str(s.errors),
            _ms(ttft.p50),
            _ms(ttft.p99),
            _ms(itl.p50),
            _ms(itl.p99),
            "-" if s.attainment is None else f"{s.attainment:.0%}",
            "-" if s.goodput_rps is None else f"{s.goodput_rps:.2f}",
        )
    return table


@click.command("demo")
@click.option("--preset", default="small", show_default=True, help="model preset for both servers")
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("runs"),
    show_default=True,
    help="where the run folder is created",
)
@click.option(
    "--duration", "duration_s", type=float, default=30.0, show_default=True, help="seconds of load per layout"
)
@click.option("--slo-ttft", type=float, default=2.0, show_default=True, help="time-to-first-token objective (s)")
@click.option("--slo-itl", type=float, default=0.1, show_default=True, help="inter-token p99 objective per request (s)")
@click.option("--seed", type=int, default=7, show_default=True, help="workload seed (same arrivals for both layouts)")
def demo_command(preset: str, out_dir: Path, duration_s: float, slo_ttft: float, slo_itl: float, seed: int) -> None:
    """Serve colocated, then 1 prefill + 1 decode, under one bursty workload; trace, report, compare."""
    if duration_s <= 0:
        raise click.UsageError("--duration must be positive")
    # Piped or logged output gets a width the side-by-side table fits in (rich assumes 80 columns there).
    console = Console(width=None if sys.stdout.isatty() else 120)
    started = time.monotonic()
    run_dir = out_dir / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    slo = SLO(ttft_s=slo_ttft, itl_s=slo_itl)
    workload = _sized_to(preset, DemoWorkload(duration_s=duration_s, seed=seed))
    results: dict[str, LoadResult] = {}
    reports: dict[str, Report] = {}
    for name in LAYOUTS:
        try:
            results[name], reports[name] = run_layout(name, run_dir, preset, workload, slo, console)
        except (RuntimeError, OSError, ValueError) as exc:
            raise click.ClickException(f"{name} run failed: {exc}") from None

    console.rule("[bold]result[/]")
    console.print(comparison_table(results))
    colocated = reports[Mode.COLOCATED]
    console.print(f"\n[bold]verdict for the colocated deployment:[/] {headline(colocated)}")
    for line in colocated.evidence[:6]:
        console.print(f"  - {line}")
    console.print(f"[bold]verdict from the split run's traces:[/] {headline(reports[Mode.DISAGGREGATED])}")
    summary = {
        "run_dir": str(run_dir),
        "slo": {"ttft_s": slo_ttft, "itl_s": slo_itl},
        "layouts": {name: r.summary.to_json_dict() for name, r in results.items()},
        "verdicts": {name: json.loads(render(r, "json")) for name, r in reports.items()},
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    console.print(f"\neverything is under {run_dir} ({time.monotonic() - started:.0f} s)")
