"""Stages: where a request's time goes (queue, prefill, KV transfer, decode) and how loaded each pool is."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard

from tracer.dashboards.common import (
    DEPLOYMENT,
    POOL,
    RATE,
    default_timeseries,
    mean_query,
    new_dashboard,
    prom_query,
    quantile_query,
    stacked,
)

UID = "splitscope-stages"
STAGE = "splitscope_stage_duration_seconds"


def build() -> dashboard.Dashboard:
    busy_ratio = (
        f"sum by ({DEPLOYMENT}, pool) (rate(splitscope_worker_busy_seconds_total{{{POOL}}}[{RATE}]))"
        f" / on ({DEPLOYMENT}, pool) max by ({DEPLOYMENT}, pool) (splitscope_pool_workers{{{POOL}}})"
    )
    return (
        new_dashboard(
            UID,
            "splitscope / Stages",
            "Time per stage per pool, queue depth and busy ratio per pool: where requests wait.",
        )
        .with_panel(
            default_timeseries(
                "Stage time p95",
                "s",
                "95th percentile duration of each stage, per pool. Click an exemplar for the trace.",
            ).with_target(quantile_query(0.95, STAGE, "stage, pool", POOL, "{{stage}} ({{pool}})"))
        )
        .with_panel(
            default_timeseries("Stage time mean", "s", "Mean duration of each stage, per pool.").with_target(
                mean_query(STAGE, "stage, pool", POOL, "{{stage}} ({{pool}})")
            )
        )
        .with_panel(
            stacked(
                default_timeseries(
                    "Stage seconds per second",
                    "s",
                    "Seconds spent in each stage per second of wall time, summed over requests: the stage that "
                    "grows is where added load goes.",
                )
            ).with_target(
                prom_query(f"sum by ({DEPLOYMENT}, stage) (rate({STAGE}_sum{{{POOL}}}[{RATE}]))", "{{stage}}")
            )
        )
        .with_panel(
            default_timeseries("Queue depth", "short", "Requests waiting and running, per pool.")
            .with_target(
                prom_query(f"sum by ({DEPLOYMENT}, pool) (splitscope_requests_waiting{{{POOL}}})", "waiting {{pool}}")
            )
            .with_target(
                prom_query(f"sum by ({DEPLOYMENT}, pool) (splitscope_requests_running{{{POOL}}})", "running {{pool}}")
            )
        )
        .with_panel(
            default_timeseries(
                "Busy ratio per pool",
                "percentunit",
                "Busy seconds per second per worker, averaged over the pool's workers "
                "(splitscope_pool_workers). Over 85% with a queue is saturation.",
            )
            .min(0)
            .max(1)
            .with_target(prom_query(busy_ratio, "{{pool}}"))
        )
        .with_panel(
            default_timeseries("Busy ratio per worker", "percentunit", "Busy seconds per second of each worker.")
            .min(0)
            .max(1)
            .with_target(
                prom_query(
                    f"sum by ({DEPLOYMENT}, pool, worker) (rate(splitscope_worker_busy_seconds_total{{{POOL}}}[{RATE}]))",
                    "{{pool}}/{{worker}}",
                )
            )
        )
        .with_panel(
            default_timeseries("Workers per pool", "short", "Workers the launcher started in each pool.").with_target(
                prom_query(f"max by ({DEPLOYMENT}, pool) (splitscope_pool_workers{{{POOL}}})", "{{pool}}")
            )
        )
        .with_panel(
            default_timeseries("KV cache usage", "percentunit", "Share of KV cache blocks in use, per worker.")
            .min(0)
            .max(1)
            .with_target(
                prom_query(
                    f"max by ({DEPLOYMENT}, pool, worker) (splitscope_kv_cache_usage_ratio{{{POOL}}})",
                    "{{pool}}/{{worker}}",
                )
            )
        )
        .with_panel(
            default_timeseries(
                "Prefix cache hit ratio",
                "percentunit",
                "Prompt tokens served from the prefix cache over prompt tokens looked up.",
            )
            .min(0)
            .max(1)
            .with_target(
                prom_query(
                    f"sum by ({DEPLOYMENT}, pool) (rate(splitscope_prefix_cache_hit_tokens_total{{{POOL}}}[{RATE}]))"
                    f" / sum by ({DEPLOYMENT}, pool) (rate(splitscope_prefix_cache_queried_tokens_total{{{POOL}}}[{RATE}]))",
                    "{{pool}}",
                )
            )
        )
    )
