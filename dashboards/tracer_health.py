"""Tracer health: is the telemetry pipeline itself keeping up (drops, backlog, scrape targets)?"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard

from tracer.alerts.settings import DEFAULT_SETTINGS
from tracer.dashboards.common import (
    DEPLOYMENT,
    NAMESPACE,
    RATE,
    default_stat,
    default_timeseries,
    new_dashboard,
    prom_query,
)

UID = "splitscope-tracer-health"
JOBS = f'job=~"{DEFAULT_SETTINGS.scrape_job_regex}"'


def build() -> dashboard.Dashboard:
    return (
        new_dashboard(
            UID,
            "splitscope / Tracer health",
            "The tracer's bounded ring and exporter, and the scrape targets: is the telemetry complete?",
        )
        .with_panel(
            default_stat("Targets up", "short", "splitscope scrape targets whose last scrape succeeded.").with_target(
                prom_query(f"sum(up{{{JOBS}}})")
            )
        )
        .with_panel(
            default_stat("Dropped records / s", "short", "All reasons, all processes.").with_target(
                prom_query(
                    f"sum by ({DEPLOYMENT}) (rate(splitscope_tracer_dropped_records_total{{{NAMESPACE}}}[{RATE}]))"
                )
            )
        )
        .with_panel(
            default_timeseries(
                "Dropped records per second",
                "short",
                "Records the ring dropped (oldest first) or the exporter gave up on, by process and reason.",
            ).with_target(
                prom_query(
                    f"sum by ({DEPLOYMENT}, instance, worker, reason) (rate(splitscope_tracer_dropped_records_total{{{NAMESPACE}}}[{RATE}]))",
                    "{{instance}} {{worker}} {{reason}}",
                )
            )
        )
        .with_panel(
            default_timeseries(
                "Pending records",
                "short",
                "Records waiting in the ring or for their CUDA events; a steady climb means the pipeline falls behind.",
            ).with_target(prom_query(f"splitscope_tracer_pending_records{{{NAMESPACE}}}", "{{instance}} {{worker}}"))
        )
        .with_panel(
            default_timeseries("Scrape targets", "short", "1 when the target's last scrape succeeded.")
            .min(0)
            .max(1)
            .with_target(prom_query(f"up{{{JOBS}}}", "{{job}} {{instance}}"))
        )
    )
