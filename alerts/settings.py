"""Every threshold and duration of the alert rules, in one place.

The latency SLO thresholds are compared against histogram buckets (`le` labels), so each must be one of the
bucket boundaries of tracer/metrics.py: a burn-rate rule can only count "requests at or under X seconds"
when X is a boundary. `AlertSettings.validate()` refuses anything else. Engines' histograms without that
boundary are judged at a stated fallback edge under the SLO (`ttft_fallback_edge_s`, `itl_fallback_edge_s`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tracer.metrics import LATENCY_BUCKETS_S, TOKEN_BUCKETS_S
from tracer.slo_buckets import ITL_FALLBACK_EDGE_S, ITL_SLO_S, TTFT_FALLBACK_EDGE_S, TTFT_SLO_S


@dataclass(frozen=True)
class AlertSettings:
    """Thresholds (unit in each name) and `for:` durations (Prometheus duration strings) of every alert."""

    # Service level objectives. TTFT 2 s and a 100 ms inter-token gap are bucket boundaries (see above).
    # The defaults live in tracer/slo_buckets.py, which the sidecar's bucket check shares.
    ttft_slo_s: float = TTFT_SLO_S
    itl_slo_s: float = ITL_SLO_S
    # Share of requests (TTFT) or of token gaps (ITL) that must meet the threshold; sets the error budget.
    slo_objective_ratio: float = 0.99
    # Multiwindow burn rates (Google SRE workbook): 2% of a 30-day budget in 1 h, 5% in 6 h.
    fast_burn_factor: float = 14.4
    slow_burn_factor: float = 6.0
    # The recommendations fire when attainment drops under DistServe's 90%, not at the first budget burn.
    recommend_attainment_ratio: float = 0.90

    # Deployments sharing one Prometheus are told apart by these labels (Kubernetes: `namespace`, set by
    # scrape relabelling or by our exporters from OTEL_RESOURCE_ATTRIBUTES service.namespace). Every rule
    # aggregates and joins by them, so one deployment never answers for another.
    deployment_labels: tuple[str, ...] = ("namespace",)

    # Engines whose histograms lack the SLO edge (vLLM's TTFT buckets jump from 1 s to 2.5 s): the burn
    # rules count those series' requests as good only at or under this edge, the largest one under the SLO
    # that vLLM, SGLang and our catalogue all have. Conservative: requests between it and the SLO count as
    # misses, so a burn is never hidden (it may page somewhat early).
    ttft_fallback_edge_s: float = TTFT_FALLBACK_EDGE_S
    itl_fallback_edge_s: float = ITL_FALLBACK_EDGE_S

    # Interference: step time with prefill tokens in the batch over pure-decode step time, on the mean
    # and on the tail (p99 from the step histogram). Either one over its factor counts as interference.
    interference_factor: float = 1.5
    interference_tail_factor: float = 3.0
    # Steps of EACH kind in the 5-minute window before the p99 ratio is trusted: the p99 then sets aside
    # the 5 slowest steps, so one step stalled by something else (a CPU hiccup, a GC) makes no tail.
    interference_tail_min_steps: int = 500
    # Steps per second of EACH kind before the ratio is trusted (0.2/s is 60 steps in 5 minutes).
    interference_min_steps_per_s: float = 0.2
    # Request-level fallback (engines without step timing, through the sidecar): finished requests per
    # second of EACH kind (decode overlapped by another request's prefill, or not) before the TPOT ratio is
    # trusted (0.05/s is 15 requests in 5 minutes). Its threshold is derived from `interference_factor`
    # (alerts/rules.py `_request_interference_records`, runbook).
    request_interference_min_requests_per_s: float = 0.05
    # Share of a colocated pool's step time spent in steps that carry prefill: at or above this the
    # prefill load would keep a pool of its own busy (split); below it chunking the prefill is cheaper.
    split_min_prefill_time_share: float = 0.3
    # Recommendations are judged over a horizon long enough to see recurring bursts: the share of the
    # horizon's 5-minute windows that interfered while missing an SLO, and the prefill share over it.
    recommend_horizon: str = "1h"
    recommend_min_horizon_share: float = 0.25

    # Mean KV transfer time over mean time to first token (disaggregated mode).
    kv_transfer_ttft_share: float = 0.3

    # Pool saturation: busy ratio of the saturated pool, requests waiting per worker, busy ratio under
    # which the other pool counts as having headroom.
    saturated_busy_ratio: float = 0.85
    saturated_waiting_per_worker: float = 1.0
    headroom_busy_ratio: float = 0.6

    # Scrape jobs whose absence means we are blind (prometheus.yml names its jobs splitscope-*).
    scrape_job_regex: str = "splitscope.*"
    # Base of every runbook_url; the alert's anchor is appended. Point it at your own copy if you publish one.
    runbook_base_url: str = "alerts/runbook.md"

    decode_interference_for: str = "10m"
    recommendation_for: str = "15m"
    kv_transfer_share_for: str = "10m"
    pool_saturated_for: str = "10m"
    slo_burn_for: str = "2m"
    # A window longer than the `for`, so that a single failure is still in it when the `for` elapses.
    kv_transfer_failures_window: str = "10m"
    kv_transfer_failures_for: str = "1m"
    tracer_dropping_for: str = "10m"
    telemetry_absent_for: str = "5m"
    # `splitscope advise` holds its advice over --hold windows already; the `for` adds wall time on top, so
    # one advisor restart or one odd stretch of windows does not page (info, like the recommendations).
    layout_change_advised_for: str = "15m"

    def validate(self) -> None:
        """Raise ValueError with one clear line when a threshold cannot work as a rule."""
        if self.ttft_slo_s not in LATENCY_BUCKETS_S:
            raise ValueError(f"ttft_slo_s={self.ttft_slo_s} is not a latency bucket boundary {LATENCY_BUCKETS_S}")
        if self.itl_slo_s not in TOKEN_BUCKETS_S:
            raise ValueError(f"itl_slo_s={self.itl_slo_s} is not an ITL bucket boundary {TOKEN_BUCKETS_S}")
        for name in ("slo_objective_ratio", "recommend_attainment_ratio"):
            value = getattr(self, name)
            if not 0.0 < value < 1.0:
                raise ValueError(f"{name}={value} must be strictly between 0 and 1")
        if not self.deployment_labels or not all(
            re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", label) for label in self.deployment_labels
        ):
            raise ValueError(f"deployment_labels must be Prometheus label names, got {self.deployment_labels}")
        if not 0 < self.ttft_fallback_edge_s < self.ttft_slo_s:
            raise ValueError(f"ttft_fallback_edge_s={self.ttft_fallback_edge_s} must be under ttft_slo_s")
        if not 0 < self.itl_fallback_edge_s < self.itl_slo_s:
            raise ValueError(f"itl_fallback_edge_s={self.itl_fallback_edge_s} must be under itl_slo_s")
        if not 0.0 < self.recommend_min_horizon_share <= 1.0:
            raise ValueError(f"recommend_min_horizon_share={self.recommend_min_horizon_share} must be in (0, 1]")
        if self.headroom_busy_ratio >= self.saturated_busy_ratio:
            raise ValueError("headroom_busy_ratio must be below saturated_busy_ratio")


DEFAULT_SETTINGS = AlertSettings()
