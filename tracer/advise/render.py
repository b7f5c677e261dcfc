"""`advise`'s output: the JSON contract (architecture.md §8) or Markdown (a table of windows, then the
held advice)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from tracer.advise.build import Advice, AdviseResult, WindowAdvice

WINDOW_FIELDS = (
    "start_unix_ns",
    "end_unix_ns",
    "requests",
    "verdict",
    "ratio",
    "chunk_budget_tokens",
    "gain",
    "confidence",
    "reason",
)
ADVICE_FIELDS = ("verdict", "ratio", "chunk_budget_tokens", "since_unix_ns", "reason")


def to_json(result: AdviseResult) -> dict[str, Any]:
    return {
        "windows": [{name: getattr(w, name) for name in WINDOW_FIELDS} for w in result.windows],
        "advice": {name: getattr(result.advice, name) for name in ADVICE_FIELDS},
    }


def render(result: AdviseResult, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(to_json(result), indent=2) + "\n"
    if fmt == "md":
        return _markdown(result)
    raise ValueError(f"unknown format {fmt!r} (md or json)")


def headline(result: AdviseResult) -> str:
    advice = result.advice
    return f"advice: {_label(advice)} ({advice.reason}, {len(result.windows)} windows)"


def _time(ns: int | None) -> str:
    if ns is None:
        return "-"
    return datetime.fromtimestamp(ns / 1e9, tz=UTC).strftime("%Y-%m-%d %H:%M:%S")


def _label(item: Advice | WindowAdvice) -> str:
    if item.ratio:
        return f"{item.verdict} {item.ratio}"
    if item.chunk_budget_tokens:
        return f"{item.verdict} (budget {item.chunk_budget_tokens} tokens)"
    return item.verdict


def _number(value: float | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def _markdown(result: AdviseResult) -> str:
    advice = result.advice
    lines = [
        "# splitscope advise",
        "",
        f"**Held advice: {_label(advice)}** ({advice.reason}; since {_time(advice.since_unix_ns)} UTC). "
        f"Windows of {result.window_s:g} s; the advice changes when a different one wins {result.hold} "
        "windows in a row.",
        "",
        "| window start (UTC) | requests | verdict | gain | confidence | reason | held after |",
        "|---|---:|---|---:|---:|---|---|",
    ]
    for window, held in zip(result.windows, result.held_after, strict=True):
        reason = window.reason
        if window.decided_from_unix_ns < window.start_unix_ns:
            reason += f" (from {_time(window.decided_from_unix_ns)})"
        lines.append(
            f"| {_time(window.start_unix_ns)} | {window.requests} | {_label(window)} | {_number(window.gain, '{:+.0%}')} "
            f"| {_number(window.confidence, '{:.0%}')} | {reason} | {_label(held)} |"
        )
    notes = [f"- {_time(w.start_unix_ns)}: {'; '.join(w.evidence)}" for w in result.windows if w.evidence]
    if notes:
        lines += ["", "Windows without a verdict:", *notes]
    if not result.confidence_resamples:
        lines += ["", "Confidence skipped (--confidence-resamples 0)."]
    return "\n".join(lines) + "\n"


# `--follow`: one line per closed window, as it closes (Markdown table rows, or JSON lines).
FOLLOW_HEADER = (
    "| window start (UTC) | requests | verdict | gain | confidence | reason | held after | change |\n"
    "|---|---:|---|---:|---:|---|---|---|\n"
)


def window_line(window: WindowAdvice, held: Advice, reason: str, deployed: str, fmt: str) -> str:
    """One closed window: a Markdown row, or a JSON object {"window", "advice", "reason", "deployed"}."""
    if fmt == "json":
        document = {
            "window": {name: getattr(window, name) for name in WINDOW_FIELDS},
            "advice": {name: getattr(held, name) for name in ADVICE_FIELDS},
            "reason": reason,
            "deployed": deployed,
        }
        return json.dumps(document) + "\n"
    return (
        f"| {_time(window.start_unix_ns)} | {window.requests} | {_label(window)} | {_number(window.gain, '{:+.0%}')} "
        f"| {_number(window.confidence, '{:.0%}')} | {window.reason} | {_label(held)} | {reason} |\n"
    )
