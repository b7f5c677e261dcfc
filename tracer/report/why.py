"""The report's "Why requests missed the SLO": among the requests that missed it, the share of misses and
of decode stall time by cause (docs/architecture.md section 7, JSON `why_missed`).

It rests on `tracer.explain` (pure computation over trace files): each missing request's decode stalls
attributed to what ran in their windows on its worker (`explain.stalls`), and its TTFT in parts
(`explain.ttft`). Explain reads spans through the generic reader (it needs the decode spans' stall
events, which the report's column reader does not decode), so the section is built only when the report
reads trace files, only over the missing requests, and over at most `MAX_EXAMINED` of them (evenly
spaced in arrival order: deterministic); the section says when it sampled.

Causes (keys of `why_missed.causes`):

- `prefill_lt512`, `prefill_512_2k`, `prefill_2k_8k`, `prefill_gt8k`: another request's prefill (or
  chunk) on the same worker, by that request's uncached prompt tokens (< 512, 512-2047, 2048-8191,
  >= 8192): prefill interference, what a split or chunked prefill removes;
- `queueing`: a stall while no step ran on the worker, or a TTFT spent in the queue span;
- `kv_transfer`: another request's KV landing on the decode worker during a stall, or a TTFT spent in the
  exposed transfer and the decode worker's wait for it;
- `preemption`: the request's own decode interrupted;
- `own_prefill`: a TTFT spent in the request's own prefill;
- `frontend`: a TTFT spent before the first stage span (router, tokenisation, the hop);
- `batch_or_unexplained`: the rest: a stall with nothing else running (the request's own step, slow at
  the batch size and context it ran with), an ITL miss with no stall window, the TTFT no span covers.

Each missing request counts 1, split over causes in proportion to its time: an ITL miss by its stall
seconds, a TTFT miss by its TTFT parts, a request missing both half each. Blocking file I/O.
"""

from __future__ import annotations

import bisect
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tracer import spans as s
from tracer.explain.read import ExplainData, Trace, WorkerSpan, load
from tracer.explain.stalls import BASIS_OVERLAP, BASIS_STEPS, BASIS_TOKENS, explain_stalls
from tracer.explain.ttft import ttft_parts_s
from tracer.report.simulate import SLO

MAX_EXAMINED = 2000  # missing requests explained at most (evenly spaced in arrival order beyond it)
BUCKET_EDGES_TOKENS = (512, 2048, 8192)
PREFILL_CAUSES = ("prefill_lt512", "prefill_512_2k", "prefill_2k_8k", "prefill_gt8k")
CAUSES = PREFILL_CAUSES + (
    "queueing",
    "kv_transfer",
    "preemption",
    "own_prefill",
    "frontend",
    "batch_or_unexplained",
)
LABELS = {
    "prefill_lt512": "prefill interference, prompts < 512 tokens",
    "prefill_512_2k": "prefill interference, prompts 512-2k tokens",
    "prefill_2k_8k": "prefill interference, prompts 2k-8k tokens",
    "prefill_gt8k": "prefill interference, prompts > 8k tokens",
    "queueing": "queueing",
    "kv_transfer": "KV transfer",
    "preemption": "preemption",
    "own_prefill": "own prefill (TTFT)",
    "frontend": "front end (TTFT)",
    "batch_or_unexplained": "batch size / unexplained",
}
_STALL_KIND = {"queueing": "queueing", "kv_transfer": "kv_transfer", "preemption": "preemption"}
_TTFT_PART = {
    "frontend": "frontend",
    "queue": "queueing",
    s.Stage.PREFILL: "own_prefill",
    "kv_transfer": "kv_transfer",
    "decode_wait": "kv_transfer",
    "unexplained": "batch_or_unexplained",
}
_BASES = (
    ("token times", BASIS_TOKENS, False),
    ("step spans", BASIS_STEPS.split(" of worker")[0], True),
    ("request overlap", BASIS_OVERLAP.split(" on worker")[0], True),
)


def prefill_cause(tokens: int | None) -> str:
    """The prompt-length bucket of another request's prefill, by its uncached prompt tokens."""
    return PREFILL_CAUSES[bisect.bisect_right(BUCKET_EDGES_TOKENS, int(tokens or 0))]


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def itl_of(trace: Trace, stat: str) -> float:
    """The request's inter-token statistic the SLO uses (router's figure, else its decode span's); NaN
    where none was traced."""
    if stat == "p99":
        return trace.itl_p99_s
    root_key, decode_key = {
        "max": (s.ATTR_ITL_MAX_S, s.ATTR_DECODE_ITL_MAX_S),
        "mean": (s.ATTR_ITL_MEAN_S, None),
    }[stat]
    value = _number(trace.root.attributes.get(root_key)) if trace.root is not None else math.nan
    decode = trace.first(s.SPAN_DECODE)
    if math.isnan(value) and decode is not None and decode_key is not None:
        value = _number(decode.attributes.get(decode_key))
    return value


@dataclass
class _Narrow:
    """Per worker, its step rows and stage spans sorted by start, to hand explain only what can touch one
    request's decode (the same answers, without sweeping every step of the trace per stall window)."""

    data: ExplainData
    steps: dict[str, tuple[np.ndarray, np.ndarray, int]]  # worker -> (row indices, starts, longest ns)
    spans: dict[str, dict[str, tuple[list[int], int]]]  # worker -> name -> (starts, longest ns)

    @classmethod
    def of(cls, data: ExplainData) -> _Narrow:
        steps: dict[str, tuple[np.ndarray, np.ndarray, int]] = {}
        table = data.steps
        if len(table):
            durations_ns = np.round(table.duration_s * 1e9).astype(np.int64)
            for worker in np.unique(table.worker):
                rows = np.flatnonzero(table.worker == worker)
                rows = rows[np.argsort(table.start_ns[rows], kind="stable")]
                steps[str(worker)] = (rows, table.start_ns[rows], int(durations_ns[rows].max()) + 1)
        spans = {
            worker: {
                name: ([e.start_ns for e in entries], max((e.end_ns - e.start_ns for e in entries), default=0) + 1)
                for name, entries in names.items()
            }
            for worker, names in data.by_worker.items()
        }
        return cls(data, steps, spans)

    def around(self, trace: Trace) -> ExplainData:
        decodes = trace.stages.get(s.SPAN_DECODE, [])
        lo = min((d.start_ns for d in decodes), default=0)
        hi = max((d.end_ns for d in decodes), default=0)
        for decode in decodes:
            for event in decode.events:
                lo = min(lo, event.time_ns - round(max(0.0, _number(event.attributes.get("gap_s")) or 0.0) * 1e9))
        workers = {w for d in decodes if isinstance(w := d.attributes.get(s.ATTR_WORKER), str) and w}
        rows: list[np.ndarray] = []
        by_worker: dict[str, dict[str, list[WorkerSpan]]] = {}
        for worker in workers:
            if worker in self.steps:
                index, starts, longest = self.steps[worker]
                rows.append(index[np.searchsorted(starts, lo - longest) : np.searchsorted(starts, hi, "right")])
            for name, (starts_list, longest) in self.spans.get(worker, {}).items():
                entries = self.data.by_worker[worker][name]
                a = bisect.bisect_left(starts_list, lo - longest)
                b = bisect.bisect_right(starts_list, hi)
                by_worker.setdefault(worker, {})[name] = entries[a:b]
        picked = np.sort(np.concatenate(rows)) if rows else np.zeros(0, dtype=np.intp)
        return ExplainData(self.data.traces, self.data.steps.select(picked), by_worker, self.data.read)


def _normalised(seconds: dict[str, float]) -> dict[str, float]:
    total = sum(v for v in seconds.values() if v > 0)
    return {k: v / total for k, v in seconds.items() if v > 0} if total > 0 else {}


def _stall_seconds(stalls: list[dict[str, Any]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for stall in stalls:
        taken = 0.0
        for cause in stall["causes"]:
            kind = cause["kind"]
            key = prefill_cause(cause["prefill_tokens"]) if kind == s.Stage.PREFILL else _STALL_KIND.get(kind)
            key = key or "batch_or_unexplained"
            out[key] = out.get(key, 0.0) + cause["share"] * stall["duration_s"]
            taken += cause["share"]
        # Causes under 1% of a window are left out by explain: the rest stays unexplained.
        rest = max(0.0, 1.0 - taken) * stall["duration_s"]
        out["batch_or_unexplained"] = out.get("batch_or_unexplained", 0.0) + rest
    return out


def why_missed(paths: Sequence[str | os.PathLike[str]], slo: SLO, *, skip_bad: bool = False) -> dict[str, Any]:
    """The `why_missed` object (module docstring; docs/architecture.md section 7) for the traces in
    `paths`. Raises what `tracer.explain.read.load` raises on bad input unless `skip_bad`."""
    return why_missed_from(load(paths, skip_bad=skip_bad), slo)


_Missing = tuple[Trace, bool, bool, "list[dict[str, Any]] | None"]  # trace, TTFT miss, ITL miss, its stalls


def _find_missing(data: ExplainData, slo: SLO, narrow: _Narrow) -> tuple[list[_Missing], int, int]:
    """The requests that missed the SLO, in arrival order; how many had no traced ITL; how many of those
    count as ITL misses on their estimated stall windows."""
    missing: list[_Missing] = []
    unknown_itl: list[Trace] = []
    for trace in data.requests():
        ttft_miss = trace.ttft_s > slo.ttft_s  # NaN (no TTFT traced) is not counted a miss
        itl = itl_of(trace, slo.itl_stat)
        if math.isnan(itl) and trace.stages.get(s.SPAN_DECODE):
            unknown_itl.append(trace)
        elif ttft_miss or itl > slo.itl_s:
            missing.append((trace, ttft_miss, itl > slo.itl_s, None))
    # No inter-token figure traced (engines' request spans): a request counts as an ITL miss when one of
    # its (estimated) stall windows is longer than the ITL objective; at most MAX_EXAMINED are looked at.
    estimated_itl_misses = 0
    for trace in _spaced(unknown_itl, MAX_EXAMINED):
        stalls = explain_stalls(narrow.around(trace), trace)
        itl_miss = any(stall["duration_s"] > slo.itl_s for stall in stalls)
        estimated_itl_misses += itl_miss
        if itl_miss or trace.ttft_s > slo.ttft_s:
            missing.append((trace, trace.ttft_s > slo.ttft_s, itl_miss, stalls))
    missing.sort(key=lambda m: m[0].root.start_ns if m[0].root is not None else 0)
    return missing, len(unknown_itl), estimated_itl_misses


@dataclass
class _Totals:
    """What the examined misses add up to."""

    misses: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0.0))
    stall_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0.0))
    bases: dict[str, int] = field(default_factory=lambda: dict.fromkeys((name for name, _, _ in _BASES), 0))
    windows: int = 0
    itl_without_stalls: int = 0
    ttft_without_stages: int = 0

    def itl(self, stalls: list[dict[str, Any]]) -> dict[str, float]:
        self.windows += len(stalls)
        for stall in stalls:
            for name, prefix, _ in _BASES:
                if stall["basis"].startswith(prefix):
                    self.bases[name] += 1
        seconds = _stall_seconds(stalls)
        for key, value in seconds.items():
            self.stall_s[key] += value
        shares = _normalised(seconds)
        if not shares:
            self.itl_without_stalls += 1
        return shares or {"batch_or_unexplained": 1.0}

    def ttft(self, trace: Trace) -> dict[str, float]:
        seconds: dict[str, float] = {}
        for part, value in ttft_parts_s(trace).items():
            if not math.isnan(value):
                seconds[_TTFT_PART[part]] = seconds.get(_TTFT_PART[part], 0.0) + value
        if not any(trace.stages.get(name) for name in (s.SPAN_QUEUE, s.SPAN_PREFILL)):
            self.ttft_without_stages += 1
        return _normalised(seconds) or {"batch_or_unexplained": 1.0}

    def causes(self, examined: int) -> list[dict[str, Any]]:
        """Every cause with a share, largest share of stall time first (then of misses)."""
        total_s = sum(self.stall_s.values())
        rows: list[dict[str, Any]] = [
            {
                "cause": key,
                "label": LABELS[key],
                "misses": self.misses[key],
                "miss_share": self.misses[key] / examined if examined else 0.0,
                "stall_s": self.stall_s[key],
                "stall_share": self.stall_s[key] / total_s if total_s > 0 else 0.0,
            }
            for key in CAUSES
            if self.misses[key] > 0 or self.stall_s[key] > 0
        ]
        rows.sort(key=lambda c: (-float(c["stall_share"]), -float(c["miss_share"])))
        return rows


def why_missed_from(data: ExplainData, slo: SLO) -> dict[str, Any]:
    """The `why_missed` object from traces already read by explain."""
    narrow = _Narrow.of(data)
    missing, itl_not_traced, estimated_itl_misses = _find_missing(data, slo, narrow)
    examined = _spaced(missing, MAX_EXAMINED)
    totals = _Totals()
    for trace, ttft_miss, itl_miss, known in examined:
        parts: list[dict[str, float]] = []
        if itl_miss:
            parts.append(totals.itl(known if known is not None else explain_stalls(narrow.around(trace), trace)))
        if ttft_miss:
            parts.append(totals.ttft(trace))
        for shares in parts:
            for key, value in shares.items():
                totals.misses[key] += value / len(parts)
    causes = totals.causes(len(examined))
    total_stall_s = sum(totals.stall_s.values())
    return {
        "requests": len(data.requests()),
        "missed": len(missing),
        "missed_ttft": sum(1 for m in missing if m[1]),
        "missed_itl": sum(1 for m in missing if m[2]),
        "itl_not_traced": itl_not_traced,
        "itl_misses_estimated": estimated_itl_misses,
        "examined": len(examined),
        # Fewer examined than missed, or the requests without a traced ITL only looked at in part.
        "sampled": len(examined) < len(missing) or itl_not_traced > MAX_EXAMINED,
        "max_examined": MAX_EXAMINED,
        "bucket_edges_tokens": list(BUCKET_EDGES_TOKENS),
        "stall_windows": totals.windows,
        "stall_s": total_stall_s,
        "stall_windows_by_basis": totals.bases,
        "estimated": bool(totals.bases["step spans"] or totals.bases["request overlap"]),
        "itl_misses_without_stalls": totals.itl_without_stalls,
        "ttft_misses_without_stages": totals.ttft_without_stages,
        "top_stall_cause": causes[0]["cause"] if causes and total_stall_s > 0 else None,
        "top_miss_cause": max(causes, key=lambda c: float(c["miss_share"]))["cause"] if causes else None,
        "causes": causes,
        "rests_on": rests_on(
            totals.bases,
            totals.windows,
            totals.itl_without_stalls,
            totals.ttft_without_stages,
            len(missing),
            itl_not_traced,
            estimated_itl_misses,
        ),
    }


def _spaced(items: list[Any], most: int) -> list[Any]:
    """`items`, or `most` of them evenly spaced (deterministic, spread over the trace's time)."""
    if len(items) <= most:
        return items
    return [items[i] for i in np.unique(np.linspace(0, len(items) - 1, most).round().astype(int))]


def rests_on(
    bases: dict[str, int],
    windows: int,
    itl_without_stalls: int,
    ttft_without_stages: int,
    missed: int = 0,
    itl_not_traced: int = 0,
    itl_misses_estimated: int = 0,
) -> list[str]:
    """What the attribution rests on, in sentences (estimated causes said to be estimated)."""
    lines = []
    if itl_not_traced:
        looked = min(itl_not_traced, MAX_EXAMINED)
        lines.append(
            f"{itl_not_traced} requests have no traced inter-token figure: {itl_misses_estimated} of the {looked} "
            "looked at count as ITL misses because an estimated stall window outlasts the ITL objective (ESTIMATED)"
        )
    if not missed:
        lines.append("no request missed the SLO")
    elif windows:
        said = ", ".join(
            f"{bases[name]} from {name}" + (" (ESTIMATED)" if estimated else " (measured)")
            for name, _, estimated in _BASES
            if bases[name]
        )
        lines.append(
            f"{windows} stall windows: {said}; causes by time overlap on the request's worker (step spans name no requests)"
        )
    else:
        lines.append(
            "no stall windows: the traces hold no stall events, step spans or overlapping prefills to explain a gap"
        )
    if itl_without_stalls:
        lines.append(f"{itl_without_stalls} ITL misses had no stall window: counted as batch size / unexplained")
    if ttft_without_stages:
        lines.append(f"{ttft_without_stages} TTFT misses had no queue or prefill span: their TTFT is unexplained")
    return lines
