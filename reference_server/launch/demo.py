"""`splitscope demo`: the whole loop on this machine — serve, load, trace, report, compare.

1. Serve the `small` model colocated on two workers (`splitscope serve`, real processes) and drive a
   bursty workload at it with the load generator: a steady stream of short prompts whose decodes keep
   running, plus every few seconds a burst of long prompts (the interference the toolkit exists for).
2. Serve the same model as one prefill + one decode worker (the same two "GPUs") and drive the same
   workload (same seed, same arrivals).
3. Build the split-decision report of each run from its traces (Markdown, HTML, JSON).
4. Check the colocated run's advice: serve what its report recommends under the same workload (chunked
   prefill at its token budget; a 1:1 split is the run above, not served twice) and hold the measured SLO
   attainment against the report's own prediction for that layout at the observed rate
   (tracer/report/predict.py) and against the colocated run (advice_check.py). `--no-advice-check` skips
   the extra run.
5. Print a side-by-side table (TTFT and inter-token p50/p99, attainment, goodput), the verdict for the
   colocated deployment with the evidence behind it, and the advice check.

Everything lands under `runs/<timestamp>/`. Progress is shown throughout; about 4 minutes on 2 cores.
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

from reference_server.launch.advice_check import AdviceCheck, advised_layout, check_advice, serve_argv
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
from tracer.report.simulate import SLO, Layout
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


# The two layouts every demo serves on its two "GPUs" (worker processes), by run name.
DEMO_LAYOUTS: dict[str, Layout] = {
    Mode.COLOCATED: Layout(Mode.COLOCATED, workers=2),
    Mode.DISAGGREGATED: Layout(Mode.DISAGGREGATED, prefill_workers=1, decode_workers=1),
}
LAYOUTS = {name: serve_argv(layout) for name, layout in DEMO_LAYOUTS.items()}


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
    name: str, layout: Layout, run_dir: Path, preset: str, workload: DemoWorkload, slo: SLO, console: Console
) -> tuple[LoadResult, Report]:
    """Serve one layout, load it, stop it (traces flushed), and report on its traces."""
    layout_dir = run_dir / name
    layout_dir.mkdir(parents=True, exist_ok=True)
    traces = layout_dir / "traces.jsonl"
    argv = serve_argv(layout)
    console.rule(f"[bold]{name}[/]: {' '.join(argv)}")
    with console.status(f"starting {name} server ({preset} preset, worker processes load the model)..."):
        server = ServerProcess(
            ["--preset", preset, "--traces-file", str(traces), *argv], log_path=layout_dir / "server.log"
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


def comparison_table(results: dict[str, LoadResult], advised: str | None = None) -> Table:
    """The client's measurements per run, side by side; the run serving the colocated run's advice is marked."""
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
        table.add_column(column, justify="right" if column != "layout" else "left", no_wrap=column == "layout")
    for name, result in results.items():
        s = result.summary
        ttft, itl = s.latency["ttft_s"], s.latency["itl_s"]
        table.add_row(
            f"{name} (advised)" if name == advised and name != Mode.COLOCATED else name,
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


def serve_advice(
    results: dict[str, LoadResult],
    reports: dict[str, Report],
    run_dir: Path,
    preset: str,
    workload: DemoWorkload,
    slo: SLO,
    console: Console,
) -> AdviceCheck | str:
    """Serve what the colocated run's report recommends, unless a run already served it (a 1:1 split is the
    disaggregated run; staying is the colocated run itself), and check it. Adds a new run to `results` and
    `reports`. Returns the check, or why there is none."""
    colocated = reports[Mode.COLOCATED]
    layout = advised_layout(colocated)
    if layout is None:
        return f"no advice to check: the colocated run's report says {headline(colocated)}"
    run = next((name for name, served in DEMO_LAYOUTS.items() if served.label == layout.label), None)
    if run is None:
        run = layout.mode
        results[run], reports[run] = run_layout(run, layout, run_dir, preset, workload, slo, console)
    check = check_advice(colocated, run, results[run].summary, results[Mode.COLOCATED].summary, headline(colocated))
    return check if check is not None else "no advice to check: the colocated run's report fitted no model"


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
@click.option("--seed", type=int, default=7, show_default=True, help="workload seed (same arrivals for every layout)")
@click.option(
    "--advice-check/--no-advice-check",
    default=True,
    show_default=True,
    help="serve what the colocated run's report recommends and measure it against the report's prediction",
)
def demo_command(
    preset: str, out_dir: Path, duration_s: float, slo_ttft: float, slo_itl: float, seed: int, advice_check: bool
) -> None:
    """Serve colocated, then 1 prefill + 1 decode, under one bursty workload; trace, report, compare; then
    serve what the colocated run's report recommends and check its prediction."""
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
    for name, layout in DEMO_LAYOUTS.items():
        try:
            results[name], reports[name] = run_layout(name, layout, run_dir, preset, workload, slo, console)
        except (RuntimeError, OSError, ValueError) as exc:
            raise click.ClickException(f"{name} run failed: {exc}") from None
    check: AdviceCheck | str = "advice check skipped (--no-advice-check)"
    if advice_check:
        try:
            check = serve_advice(results, reports, run_dir, preset, workload, slo, console)
        except (RuntimeError, OSError, ValueError) as exc:
            raise click.ClickException(f"advised run failed: {exc}") from None

    console.rule("[bold]result[/]")
    console.print(comparison_table(results, check.run if isinstance(check, AdviceCheck) else None))
    if isinstance(check, AdviceCheck):
        console.print(f"[bold]{check.line()}[/]", highlight=False)
        console.print(check.against_baseline(), highlight=False)
    else:
        console.print(check, highlight=False)
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
        # The colocated run's advice, served and measured (advice_check.py); else why there is none.
        "advice_check": check.to_json() if isinstance(check, AdviceCheck) else {"layout": None, "reason": check},
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    console.print(f"\neverything is under {run_dir} ({time.monotonic() - started:.0f} s)")
