"""KV transfer: bytes per second, transfer duration, effective bandwidth, failures, share of TTFT."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard

from tracer.dashboards.common import (
    DEPLOYMENT,
    MODEL,
    NAMESPACE,
    RATE,
    default_timeseries,
    new_dashboard,
    prom_query,
    quantile_query,
)

UID = "splitscope-kv-transfer"
STAGE = "splitscope_stage_duration_seconds"
KV = f'{NAMESPACE}, stage="kv_transfer"'


def build() -> dashboard.Dashboard:
    return (
        new_dashboard(
            UID,
            "splitscope / KV transfer",
            "KV cache moving from prefill to decode workers: volume, duration, bandwidth, failures.",
        )
        .with_panel(
            default_timeseries("Bytes per second", "Bps", "KV bytes sent between pools per second.").with_target(
                prom_query(
                    f"sum by ({DEPLOYMENT}, src_pool, dst_pool) (rate(splitscope_kv_transfer_bytes_total{{{NAMESPACE}}}[{RATE}]))",
                    "{{src_pool}} → {{dst_pool}}",
                )
            )
        )
        .with_panel(
            default_timeseries(
                "Transfer duration", "s", "Percentiles of the kv_transfer stage. Click an exemplar for the trace."
            ).targets([quantile_query(q, STAGE, "", KV, f"p{round(q * 100)}") for q in (0.5, 0.95, 0.99)])
        )
        .with_panel(
            default_timeseries(
                "Effective bandwidth",
                "Bps",
                "Bytes moved per second of transfer time: compare with the link's capacity. Lower than "
                "the link means per-transfer overhead (handshake, small blocks, few streams).",
            ).with_target(
                prom_query(
                    f"sum by ({DEPLOYMENT}) (rate(splitscope_kv_transfer_bytes_total{{{NAMESPACE}}}[{RATE}]))"
                    f" / sum by ({DEPLOYMENT}) (rate({STAGE}_sum{{{KV}}}[{RATE}]))",
                    "bytes per transfer-second",
                )
            )
        )
        .with_panel(
            default_timeseries(
                "Failures by reason", "short", "Failed KV transfers per second; each fails a request."
            ).with_target(
                prom_query(
                    f"sum by ({DEPLOYMENT}, reason) (rate(splitscope_kv_transfer_failures_total{{{NAMESPACE}}}[{RATE}]))",
                    "{{reason}}",
                )
            )
        )
        .with_panel(
            default_timeseries(
                "Share of time to first token",
                "percentunit",
                "Mean transfer time over mean TTFT of disaggregated requests (alert KVTransferDominatesTTFT).",
            )
            .min(0)
            .with_target(
                prom_query(
                    f"(sum by ({DEPLOYMENT}) (rate({STAGE}_sum{{{KV}}}[{RATE}])) / sum by ({DEPLOYMENT}) (rate({STAGE}_count{{{KV}}}[{RATE}])))"
                    f' / (sum by ({DEPLOYMENT}) (rate(gen_ai_server_time_to_first_token_seconds_sum{{{MODEL}, mode="disaggregated"}}[{RATE}]))'
                    f' / sum by ({DEPLOYMENT}) (rate(gen_ai_server_time_to_first_token_seconds_count{{{MODEL}, mode="disaggregated"}}[{RATE}])))',
                    "kv_transfer / TTFT",
                )
            )
        )
        .with_panel(
            default_timeseries(
                "Transfers per second", "short", "KV transfers completed per second, per pool side."
            ).with_target(prom_query(f"sum by ({DEPLOYMENT}, pool) (rate({STAGE}_count{{{KV}}}[{RATE}]))", "{{pool}}"))
        )
    )
