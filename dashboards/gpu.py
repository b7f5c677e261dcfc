"""GPU: utilisation and memory per GPU, and whether GPU telemetry is available at all."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard

from dashboards.common import POOL, RATE, default_stat, default_timeseries, new_dashboard, prom_query

UID = "splitscope-gpu"


def build() -> dashboard.Dashboard:
    return (
        new_dashboard(UID, "splitscope / GPU", "GPU utilisation and memory from the pynvml sampler.")
        .with_panel(
            default_stat("GPU telemetry", "bool_yes_no",
                         "Whether the sampler can read GPUs (no: no GPU or no NVML; other panels stay empty).")
            .with_target(prom_query("max(splitscope_gpu_telemetry_up)"))
        )
        .with_panel(
            default_stat("GPUs seen", "short", "GPUs reporting utilisation.")
            .with_target(prom_query("count(splitscope_gpu_utilization_ratio)"))
        )
        .with_panel(
            default_timeseries("GPU utilisation", "percentunit", "Share of time a kernel ran, per GPU (NVML).")
            .min(0).max(1)
            .with_target(prom_query("splitscope_gpu_utilization_ratio", "{{instance}} gpu {{gpu}}"))
        )
        .with_panel(
            default_timeseries("GPU memory used", "bytes", "Device memory in use, per GPU.")
            .with_target(prom_query("splitscope_gpu_memory_used_bytes", "{{instance}} gpu {{gpu}}"))
        )
        .with_panel(
            default_timeseries(
                "Worker busy ratio", "percentunit",
                "Engine busy time per worker, to set against GPU utilisation: busy with a low utilisation "
                "means the GPU waits on the host.",
            )
            .min(0).max(1)
            .with_target(prom_query(
                f"sum by (pool, worker) (rate(splitscope_worker_busy_seconds_total{{{POOL}}}[{RATE}]))",
                "{{pool}}/{{worker}}",
            ))
        )
    )
