"""tracer.dashboards.catalogue: every metric a dashboard or rule reads is in architecture.md §5 and in the tracer's
real exposition."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from tracer.dashboards.catalogue import family_name, referenced_metrics, selector_names

# architecture.md §5, as data: name -> (type, labels).
DESIGN_CATALOGUE = {
    "gen_ai_server_time_to_first_token_seconds": ("histogram", {"gen_ai_request_model", "mode"}),
    "gen_ai_server_time_per_output_token_seconds": ("histogram", {"gen_ai_request_model", "mode"}),
    "gen_ai_server_request_duration_seconds": ("histogram", {"gen_ai_request_model", "mode"}),
    "splitscope_stage_duration_seconds": ("histogram", {"stage", "pool"}),
    "splitscope_inter_token_latency_seconds": ("histogram", {"pool"}),
    "splitscope_step_duration_seconds": ("histogram", {"pool", "prefill_in_step"}),
    "splitscope_kv_transfer_bytes_total": ("counter", {"src_pool", "dst_pool"}),
    "splitscope_kv_transfer_failures_total": ("counter", {"reason"}),
    "splitscope_tokens_total": ("counter", {"pool", "phase"}),
    "splitscope_requests_waiting": ("gauge", {"pool", "worker"}),
    "splitscope_requests_running": ("gauge", {"pool", "worker"}),
    "splitscope_worker_busy_seconds_total": ("counter", {"pool", "worker"}),
    "splitscope_pool_workers": ("gauge", {"pool"}),
    "splitscope_kv_cache_usage_ratio": ("gauge", {"pool", "worker"}),
    "splitscope_prefix_cache_queried_tokens_total": ("counter", {"pool"}),
    "splitscope_prefix_cache_hit_tokens_total": ("counter", {"pool"}),
    "splitscope_gpu_utilization_ratio": ("gauge", {"gpu"}),
    "splitscope_gpu_memory_used_bytes": ("gauge", {"gpu"}),
    "splitscope_gpu_telemetry_up": ("gauge", set()),
    "splitscope_tracer_dropped_records_total": ("counter", {"reason"}),
    "splitscope_tracer_pending_records": ("gauge", set()),
    # Request-level interference for engines without step timing (the sidecar's tracer/sidecar/overlap.py).
    "splitscope_decode_tpot_seconds": ("histogram", {"pool", "prefill_overlap"}),
    "splitscope_decode_overlap_classified_steps_total": ("counter", {"pool", "prefill_overlap"}),
    "splitscope_decode_overlap_classified_seconds_total": ("counter", {"pool", "prefill_overlap"}),
    "splitscope_decode_overlap_prefill_steps_total": ("counter", {"pool"}),
    "splitscope_decode_overlap_prefill_seconds_total": ("counter", {"pool"}),
    "splitscope_decode_overlap_prefill_tokens_total": ("counter", {"pool"}),
    "splitscope_decode_overlap_late_prefills_total": ("counter", {"pool"}),
    "splitscope_decode_overlap_unclassified_requests_total": ("counter", {"pool"}),
    "splitscope_worker_prefill_busy_seconds_total": ("counter", {"pool", "worker"}),
    # The advisor's own process (`splitscope advise --metrics-port`, tracer.metrics.AdviceMetrics).
    "splitscope_advice_info": ("gauge", {"namespace", "verdict", "target", "deployed"}),
    "splitscope_advice_differs": ("gauge", {"namespace"}),
    "splitscope_advice_gain_ratio": ("gauge", {"namespace"}),
    "splitscope_advice_confidence_ratio": ("gauge", {"namespace"}),
    "splitscope_advice_window_requests": ("gauge", {"namespace"}),
    "splitscope_advice_decisions_total": ("counter", {"namespace", "reason"}),
}


def test_every_referenced_metric_is_in_the_design_catalogue() -> None:
    referenced = referenced_metrics()
    assert referenced - set(DESIGN_CATALOGUE) == set()
    # The dashboards and rules between them read the whole catalogue: nothing exposed goes unwatched.
    assert set(DESIGN_CATALOGUE) - referenced == set()


def test_every_referenced_metric_is_in_the_tracers_exposition() -> None:
    from tracer.metrics import AdviceMetrics, Catalogue

    registry = CollectorRegistry()
    Catalogue(registry)
    AdviceMetrics(registry)  # the advisor's process: its families are exposed there, not by a worker
    text = generate_latest(registry).decode()
    exposed = {}
    for name, kind in re.findall(r"^# TYPE (\S+) (\w+)$", text, flags=re.M):
        # The text format names a counter family with its _total suffix only on samples.
        exposed[name if kind != "counter" or name.endswith("_total") else f"{name}_total"] = kind
    missing = referenced_metrics() - set(exposed)
    assert missing == set(), f"dashboards/rules read metrics the tracer does not expose: {missing}"
    for name in referenced_metrics():
        assert exposed[name] == DESIGN_CATALOGUE[name][0], name


@pytest.mark.parametrize(
    "series, family",
    [
        ("splitscope_step_duration_seconds_bucket", "splitscope_step_duration_seconds"),
        ("gen_ai_server_time_to_first_token_seconds_sum", "gen_ai_server_time_to_first_token_seconds"),
        ("splitscope_inter_token_latency_seconds_count", "splitscope_inter_token_latency_seconds"),
        ("splitscope_tokens_total", "splitscope_tokens_total"),
        ("splitscope_pool_workers", "splitscope_pool_workers"),
    ],
)
def test_family_name_maps_histogram_series_to_their_family(series: str, family: str) -> None:
    assert family_name(series) == family


def test_selector_names_walks_the_whole_expression() -> None:
    expr = (
        'sum by (pool) (rate(a_bucket{le="0.1"}[5m])) / on (pool) b:c:d'
        ' + absent(up{job=~"x"} == 1) or histogram_quantile(0.9, sum by (le) (rate(e_bucket[1m])))'
    )
    assert selector_names(expr) == {"a_bucket", "b:c:d", "up", "e_bucket"}
    with pytest.raises(ValueError):
        selector_names("sum(rate(x[5m])")
