"""Interference: decode steps that share the GPU with prefill against pure decode steps, from step timing
(our workers) and, beside it, from request spans (engines through the sidecar: tracer/sidecar/overlap.py)."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard

from tracer.dashboards.common import (
    DEPLOYMENT,
    ITL_SLO_S,
    POOL,
    RATE,
    default_timeseries,
    le_matcher,
    mean_query,
    new_dashboard,
    prom_query,
    quantile_query,
    with_slo_line,
)
from tracer.metrics import (
    DECODE_SECONDS_COUNTER,
    DECODE_STEPS_COUNTER,
    DECODE_TPOT_HISTOGRAM,
    OVERLAP_LATE_PREFILLS_COUNTER,
    OVERLAP_PREFILL_SECONDS_COUNTER,
    OVERLAP_PREFILL_STEPS_COUNTER,
    OVERLAP_PREFILL_TOKENS_COUNTER,
    OVERLAP_UNCLASSIFIED_COUNTER,
    PREFILL_OVERLAP_LABEL,
    WORKER_BUSY_COUNTER,
    WORKER_PREFILL_BUSY_COUNTER,
)

UID = "splitscope-interference"
# Panels only engines watched through the sidecar feed (stock vLLM, SGLang, Dynamo: no step timing).
REQUEST_RATIO_PANEL = "Interference ratio from requests"
REQUEST_TPOT_PANEL = "Request TPOT with and without prefill overlap"
REQUEST_OVERLAP_PANEL = "Overlapping prefill work per decode step; late and unclassified"
REQUEST_PREFILL_SHARE_PANEL = "Prefill share of busy time, from requests"
REQUEST_PANELS = (REQUEST_RATIO_PANEL, REQUEST_TPOT_PANEL, REQUEST_OVERLAP_PANEL, REQUEST_PREFILL_SHARE_PANEL)
STEP = "splitscope_step_duration_seconds"
ITL = "splitscope_inter_token_latency_seconds"


def build() -> dashboard.Dashboard:
    def mean_step(prefill_in_step: str) -> str:
        matchers = f'{POOL}, prefill_in_step="{prefill_in_step}"'
        return (
            f"(sum by ({DEPLOYMENT}, pool) (rate({STEP}_sum{{{matchers}}}[{RATE}]))"
            f" / sum by ({DEPLOYMENT}, pool) (rate({STEP}_count{{{matchers}}}[{RATE}])))"
        )

    def pool_rate(counter: str, matchers: str = POOL) -> str:
        return f"sum by ({DEPLOYMENT}, pool) (rate({counter}{{{matchers}}}[{RATE}]))"

    overlapped = f'{POOL}, {PREFILL_OVERLAP_LABEL}="true"'
    prefill_steps, prefill_s = pool_rate(OVERLAP_PREFILL_STEPS_COUNTER), pool_rate(OVERLAP_PREFILL_SECONDS_COUNTER)
    # The step ratio read from request spans (the rules' pool:splitscope_decode_overlap:interference_ratio5m).
    request_ratio = (
        f"({prefill_s} / {prefill_steps}) / (({pool_rate(DECODE_SECONDS_COUNTER, overlapped)} - {prefill_s})"
        f" / ({pool_rate(DECODE_STEPS_COUNTER, overlapped)} - {prefill_steps}))"
    )
    return (
        new_dashboard(
            UID,
            "splitscope / Interference",
            "Engine iterations with prefill tokens against decode-only iterations: the cost of colocation.",
        )
        .with_panel(
            default_timeseries(
                "Step time with and without prefill",
                "s",
                "Mean engine step time per pool, split by whether the step carried prefill tokens.",
            ).with_target(
                mean_query(STEP, "pool, prefill_in_step", POOL, "{{pool}} prefill_in_step={{prefill_in_step}}")
            )
        )
        .with_panel(
            default_timeseries(
                "Step time p95",
                "s",
                "95th percentile step time. A step serves many requests, so it has no exemplar: the "
                "inter-token latency panel's exemplars open the trace of a request that stalled.",
            ).with_target(
                quantile_query(
                    0.95,
                    STEP,
                    "pool, prefill_in_step",
                    POOL,
                    "{{pool}} prefill_in_step={{prefill_in_step}}",
                    exemplar=False,
                )
            )
        )
        .with_panel(
            default_timeseries(
                "Interference ratio",
                "x",
                "Mean step time with prefill over mean step time without, per pool (alert DecodeInterference "
                "above 1.5). Batch size and context are not held equal here; `splitscope report` holds them.",
            ).with_target(prom_query(f"{mean_step('true')} / {mean_step('false')}", "{{pool}}"))
        )
        .with_panel(
            default_timeseries(
                REQUEST_RATIO_PANEL,
                "x",
                "Engines without step timing (through the sidecar): inside the decodes another request's "
                "prefill overlapped on the same worker, mean time of the steps that carried a prefill over "
                "that of the decode-only steps, the same batch and context (alert DecodeInterference "
                "signal=request_tpot above 1.5).",
            ).with_target(prom_query(request_ratio, "{{pool}}"))
        )
        .with_panel(
            default_timeseries(
                REQUEST_TPOT_PANEL,
                "s",
                "Engines without step timing (through the sidecar): mean time per output token of finished "
                "requests whose decode another request's prefill overlapped on the same worker, and of those "
                "it did not. Overlapped requests also run at busier times, so this ratio mixes load with "
                f"interference; '{REQUEST_RATIO_PANEL}' compares steps inside the same decodes.",
            ).with_target(
                mean_query(
                    DECODE_TPOT_HISTOGRAM,
                    f"pool, {PREFILL_OVERLAP_LABEL}",
                    POOL,
                    f"{{{{pool}}}} prefill_overlap={{{{{PREFILL_OVERLAP_LABEL}}}}}",
                )
            )
        )
        .with_panel(
            default_timeseries(
                REQUEST_OVERLAP_PANEL,
                "short",
                "k/N: steps that carried a prefill per decode step of overlapped requests (the TPOT ratio "
                "matching the 1.5x step factor is 1 + 0.5 k/N), and the overlapping prefills' uncached tokens "
                "per decode step. Late: prefills per second that arrived after a decode they overlapped was "
                "classified (raise the sidecar's --overlap-hold if it grows); unclassified: decodes per second "
                "dropped because the classifier's hold was full.",
            )
            .with_target(prom_query(f"{prefill_steps} / {pool_rate(DECODE_STEPS_COUNTER, overlapped)}", "{{pool}} k/N"))
            .with_target(
                prom_query(
                    f"{pool_rate(OVERLAP_PREFILL_TOKENS_COUNTER)} / {pool_rate(DECODE_STEPS_COUNTER, overlapped)}",
                    "{{pool}} prefill tokens per decode step",
                )
            )
            .with_target(prom_query(pool_rate(OVERLAP_LATE_PREFILLS_COUNTER), "{{pool}} late prefills/s"))
            .with_target(prom_query(pool_rate(OVERLAP_UNCLASSIFIED_COUNTER), "{{pool}} unclassified/s"))
        )
        .with_panel(
            default_timeseries(
                "Prefill share of step time",
                "percentunit",
                "Share of step time spent in steps that carry prefill: high favours a split, low favours "
                "chunked prefill.",
            )
            .min(0)
            .max(1)
            .with_target(
                prom_query(
                    f'sum by ({DEPLOYMENT}, pool) (rate({STEP}_sum{{{POOL}, prefill_in_step="true"}}[{RATE}]))'
                    f" / sum by ({DEPLOYMENT}, pool) (rate({STEP}_sum{{{POOL}}}[{RATE}]))",
                    "{{pool}}",
                )
            )
        )
        .with_panel(
            default_timeseries(
                REQUEST_PREFILL_SHARE_PANEL,
                "percentunit",
                "Engines without step timing (through the sidecar): time with at least one request in prefill "
                "over time with any request running, per pool, from request spans (what the recommendations "
                "read there in place of the prefill share of step time).",
            )
            .min(0)
            .max(1)
            .with_target(
                prom_query(
                    f"{pool_rate(WORKER_PREFILL_BUSY_COUNTER)} / ({pool_rate(WORKER_BUSY_COUNTER)}"
                    f" and {pool_rate(WORKER_PREFILL_BUSY_COUNTER)})",
                    "{{pool}}",
                )
            )
        )
        .with_panel(
            default_timeseries("Steps per second", "short", "Engine iterations per second by kind.").with_target(
                prom_query(
                    f"sum by ({DEPLOYMENT}, pool, prefill_in_step) (rate({STEP}_count{{{POOL}}}[{RATE}]))",
                    "{{pool}} prefill_in_step={{prefill_in_step}}",
                )
            )
        )
        .with_panel(
            default_timeseries(
                "Decode stalls",
                "short",
                f"Token gaps longer than the inter-token SLO ({ITL_SLO_S:g} s) per second, per pool. Each "
                "stall is a `splitscope.decode.stall` event in the request's trace.",
            ).with_target(
                prom_query(
                    f"sum by ({DEPLOYMENT}, pool) (rate({ITL}_count{{{POOL}}}[{RATE}]))"
                    f" - sum by ({DEPLOYMENT}, pool) (rate({ITL}_bucket{{{POOL}, {le_matcher(ITL_SLO_S)}}}[{RATE}]))",
                    "{{pool}}",
                )
            )
        )
        .with_panel(
            with_slo_line(
                default_timeseries(
                    "Inter-token latency p99",
                    "s",
                    "What the interference costs users. Each exemplar is a request's longest gap: click one "
                    "in a high bucket for the trace of a stalled request, then `splitscope explain "
                    "--trace-id` names the prefills that stalled it.",
                ),
                ITL_SLO_S,
            ).with_target(quantile_query(0.99, ITL, "pool", POOL, "{{pool}}"))
        )
    )
