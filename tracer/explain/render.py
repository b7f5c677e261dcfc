"""The explanation (`tracer.explain.build`) as text: Markdown (a table per request) or JSON."""

from __future__ import annotations

import json
from typing import Any

from tracer.explain.ttft import PARTS


def render(result: dict[str, Any], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(result, indent=2) + "\n"
    return markdown(result)


def _seconds(value: float | None) -> str:
    if value is None:
        return "n/a"
    text = f"{value:.4f}"
    return text.lstrip("-") if float(text) == 0 else text  # a rounding residue is no negative time


def _cause(cause: dict[str, Any]) -> str:
    kind, trace_id, tokens = cause["kind"], cause["trace_id"], cause["prefill_tokens"]
    text = kind
    if trace_id is not None:
        text = f"{kind} of `{trace_id}`" if kind != "preemption" else f"{kind} (its own decode)"
    if tokens is not None:
        text += f" ({tokens} tokens)"
    return f"{text} {cause['share']:.0%}"


def _ttft_table(request: dict[str, Any]) -> list[str]:
    ttft = request["ttft_s"]
    lines = ["| TTFT part | seconds | share of TTFT |", "|---|---:|---:|"]
    for part in PARTS:
        value = request["ttft_parts_s"][part]
        share = f"{max(0.0, value / ttft):.0%}" if value is not None and ttft else "n/a"
        lines.append(f"| {part} | {_seconds(value)} | {share} |")
    return lines


def _stall_table(request: dict[str, Any], arrival_ns: int | None) -> list[str]:
    lines = ["| stall | start (s after arrival) | duration (ms) | causes |", "|---:|---:|---:|---|"]
    for n, stall in enumerate(request["stalls"], 1):
        offset_s = (stall["start_unix_ns"] - arrival_ns) / 1e9 if arrival_ns is not None else 0.0
        causes = "; ".join(_cause(c) for c in stall["causes"]) or "none found"
        mark = " (estimated)" if stall["estimated"] else ""
        lines.append(f"| {n} | {offset_s:.3f} | {stall['duration_s'] * 1e3:.1f}{mark} | {causes} |")
    return lines


def _request(request: dict[str, Any]) -> list[str]:
    name = request["request_id"] or request["trace_id"]
    lines = [f"## Request {name} (trace `{request['trace_id']}`)", ""]
    lines.append(
        f"Time to first token {_seconds(request['ttft_s'])} s; inter-token p99 {_seconds(request['itl_p99_s'])} s; "
        f"{len(request['stalls'])} decode stall(s)."
    )
    lines += ["", *_ttft_table(request), ""]
    behind = request["queued_behind"]
    if behind:
        ahead = ", ".join(f"`{b['trace_id']}` ({b['state']}, {b['prefill_tokens']} tokens)" for b in behind)
        lines += [f"Queued behind: {ahead}.", ""]
    stalls = request["stalls"]
    if stalls:
        lines += [*_stall_table(request, request["arrival_unix_ns"]), ""]
        estimated = {s["basis"] for s in stalls if s["estimated"]}
        for basis in sorted(estimated):
            lines += [f"Estimated stalls rest on: {basis}.", ""]
    links = request["stall_links"]
    if links:
        linked = ", ".join(f"`{link['trace_id']}` {link['stalled_s'] * 1e3:.1f} ms" for link in links[:5])
        more = f" and {len(links) - 5} more" if len(links) > 5 else ""
        if any(link["estimated"] for link in links):
            source = "the sidecar (estimated: prefills overlapping its decode on the same worker)"
        else:
            source = "the worker (prefills in its stalled steps)"
        lines += [f"Stall links from {source}: {linked}{more}.", ""]
    return lines


def markdown(result: dict[str, Any]) -> str:
    summary = result["summary"]
    rule = summary["stall_rule"]
    lines = [
        "# Why were these requests slow?",
        "",
        f"{summary['requests_explained']} of {summary['requests_read']} requests explained "
        f"(worst by {summary['by']} unless named); {summary['stalls']} decode stall(s): gaps over "
        f"{rule['factor_of_median_gap']:g}x the request's median gap and over {rule['floor_s'] * 1e3:g} ms.",
        "",
    ]
    if summary["stall_s_by_kind"]:
        kinds = ", ".join(f"{kind} {seconds:.3f} s" for kind, seconds in summary["stall_s_by_kind"].items())
        lines += [f"Stall time by cause: {kinds}.", ""]
    if summary["top_causes"]:
        lines += [
            "| request that caused stalls | kind | prompt tokens | stalls | stall time (s) |",
            "|---|---|---:|---:|---:|",
        ]
        for top in summary["top_causes"]:
            tokens = "" if top["prefill_tokens"] is None else top["prefill_tokens"]
            lines.append(f"| `{top['trace_id']}` | {top['kind']} | {tokens} | {top['stalls']} | {top['stall_s']:.3f} |")
        lines.append("")
    for request in result["requests"]:
        lines += _request(request)
    return "\n".join(lines).rstrip() + "\n"
