"""The explanation as data: the JSON contract of `splitscope explain` (docs/architecture.md section 8).

```
{"requests": [{"trace_id", "request_id", "arrival_unix_ns", "ttft_s", "ttft_parts_s": {part: s}, "queued_behind": [...],
               "itl_p99_s", "stalls": [{"start_unix_ns", "end_unix_ns", "duration_s", "causes": [
                   {"kind", "trace_id", "prefill_tokens", "share", "estimated"}], ...}],
               "stall_links": [{"trace_id", "span_id", "stalled_s", "prefill_tokens", "estimated"}]}],
 "summary": {...}}
```

NaN (a measure the traces lack) is written as null.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from tracer import spans as s
from tracer.explain.read import ExplainData, Trace
from tracer.explain.stalls import STALL_FACTOR, STALL_FLOOR_S, explain_stalls
from tracer.explain.ttft import PARTS, queued_behind, ttft_parts_s

TOP_CAUSES = 5


def _finite(value: float) -> float | None:
    return None if math.isnan(value) else value


def stall_links(trace: Trace) -> list[dict[str, Any]]:
    """The stall links its decode spans carry from the source, largest first: the linked prefill span and
    the stall time its tokens took. Measured where the worker's pipeline knew which prefills ran in each
    stalled step; `estimated` where the sidecar inferred them from request overlap (stock vLLM: the link
    says `splitscope.link.estimated`, its stalled time the overlap)."""
    out: list[dict[str, Any]] = []
    for decode in trace.stages.get(s.SPAN_DECODE, []):
        for link in decode.links:
            stalled_ns = link.attributes.get(s.ATTR_LINK_STALLED_NS)
            if not isinstance(stalled_ns, int):
                continue  # not a stall link
            tokens = link.attributes.get(s.ATTR_LINK_PREFILL_TOKENS)
            out.append(
                {
                    "trace_id": link.trace_id,
                    "span_id": link.span_id,
                    "stalled_s": stalled_ns / 1e9,
                    "prefill_tokens": tokens if isinstance(tokens, int) else None,
                    "estimated": link.attributes.get(s.ATTR_LINK_ESTIMATED) is True,
                }
            )
    out.sort(key=lambda link: -link["stalled_s"])
    return out


def explain_request(data: ExplainData, trace: Trace) -> dict[str, Any]:
    parts = ttft_parts_s(trace)
    return {
        "trace_id": trace.trace_id,
        "request_id": trace.request_id,
        "arrival_unix_ns": trace.root.start_ns if trace.root is not None else None,
        "ttft_s": _finite(trace.ttft_s),
        "ttft_parts_s": {part: _finite(value) for part, value in parts.items()},
        "queued_behind": queued_behind(data, trace),
        "itl_p99_s": _finite(trace.itl_p99_s),
        "stalls": explain_stalls(data, trace),
        "stall_links": stall_links(trace),
    }


def summarize(data: ExplainData, explained: Sequence[dict[str, Any]], by: str) -> dict[str, Any]:
    """Across the explained requests: stall time by cause kind, the requests whose prefills (or
    transfers) took the most of it, and the TTFT parts summed (seconds)."""
    by_kind: dict[str, float] = {}
    by_trace: dict[str, dict[str, Any]] = {}
    stalls = 0
    for request in explained:
        for stall in request["stalls"]:
            stalls += 1
            for cause in stall["causes"]:
                seconds = cause["share"] * stall["duration_s"]
                by_kind[cause["kind"]] = by_kind.get(cause["kind"], 0.0) + seconds
                if cause["trace_id"] is None or cause["trace_id"] == request["trace_id"]:
                    continue
                entry = by_trace.setdefault(
                    cause["trace_id"],
                    {"trace_id": cause["trace_id"], "kind": cause["kind"], "prefill_tokens": cause["prefill_tokens"]}
                    | {"stall_s": 0.0, "stalls": 0},
                )
                entry["stall_s"] += seconds
                entry["stalls"] += 1
    ttft_parts = {part: sum(r["ttft_parts_s"][part] or 0.0 for r in explained) for part in PARTS}
    return {
        "requests_read": len(data.requests()),
        "requests_explained": len(explained),
        "by": by,
        "stall_rule": {"factor_of_median_gap": STALL_FACTOR, "floor_s": STALL_FLOOR_S},
        "stalls": stalls,
        "stall_s_by_kind": by_kind,
        "top_causes": sorted(by_trace.values(), key=lambda e: -e["stall_s"])[:TOP_CAUSES],
        "ttft_parts_s_total": ttft_parts,
        "estimated": any(stall["estimated"] for r in explained for stall in r["stalls"]),
    }


def explain(data: ExplainData, chosen: Sequence[Trace], by: str) -> dict[str, Any]:
    explained = [explain_request(data, trace) for trace in chosen]
    return {"requests": explained, "summary": summarize(data, explained, by)}
