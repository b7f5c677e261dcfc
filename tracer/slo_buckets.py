"""The default latency objectives, and which latency histograms lack the SLO edge they are counted at.

The burn rules (alerts/rules.py) count a series' good requests at the SLO's bucket edge, or, for a series
without it (an engine's own buckets: vLLM's TTFT jumps from 1 s to 2.5 s), at a fallback edge under the SLO;
a series with neither is left out. Both cases deserve a warning, which this module words: `splitscope alerts
check --metrics-url` and the sidecar's engine scrape both say it. A shared layer (the alert rules' settings
take their SLO defaults from here), so neither application imports the other. Pure; no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from tracer.metrics import ITL_HISTOGRAM, TTFT_HISTOGRAM

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

# Service level objectives. TTFT 2 s and a 100 ms inter-token gap are bucket boundaries of tracer/metrics.py.
TTFT_SLO_S = 2.0
ITL_SLO_S = 0.1
# Engines whose histograms lack the SLO edge are judged at the largest edge under the SLO that vLLM,
# SGLang and our catalogue all have (alerts/settings.py says why that is conservative).
TTFT_FALLBACK_EDGE_S = 1.0
ITL_FALLBACK_EDGE_S = 0.075


def _seconds(value_s: float) -> str:
    return f"{value_s * 1000:g} ms" if value_s < 1 else f"{value_s:g} s"


def missing_slo_edges(
    families: Iterable[Metric],
    *,
    ttft_edges_s: tuple[float, float] = (TTFT_SLO_S, TTFT_FALLBACK_EDGE_S),
    itl_edges_s: tuple[float, float] = (ITL_SLO_S, ITL_FALLBACK_EDGE_S),
) -> list[str]:
    """One line per distinct bucket layout of a TTFT or ITL family that lacks the SLO edge (sorted).

    `families` as prometheus_client's parsers return them; `*_edges_s`: (SLO, fallback edge) in seconds.
    """
    edges = {TTFT_HISTOGRAM: ttft_edges_s, ITL_HISTOGRAM: itl_edges_s}
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
