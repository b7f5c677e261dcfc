"""`render(report, fmt) -> str`: Markdown, a self-contained HTML page with plots, or JSON.

Plots are matplotlib figures inlined as base64 PNG `<img>` tags: the page needs no network and no files
beside it. Pure computation apart from matplotlib's (Agg, in-memory) rendering.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from typing import Any

import numpy as np

from tracer.report import prose
from tracer.report.build import Report

FORMATS = ("md", "html", "json")
_PLOT_POINTS = 5000  # steps drawn in the scatter (a sample keeps the page small)


def render(report: Report, fmt: str) -> str:
    if fmt == "md":
        return render_markdown(report)
    if fmt == "html":
        return render_html(report)
    if fmt == "json":
        return json.dumps(to_json(report), indent=2, allow_nan=False) + "\n"
    raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")


def headline(report: Report) -> str:
    """One line: the verdict and its parameter, e.g. `split 1:3` or `rebalance 3:1 -> 1:3` (prose.headline)."""
    return prose.headline(report.verdict, report.ratio, report.from_ratio, report.chunk_budget_tokens)


def _clean(value: Any) -> Any:
    """JSON-safe: NaN/inf -> None, numpy scalars -> Python."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return None if not math.isfinite(float(value)) else float(value)
    return value


def to_json(report: Report) -> dict[str, Any]:
    m = report.measured
    return _clean(
        {
            "verdict": report.verdict,
            "headline": headline(report),
            "ratio": report.ratio,
            "from_ratio": report.from_ratio,
            "chunk_budget_tokens": report.chunk_budget_tokens,
            "current_layout": report.current.label if report.current else None,
            "recommended_layout": report.recommended.label if report.recommended else None,
            "win_margin": report.win_margin,
            "confidence": report.confidence,
            "confidence_resamples": report.confidence_resamples,
            "unconfirmed_best_guess": report.unconfirmed,
            "margin": report.margin,
            "slo": {
                "ttft_s": report.slo.ttft_s,
                "itl_s": report.slo.itl_s,
                "itl_stat": report.slo.itl_stat,
                "attainment": report.slo.attainment,
            },
            "goodput": [
                {
                    "option": o.label,
                    "mode": o.mode,
                    "ratio": o.ratio,
                    "chunk_budget_tokens": o.chunk_budget_tokens,
                    "gpus": o.gpus,
                    "rate_per_s": o.rate_per_s,
                    "goodput_per_gpu": o.goodput_per_gpu,
                }
                for o in report.goodput
            ],
            "fits": report.fits,
            "measured": None
            if m is None
            else {
                "requests": m.requests,
                "failed": m.failed,
                "rate_per_s": m.rate_per_s,
                "attainment": m.attainment,
                "ttft_s": m.ttft_s,
                "itl_s": m.itl_s,
                "tpot_s": m.tpot_s,
                "stage_mean_s": m.stage_mean_s,
            },
            "network": report.network,
            "model_check": report.model_check,
            "self_check": report.self_check or None,
            "windows": [
                {
                    "start_s": w.start_s,
                    "end_s": w.end_s,
                    "requests": w.requests,
                    "verdict": w.decision.verdict,
                    "ratio": w.decision.ratio,
                    "chunk_budget_tokens": w.decision.chunk_budget_tokens,
                }
                for w in report.windows
            ],
            "evidence": report.evidence,
            "assumptions": report.assumptions,
            "read": report.read,
            "why_missed": report.why_missed,
        }
    )


def _fmt_s(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "n/a"
    return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"


def _sections(report: Report) -> list[tuple[str, list[str] | list[list[str]]]]:
    """Shared content of the Markdown and HTML renders: (title, bullet lines or table rows)."""
    out: list[tuple[str, Any]] = []
    s = report.slo
    if report.unconfirmed:
        out.append(
            (
                "Unconfirmed best guess",
                [f"{report.unconfirmed}: not a recommendation, the self-check failed (see Evidence)"],
            )
        )
    out.append(("Confidence", [_confidence_line(report)]))
    if report.self_check:
        out.append(("Self-check", [_self_check_line(report.self_check)]))
    out.append(
        (
            "SLO",
            [
                f"TTFT <= {_fmt_s(s.ttft_s)}, per-request ITL {s.itl_stat} <= {_fmt_s(s.itl_s)}, "
                f"for {s.attainment:.0%} of requests; a layout change needs a {report.margin:.0%} goodput margin"
            ],
        )
    )
    m = report.measured
    if m is not None:
        rows = [["metric", "p50", "p90", "p99"]]
        for name, q in (("TTFT", m.ttft_s), (f"ITL ({s.itl_stat} per request)", m.itl_s), ("TPOT", m.tpot_s)):
            rows.append([name] + [_fmt_s(q.get(k)) for k in ("p50", "p90", "p99")])
        out.append(
            (
                f"Measured ({m.requests} requests, {m.failed} failed, {m.rate_per_s:.3g} req/s, "
                f"SLO attainment {m.attainment:.1%})",
                rows,
            )
        )
    out += _why_missed_sections(report.why_missed)
    if report.goodput:
        rows = [["option", "GPUs", "max rate (req/s)", "goodput (req/s/GPU)"]]
        for o in sorted(report.goodput, key=lambda o: -o.goodput_per_gpu):
            rows.append([o.label, str(o.gpus), f"{o.rate_per_s:.3g}", f"{o.goodput_per_gpu:.3g}"])
        out.append(("Simulated goodput", rows))
    out.append(("Evidence", report.evidence))
    out.append(("Assumptions", report.assumptions))
    return out


WHY_MISSED_TITLE = "Why requests missed the SLO"


def _why_missed_sections(why: dict[str, Any] | None) -> list[tuple[str, Any]]:
    """The "Why requests missed the SLO" section: what it rests on, then the causes as a table."""
    if why is None:
        return []
    counted = (
        f"{why['missed']} of {why['requests']} requests missed the SLO "
        f"({why['missed_ttft']} TTFT, {why['missed_itl']} ITL)"
    )
    if why["sampled"]:
        counted += (
            f"; {why['examined']} of them examined, evenly spaced in arrival order (at most {why['max_examined']})"
        )
    lines = [counted] + list(why["rests_on"])
    if why["estimated"]:
        lines.append("some stall windows are ESTIMATED (no token times): their causes are estimates too")
    out: list[tuple[str, Any]] = [(WHY_MISSED_TITLE, lines)]
    if why["causes"]:
        rows = [["cause", "share of misses", "share of stall time", "stall time"]]
        for cause in why["causes"]:
            rows.append(
                [cause["label"], f"{cause['miss_share']:.0%}", f"{cause['stall_share']:.0%}", _fmt_s(cause["stall_s"])]
            )
        out.append((f"{WHY_MISSED_TITLE}: by cause", rows))
    return out


def _confidence_line(report: Report) -> str:
    if report.confidence is None:
        return "not computed (no verdict to resample, or --confidence-resamples 0)"
    return (
        f"{report.confidence:.0%} of {report.confidence_resamples} bootstrap re-runs (requests and step-fit residuals "
        "resampled) reach the same verdict"
    )


def _self_check_line(self_check: dict[str, Any]) -> str:
    """The self-check in one line: its outcome, how many misses and how many matter, the correction."""
    line = (
        f"{self_check['outcome']}: {len(self_check['misses'])} model-check misses, "
        f"{len(self_check['mattering'])} able to change the verdict"
    )
    correction = self_check.get("correction")
    if correction:
        line += f"; corrected TTFT x{correction['ttft_factor']:.3g}, ITL x{correction['itl_factor']:.3g}"
    if self_check.get("corrected_verdict"):
        line += f", corrected decision: {self_check['corrected_verdict']}"
    return line + " (see Evidence)"


def render_markdown(report: Report) -> str:
    lines = ["# splitscope split-decision report", "", f"**Verdict: {headline(report)}**", ""]
    for title, body in _sections(report):
        lines += [f"## {title}", ""]
        if body and isinstance(body[0], list):
            lines.append("| " + " | ".join(body[0]) + " |")
            lines.append("|" + "---|" * len(body[0]))
            lines += ["| " + " | ".join(row) + " |" for row in body[1:]]
        else:
            lines += [f"- {line}" for line in body]
        lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ HTML


def _png(fig) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _plots(report: Report) -> list[tuple[str, str]]:
    """(title, base64 PNG) for each plot the data supports."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    plots: list[tuple[str, str]] = []
    data = report.data
    if data is not None and len(data.requests):
        req = data.requests
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
        for ax, values, slo, title in (
            (axes[0], req.ttft_s, report.slo.ttft_s, "time to first token"),
            (
                axes[1],
                req.itl(report.slo.itl_stat),
                report.slo.itl_s,
                f"inter-token gap ({report.slo.itl_stat} per request)",
            ),
        ):
            values = np.sort(values[~np.isnan(values)])
            if len(values):
                ax.plot(values, np.arange(1, len(values) + 1) / len(values))
            ax.axvline(slo, color="red", linestyle="--", label="SLO")
            ax.set_xlabel("seconds")
            ax.set_ylabel("fraction of requests")
            ax.set_title(title)
            ax.legend()
        plots.append(("Latency CDFs", _png(fig)))
        plt.close(fig)
    if report.measured is not None and report.measured.stage_mean_s:
        fig, ax = plt.subplots(figsize=(6, 2.4))
        left = 0.0
        for stage, value in report.measured.stage_mean_s.items():
            ax.barh([0], [value], left=left, label=stage)
            left += value
        ax.set_yticks([])
        ax.set_xlabel("mean seconds per request")
        ax.legend(ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.35))
        ax.set_title("stage breakdown")
        plots.append(("Stage breakdown", _png(fig)))
        plt.close(fig)
    if data is not None and len(data.steps):
        steps = data.steps
        rng = np.random.default_rng(0)
        pick = rng.choice(len(steps), min(len(steps), _PLOT_POINTS), replace=False)
        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.scatter(steps.prefill_tokens[pick], steps.duration_s[pick] * 1e3, s=4, alpha=0.4, label="steps")
        if report.step_fit is not None:
            c = report.step_fit.costs
            x = np.linspace(0, max(1, steps.prefill_tokens.max()), 100)
            batch = float(np.median(steps.decode_requests))
            context = float(np.median(steps.context_tokens))
            ax.plot(
                x, [c.step_s(batch, context, v) * 1e3 for v in x], color="black", label="fit at median batch/context"
            )
        ax.set_xlabel("prefill tokens in step")
        ax.set_ylabel("step time (ms)")
        ax.set_title("step time against prefill tokens")
        ax.legend()
        plots.append(("Step time against prefill tokens", _png(fig)))
        plt.close(fig)
    why = report.why_missed
    if why is not None and why["causes"]:
        fig, ax = plt.subplots(figsize=(8, 2.6))
        cmap = plt.get_cmap("tab10")
        rows = [("share of misses", "miss_share"), ("share of stall time", "stall_share")]
        for i, cause in enumerate(why["causes"]):
            lefts = [sum(c[key] for c in why["causes"][:i]) for _, key in rows]
            widths = [cause[key] for _, key in rows]
            ax.barh(range(len(rows)), widths, left=lefts, color=cmap(i % 10), label=cause["label"])
            for y, (left, width) in enumerate(zip(lefts, widths)):
                if width >= 0.08:
                    ax.text(left + width / 2, y, f"{width:.0%}", ha="center", va="center", color="white")
        ax.set_yticks(range(len(rows)), [label for label, _ in rows])
        ax.invert_yaxis()
        ax.set_xlim(0, 1)
        ax.set_xlabel(f"share among the {why['examined']} requests examined that missed the SLO")
        # The causes' names are the answer: legend text at the axes' size, not smaller.
        ax.legend(ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.32))
        ax.set_title(WHY_MISSED_TITLE)
        plots.append((WHY_MISSED_TITLE, _png(fig)))
        plt.close(fig)
    if report.goodput:
        fig, ax = plt.subplots(figsize=(7, 3.2))
        options = report.goodput
        colors = [
            "tab:green" if report.recommended and o.label == report.recommended.label else "tab:blue" for o in options
        ]
        ax.bar(range(len(options)), [o.goodput_per_gpu for o in options], color=colors)
        ax.set_xticks(range(len(options)), [o.label for o in options], rotation=30, ha="right")
        ax.set_ylabel("goodput (req/s per GPU)")
        ax.set_title("goodput per option")
        plots.append(("Goodput per option", _png(fig)))
        plt.close(fig)
    return plots


_STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1000px; margin: 2em auto; color: #222; }
.verdict { font-size: 1.6em; padding: 0.5em 0.8em; background: #eef6ee; border-left: 6px solid #2a2; }
table { border-collapse: collapse; margin: 0.5em 0; } td, th { border: 1px solid #ccc; padding: 3px 8px; }
figure { margin: 1em 0; } img { max-width: 100%; }
"""


def render_html(report: Report) -> str:
    e = html.escape
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        "<title>splitscope report: " + e(headline(report)) + "</title>",
        f"<style>{_STYLE}</style></head><body>",
        "<h1>splitscope split-decision report</h1>",
        f'<p class="verdict" id="verdict" data-verdict="{e(report.verdict)}">Verdict: <strong>{e(headline(report))}</strong></p>',
    ]
    for title, body in _sections(report):
        parts.append(f"<h2>{e(title)}</h2>")
        if body and isinstance(body[0], list):
            parts.append("<table><tr>" + "".join(f"<th>{e(c)}</th>" for c in body[0]) + "</tr>")
            parts += ["<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in body[1:]]
            parts.append("</table>")
        else:
            parts.append("<ul>" + "".join(f"<li>{e(str(line))}</li>" for line in body) + "</ul>")
    parts.append("<h2>Plots</h2>")
    for title, png in _plots(report):
        parts.append(
            f'<figure><img class="plot" alt="{e(title)}" src="data:image/png;base64,{png}"><figcaption>{e(title)}</figcaption></figure>'
        )
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
