"""Interference: decode steps that share the GPU with prefill against pure decode steps."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard

from tracer.dashboards.common import (
    DEPLOYMENT, ITL_SLO_S, POOL, RATE, default_timeseries, le_matcher, mean_query, new_dashboard, prom_query,
    quantile_query, with_slo_line,
)

UID = "splitscope-interference"
STEP = "splitscope_step_duration_seconds"
ITL = "splitscope_inter_token_latency_seconds"


def build() -> dashboard.Dashboard:
    def mean_step(prefill_in_step: str) -> str:
        matchers = f'{POOL}, prefill_in_step="{prefill_in_step}"'
        return (
            f"(sum by ({DEPLOYMENT}, pool) (rate({STEP}_sum{{{matchers}}}[{RATE}]))"
            f" / sum by ({DEPLOYMENT}, pool) (rate({STEP}_count{{{matchers}}}[{RATE}])))"
        )

    return (
        new_dashboard(
            UID, "splitscope / Interference",
            "Engine iterations with prefill tokens against decode-only iterations: the cost of colocation.",
        )
        .with_panel(
            default_timeseries(
                "Step time with and without prefill", "s",
                "Mean engine step time per pool, split by whether the step carried prefill tokens.",
            )
            .with_target(mean_query(STEP, "pool, prefill_in_step", POOL, "{{pool}} prefill_in_step={{prefill_in_step}}"))
        )
        .with_panel(
            default_timeseries("Step time p95", "s", "95th percentile step time. Click an exemplar for the trace.")
            .with_target(quantile_query(0.95, STEP, "pool, prefill_in_step", POOL,
                                        "{{pool}} prefill_in_step={{prefill_in_step}}"))
        )
        .with_panel(
            default_timeseries(
                "Interference ratio", "x",
                "Mean step time with prefill over mean step time without, per pool (alert DecodeInterference "
                "above 1.5). Batch size and context are not held equal here; `splitscope report` holds them.",
            )
            .with_target(prom_query(f"{mean_step('true')} / {mean_step('false')}", "{{pool}}"))
        )
        .with_panel(
            default_timeseries(
                "Prefill share of step time", "percentunit",
                "Share of step time spent in steps that carry prefill: high favours a split, low favours "
                "chunked prefill.",
            )
            .min(0).max(1)
            .with_target(prom_query(
                f'sum by ({DEPLOYMENT}, pool) (rate({STEP}_sum{{{POOL}, prefill_in_step="true"}}[{RATE}]))'
                f" / sum by ({DEPLOYMENT}, pool) (rate({STEP}_sum{{{POOL}}}[{RATE}]))",
                "{{pool}}",
            ))
        )
        .with_panel(
            default_timeseries("Steps per second", "short", "Engine iterations per second by kind.")
            .with_target(prom_query(
                f"sum by ({DEPLOYMENT}, pool, prefill_in_step) (rate({STEP}_count{{{POOL}}}[{RATE}]))",
                "{{pool}} prefill_in_step={{prefill_in_step}}",
            ))
        )
        .with_panel(
            default_timeseries(
                "Decode stalls", "short",
                f"Token gaps longer than the inter-token SLO ({ITL_SLO_S:g} s) per second, per pool. Each "
                "stall is a `splitscope.decode.stall` event in the request's trace.",
            )
            .with_target(prom_query(
                f"sum by ({DEPLOYMENT}, pool) (rate({ITL}_count{{{POOL}}}[{RATE}]))"
                f" - sum by ({DEPLOYMENT}, pool) (rate({ITL}_bucket{{{POOL}, {le_matcher(ITL_SLO_S)}}}[{RATE}]))",
                "{{pool}}",
            ))
        )
        .with_panel(
            with_slo_line(default_timeseries(
                "Inter-token latency p99", "s",
                "What the interference costs users. Click an exemplar for the trace.",
            ), ITL_SLO_S)
            .with_target(quantile_query(0.99, ITL, "pool", POOL, "{{pool}}"))
        )
    )
