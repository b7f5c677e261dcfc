"""GPU: utilisation and memory per GPU, and whether GPU telemetry is available at all."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard

from tracer.dashboards.common import (
    DEPLOYMENT,
    NAMESPACE,
    POOL,
    RATE,
    default_stat,
    default_timeseries,
    new_dashboard,
    prom_query,
)

UID = "splitscope-gpu"


def build() -> dashboard.Dashboard:
    return (
        new_dashboard(UID, "splitscope / GPU", "GPU utilisation and memory from the pynvml sampler.")
        .with_panel(
            default_stat(
                "GPU telemetry",
                "bool_yes_no",
                "Whether the sampler can read GPUs (no: no GPU or no NVML; other panels stay empty).",
            ).with_target(prom_query(f"max by ({DEPLOYMENT}) (splitscope_gpu_telemetry_up{{{NAMESPACE}}})"))
        )
        .with_panel(
            default_stat("GPUs seen", "short", "GPUs reporting utilisation.").with_target(
                prom_query(f"count by ({DEPLOYMENT}) (splitscope_gpu_utilization_ratio{{{NAMESPACE}}})")
            )
        )
        .with_panel(
            default_timeseries("GPU utilisation", "percentunit", "Share of time a kernel ran, per GPU (NVML).")
            .min(0)
            .max(1)
            .with_target(prom_query(f"splitscope_gpu_utilization_ratio{{{NAMESPACE}}}", "{{instance}} gpu {{gpu}}"))
        )
        .with_panel(
            default_timeseries("GPU memory used", "bytes", "Device memory in use, per GPU.").with_target(
                prom_query(f"splitscope_gpu_memory_used_bytes{{{NAMESPACE}}}", "{{instance}} gpu {{gpu}}")
            )
        )
        .with_panel(
            default_timeseries(
                "Worker busy ratio",
                "percentunit",
                "Engine busy time per worker, to set against GPU utilisation: busy with a low utilisation "
                "means the GPU waits on the host.",
            )
            .min(0)
            .max(1)
            .with_target(
                prom_query(
                    f"sum by ({DEPLOYMENT}, pool, worker) (rate(splitscope_worker_busy_seconds_total{{{POOL}}}[{RATE}]))",
                    "{{pool}}/{{worker}}",
                )
            )
        )
    )
