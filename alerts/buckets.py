"""Which latency histograms lack the SLO edge the burn rules count at, judged against these rules'
settings (`alerts check --metrics-url`). The check itself is shared with the sidecar: tracer/slo_buckets.py.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.metrics_core import Metric

from tracer.alerts.settings import DEFAULT_SETTINGS, AlertSettings
from tracer.slo_buckets import missing_slo_edges as _shared_missing_slo_edges


def missing_slo_edges(families: Iterable[Metric], settings: AlertSettings = DEFAULT_SETTINGS) -> list[str]:
    """One line per distinct bucket layout of a TTFT or ITL family that lacks the SLO edge of `settings`
    (sorted). `families` as prometheus_client's parsers return them. Pure; no I/O."""
    return _shared_missing_slo_edges(
        families,
        ttft_edges_s=(settings.ttft_slo_s, settings.ttft_fallback_edge_s),
        itl_edges_s=(settings.itl_slo_s, settings.itl_fallback_edge_s),
    )
