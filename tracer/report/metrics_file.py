"""`splitscope report --metrics-file FILE`: an engine's /metrics capture, for what request spans cannot show.

A stock vLLM's request spans give each request's decode time and token count but not its gaps: the
report estimates them from how requests overlap (estimate.py). vLLM's own histograms measure what that
estimate guesses at, pooled over every request the engine served:

- `vllm:inter_token_latency_seconds` (older vLLM: `vllm:time_per_output_token_seconds`): every gap
  between two tokens of a request, as the engine produced them;
- `vllm:iteration_tokens_total`: tokens per engine step (prefill and decode tokens together).

The file is Prometheus's text format (a `curl .../metrics` capture), parsed with prometheus_client's
parser; every label set of a family (engines, models) is summed bucket by bucket. Quantiles are
interpolated linearly within a bucket, as Prometheus's `histogram_quantile` does. Blocking file I/O.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

# vLLM's family names (vllm/v1/metrics/loggers.py), newest first where one replaced another.
VLLM_GAP_FAMILIES = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
VLLM_STEP_TOKENS_FAMILY = "vllm:iteration_tokens_total"


class MetricsFileError(ValueError):
    """The metrics file cannot be used; the message names the file and why."""


@dataclass(frozen=True)
class Histogram:
    """A Prometheus histogram summed over its label sets: cumulative counts at ascending upper bounds
    (the last is +Inf), the count of observations and their sum."""

    family: str
    upper_bounds: np.ndarray
    cumulative: np.ndarray
    count: float
    sum: float

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count else math.nan

    def quantile(self, q: float) -> float:
        """The q-quantile (0 < q < 1), linear within its bucket (from 0 for the first, the last finite
        bound for the +Inf bucket); NaN without observations."""
        if not self.count:
            return math.nan
        rank = q * self.count
        k = int(np.searchsorted(self.cumulative, rank, side="left"))
        k = min(k, len(self.upper_bounds) - 1)
        if math.isinf(self.upper_bounds[k]):
            return float(self.upper_bounds[k - 1]) if k else math.nan
        lower = float(self.upper_bounds[k - 1]) if k else 0.0
        below = float(self.cumulative[k - 1]) if k else 0.0
        inside = float(self.cumulative[k]) - below
        return lower + (float(self.upper_bounds[k]) - lower) * ((rank - below) / inside if inside else 1.0)

    def bucket_of_quantile(self, q: float) -> tuple[float, float]:
        """(lower, upper) bounds of the bucket that holds the q-quantile (upper may be +Inf)."""
        k = min(int(np.searchsorted(self.cumulative, q * self.count, side="left")), len(self.upper_bounds) - 1)
        return (float(self.upper_bounds[k - 1]) if k else 0.0), float(self.upper_bounds[k])

    def share_above(self, value: float) -> float:
        """Share of observations above `value`, linear within the bucket that holds it."""
        if not self.count:
            return math.nan
        k = int(np.searchsorted(self.upper_bounds, value, side="left"))
        if k >= len(self.upper_bounds):
            return 0.0
        lower = float(self.upper_bounds[k - 1]) if k else 0.0
        below = float(self.cumulative[k - 1]) if k else 0.0
        upper = float(self.upper_bounds[k])
        inside = float(self.cumulative[k]) - below
        fraction = 1.0 if math.isinf(upper) else (value - lower) / (upper - lower) if upper > lower else 1.0
        at_or_below = below + inside * min(max(fraction, 0.0), 1.0)
        return max(0.0, 1.0 - at_or_below / self.count)


@dataclass(frozen=True)
class EngineMetrics:
    """What the report takes from a metrics capture (None: the family is not in the file)."""

    path: str
    gaps: Histogram | None
    step_tokens: Histogram | None


def _histogram(family: str, samples: list) -> Histogram:
    buckets: dict[float, float] = {}
    count = total = 0.0
    for sample in samples:
        if sample.name == family + "_bucket":
            bound = float(sample.labels["le"])
            buckets[bound] = buckets.get(bound, 0.0) + float(sample.value)
        elif sample.name == family + "_count":
            count += float(sample.value)
        elif sample.name == family + "_sum":
            total += float(sample.value)
    if not buckets or not math.isinf(max(buckets)):
        raise ValueError(f"histogram {family} has no +Inf bucket")
    bounds = np.array(sorted(buckets))
    cumulative = np.array([buckets[b] for b in bounds])
    if np.any(np.diff(cumulative) < 0) or np.any(cumulative < 0):
        raise ValueError(f"histogram {family} has decreasing bucket counts")
    return Histogram(family, bounds, cumulative, float(cumulative[-1]) if count == 0 else count, total)


def read_metrics_file(path: str | os.PathLike[str]) -> EngineMetrics:
    """Parse a /metrics capture. Raises MetricsFileError (unreadable, not the text format, or neither a
    vLLM inter-token nor an iteration-tokens histogram in it)."""
    try:
        text = open(path, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError) as exc:
        raise MetricsFileError(f"metrics file {path}: cannot be read ({exc})") from None
    try:
        families = {f.name: f for f in text_string_to_metric_families(text) if f.type == "histogram"}
        gap_family = next((name for name in VLLM_GAP_FAMILIES if name in families), None)
        gaps = _histogram(gap_family, families[gap_family].samples) if gap_family else None
        steps = (
            _histogram(VLLM_STEP_TOKENS_FAMILY, families[VLLM_STEP_TOKENS_FAMILY].samples)
            if VLLM_STEP_TOKENS_FAMILY in families
            else None
        )
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise MetricsFileError(f"metrics file {path}: not a Prometheus text exposition ({exc})") from None
    if gaps is None and steps is None:
        raise MetricsFileError(
            f"metrics file {path}: no {' or '.join(VLLM_GAP_FAMILIES)} or {VLLM_STEP_TOKENS_FAMILY} histogram "
            "(capture a vLLM engine's /metrics)"
        )
    return EngineMetrics(str(path), gaps, steps)


def metrics_sources(metrics: EngineMetrics) -> list[str]:
    """What the report takes from the file, one phrase per family found."""
    out = []
    if metrics.gaps is not None:
        out.append(f"the inter-token gap distribution ({metrics.gaps.family}, {metrics.gaps.count:.0f} gaps)")
    if metrics.step_tokens is not None:
        out.append(f"tokens per engine step ({metrics.step_tokens.family}, {metrics.step_tokens.count:.0f} steps)")
    return out


def metrics_evidence(metrics: EngineMetrics, itl_slo_s: float) -> list[str]:
    """Evidence lines: the measured gap quantiles and share over the SLO, the tokens per step."""
    lines = []
    gaps = metrics.gaps
    if gaps is not None and gaps.count:
        p50, p90, p99 = (gaps.quantile(q) * 1e3 for q in (0.5, 0.9, 0.99))
        lines.append(
            f"engine-measured inter-token gaps ({gaps.family}, {gaps.count:.0f} gaps): mean {gaps.mean * 1e3:.3g} ms, "
            f"p50/p90/p99 {p50:.3g}/{p90:.3g}/{p99:.3g} ms (within buckets), {gaps.share_above(itl_slo_s):.2%} over the "
            f"ITL SLO of {itl_slo_s:g} s"
        )
    steps = metrics.step_tokens
    if steps is not None and steps.count:
        p50, p90, p99 = (steps.quantile(q) for q in (0.5, 0.9, 0.99))
        lines.append(
            f"engine-measured tokens per step ({steps.family}, {steps.count:.0f} steps): mean {steps.mean:.3g}, "
            f"p50/p90/p99 {p50:.3g}/{p90:.3g}/{p99:.3g} (within buckets)"
        )
    return lines
