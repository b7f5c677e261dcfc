"""Which latency histograms lack the SLO edge the burn rules count at (`alerts check`, the sidecar).

The burn rules (alerts/rules.py) count a series' good requests at the SLO's bucket edge, or, for a series
without it (an engine's own buckets: vLLM's TTFT jumps from 1 s to 2.5 s), at a fallback edge under the SLO;
a series with neither is left out. Both cases deserve a warning, which this module words.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.metrics_core import Metric

from tracer.alerts.settings import DEFAULT_SETTINGS, AlertSettings
from tracer.metrics import ITL_HISTOGRAM, TTFT_HISTOGRAM


def _seconds(value_s: float) -> str:
    return f"{value_s * 1000:g} ms" if value_s < 1 else f"{value_s:g} s"


def missing_slo_edges(families: Iterable[Metric], settings: AlertSettings = DEFAULT_SETTINGS) -> list[str]:
    """One line per distinct bucket layout of a TTFT or ITL family that lacks the SLO edge (sorted).

    `families` as prometheus_client's parsers return them. Pure; no I/O.
    """
    edges = {
        TTFT_HISTOGRAM: (settings.ttft_slo_s, settings.ttft_fallback_edge_s),
        ITL_HISTOGRAM: (settings.itl_slo_s, settings.itl_fallback_edge_s),
    }
    warnings = set()
    for family in families:
        if family.name not in edges:
            continue
        slo_s, fallback_s = edges[family.name]
        layouts: dict[tuple, set[float]] = {}
        for sample in family.samples:
            if sample.name == family.name + "_bucket":
                series = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
                layouts.setdefault(series, set()).add(float(sample.labels["le"]))
        for bounds in layouts.values():
            if slo_s in bounds:
                continue
            layout = ", ".join(format(b, "g") for b in sorted(bounds))
            if fallback_s in bounds:
                outcome = f"the burn rules judge it at {_seconds(fallback_s)} (conservative: may page early)"
            else:
                outcome = f"and the {_seconds(fallback_s)} fallback edge; the burn rules leave it out"
            warnings.add(f"{family.name} buckets ({layout}) lack the {_seconds(slo_s)} SLO edge; {outcome}")
    return sorted(warnings)
