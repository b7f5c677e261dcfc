"""Terminal output of `splitscope load`: a live progress view and the final summary tables (rich).

`LiveView` is read by rich's refresh thread while the event loop updates `RunProgress`; it only reads.
"""

from __future__ import annotations

import statistics

from rich.console import Group, RenderableType
from rich.progress_bar import ProgressBar
from rich.table import Table

from tracer.load.runner import RunProgress
from tracer.load.stats import Distribution, Summary

_LATENCY_ROWS = (
    ("time to first token", "ttft_s"),
    ("time per output token", "tpot_s"),
    ("inter-token gap (all gaps)", "itl_s"),
    ("inter-token p99 per request", "itl_p99_s"),
    ("end to end", "e2e_s"),
)


def _ms(value_s: float | None) -> str:
    return "-" if value_s is None else f"{value_s * 1e3:.1f}"


class LiveView:
    """A rich renderable showing a run's progress; pass it to `rich.live.Live`."""

    def __init__(self, progress: RunProgress) -> None:
        self._progress = progress

    def __rich__(self) -> RenderableType:
        p = self._progress
        recent = list(p.recent_ttft_s)
        ttft = f"{statistics.median(recent) * 1e3:.1f} ms" if recent else "-"
        grid = Table.grid(padding=(0, 2))
        grid.add_row(
            f"[bold]{p.elapsed_s:7.1f} s[/] of ~{p.last_arrival_s:.1f} s of arrivals",
            ProgressBar(total=max(p.scheduled, 1), completed=p.finished + p.skipped, width=40),
            f"{p.finished + p.skipped}/{p.scheduled} done",
        )
        grid.add_row(
            f"sent {p.sent}  in flight {p.inflight}",
            f"[green]ok {p.ok}[/]  [red]errors {p.errors}[/]  skipped (cap) {p.skipped}",
            f"TTFT p50 (recent) {ttft}  max lag {p.max_lag_s * 1e3:.1f} ms",
        )
        return grid


def summary_tables(summary: Summary) -> RenderableType:
    """The final report: counts, latency percentiles (ms), SLO attainment and goodput, schedule lag."""
    counts = Table(title="requests", show_header=False, box=None, padding=(0, 2))
    counts.add_row("scheduled", str(summary.scheduled), "sent", str(summary.sent))
    counts.add_row("ok", str(summary.ok), "errors", str(summary.errors))
    counts.add_row("skipped (--max-inflight)", str(summary.skipped_inflight_cap), "wall", f"{summary.wall_s:.2f} s")
    if summary.cancelled:
        counts.add_row("cancelled (run stopped)", str(summary.cancelled))
    errors = ", ".join(f"{kind} {n}" for kind, n in summary.errors_by_kind.items() if n)
    if errors:
        counts.add_row("errors by kind", errors)

    latency = Table(title="latency of successful requests (ms)")
    latency.add_column("metric")
    for column in ("n", "p50", "p90", "p99", "mean", "max"):
        latency.add_column(column, justify="right")
    for label, key in _LATENCY_ROWS:
        latency.add_row(label, *_distribution_cells(summary.latency[key]))
    latency.add_row("schedule lag (send - arrival)", *_distribution_cells(summary.schedule_lag))

    outcome = Table(title="objectives", show_header=False, box=None, padding=(0, 2))
    slo_text = (
        ", ".join(
            f"{name.removesuffix('_s')} <= {_ms(limit)} ms" for name, limit in summary.slo.items() if limit is not None
        )
        or "none given (every successful request counts)"
    )
    outcome.add_row("SLO", slo_text)
    attainment = "-" if summary.attainment is None else f"{summary.attainment:.1%}"
    judged = f"{summary.scheduled} scheduled" + (f" less {summary.cancelled} cancelled" if summary.cancelled else "")
    outcome.add_row("attainment", f"{attainment} ({summary.slo_met}/{judged})")
    outcome.add_row("goodput", _rate(summary.goodput_rps, "req/s meeting the SLO"))
    outcome.add_row(
        "throughput",
        _rate(summary.achieved_rate_rps, "req/s ok") + ", " + _rate(summary.output_tokens_per_s, "output tok/s"),
    )
    lag = summary.schedule_lag
    if lag.max is not None:
        outcome.add_row("behind schedule", f"max {_ms(lag.max)} ms, mean {_ms(lag.mean)} ms")
    return Group(counts, latency, outcome)


def _distribution_cells(d: Distribution) -> list[str]:
    return [str(d.count), _ms(d.p50), _ms(d.p90), _ms(d.p99), _ms(d.mean), _ms(d.max)]


def _rate(value: float | None, unit: str) -> str:
    return "-" if value is None else f"{value:.2f} {unit}"
