"""Overview: what users feel. TTFT, inter-token latency, end-to-end percentiles, throughput, goodput; then the
advisor's held layout advice (advice.py)."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard

from tracer.dashboards.advice import with_advice_row
from tracer.dashboards.common import (
    DEPLOYMENT,
    ITL_SLO_S,
    MODEL,
    POOL,
    RATE,
    TTFT_SLO_S,
    default_stat,
    default_timeseries,
    le_matcher,
    new_dashboard,
    prom_query,
    quantile_query,
    with_slo_line,
)

UID = "splitscope-overview"
TTFT = "gen_ai_server_time_to_first_token_seconds"
TPOT = "gen_ai_server_time_per_output_token_seconds"
DURATION = "gen_ai_server_request_duration_seconds"
ITL = "splitscope_inter_token_latency_seconds"


def _percentiles(histogram: str, by: str, matchers: str) -> list:
    return [quantile_query(q, histogram, by, matchers, f"p{round(q * 100)} {{{{{by}}}}}") for q in (0.5, 0.95, 0.99)]


def build() -> dashboard.Dashboard:
    ttft_attained = (
        f"sum by ({DEPLOYMENT}, gen_ai_request_model) (rate({TTFT}_bucket{{{MODEL}, {le_matcher(TTFT_SLO_S)}}}[{RATE}]))"
        f" / sum by ({DEPLOYMENT}, gen_ai_request_model) (rate({TTFT}_count{{{MODEL}}}[{RATE}]))"
    )
    itl_attained = (
        f"sum by ({DEPLOYMENT}, pool) (rate({ITL}_bucket{{{POOL}, {le_matcher(ITL_SLO_S)}}}[{RATE}]))"
        f" / sum by ({DEPLOYMENT}, pool) (rate({ITL}_count{{{POOL}}}[{RATE}]))"
    )
    board = new_dashboard(
        UID,
        "splitscope / Overview",
        "Latency users feel (TTFT, inter-token, end to end), throughput and goodput against the SLOs.",
    )
    board = (
        board.with_panel(
            default_stat("Requests / s", "reqps", "Completed requests per second.").with_target(
                prom_query(f"sum by ({DEPLOYMENT}) (rate({DURATION}_count{{{MODEL}}}[{RATE}]))")
            )
        )
        .with_panel(
            default_stat("TTFT p95", "s", f"95th percentile time to first token (SLO {TTFT_SLO_S:g} s).").with_target(
                quantile_query(0.95, TTFT, "", MODEL, "", exemplar=False)
            )
        )
        .with_panel(
            default_stat(
                "Inter-token p95", "s", f"95th percentile gap between tokens (SLO {ITL_SLO_S:g} s)."
            ).with_target(quantile_query(0.95, ITL, "", POOL, "", exemplar=False))
        )
        .with_panel(
            default_stat("Output tokens / s", "short", "Decode tokens generated per second.").with_target(
                prom_query(f'sum by ({DEPLOYMENT}) (rate(splitscope_tokens_total{{{POOL}, phase="decode"}}[{RATE}]))')
            )
        )
        .with_panel(
            with_slo_line(
                default_timeseries(
                    "Time to first token",
                    "s",
                    "Percentiles per model; the dashed line is the TTFT SLO. Click an exemplar for the trace.",
                ),
                TTFT_SLO_S,
            ).targets(_percentiles(TTFT, "gen_ai_request_model", MODEL))
        )
        .with_panel(
            with_slo_line(
                default_timeseries(
                    "Inter-token latency",
                    "s",
                    "Gap between consecutive tokens, per pool; the dashed line is the inter-token SLO.",
                ),
                ITL_SLO_S,
            ).targets(_percentiles(ITL, "pool", POOL))
        )
        .with_panel(
            default_timeseries(
                "Time per output token",
                "s",
                "Decode time divided by output tokens, per request (percentiles).",
            ).targets(_percentiles(TPOT, "gen_ai_request_model", MODEL))
        )
        .with_panel(
            default_timeseries(
                "End-to-end request duration",
                "s",
                "From request arrival at the router to the last token.",
            ).targets(_percentiles(DURATION, "gen_ai_request_model", MODEL))
        )
        .with_panel(
            default_timeseries("Throughput", "reqps", "Completed requests per second by serving mode.").with_target(
                prom_query(
                    f"sum by ({DEPLOYMENT}, mode) (rate({DURATION}_count{{{MODEL}}}[{RATE}]))", "{{mode}} requests/s"
                )
            )
        )
        .with_panel(
            default_timeseries(
                "Tokens / s", "short", "Prompt (prefill) and generated (decode) tokens per second."
            ).with_target(
                prom_query(
                    f"sum by ({DEPLOYMENT}, pool, phase) (rate(splitscope_tokens_total{{{POOL}}}[{RATE}]))",
                    "{{pool}} {{phase}}",
                )
            )
        )
        .with_panel(
            default_timeseries(
                "Goodput (TTFT within SLO)",
                "reqps",
                "Requests per second whose time to first token met the SLO, against all requests. The "
                "inter-token condition is per request and needs traces: `splitscope report` gives the joint "
                "goodput.",
            )
            .with_target(
                prom_query(
                    f"sum by ({DEPLOYMENT}) (rate({TTFT}_bucket{{{MODEL}, {le_matcher(TTFT_SLO_S)}}}[{RATE}]))",
                    "within TTFT SLO",
                )
            )
            .with_target(prom_query(f"sum by ({DEPLOYMENT}) (rate({TTFT}_count{{{MODEL}}}[{RATE}]))", "all requests"))
        )
        .with_panel(
            default_timeseries(
                "SLO attainment",
                "percentunit",
                "Share of requests meeting the TTFT SLO (per model) and of token gaps meeting the "
                "inter-token SLO (per pool). The alerts' objective is "
                "99%; the split recommendation uses 90%.",
            )
            .min(0)
            .max(1)
            .with_target(prom_query(ttft_attained, "TTFT {{gen_ai_request_model}}"))
            .with_target(prom_query(itl_attained, "inter-token {{pool}}"))
        )
    )
    return with_advice_row(board)
