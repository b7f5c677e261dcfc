"""Optional evidence from Prometheus (`--prometheus URL --since DURATION`): per-pool busy ratio and queue
depth over the window, via the HTTP API's instant queries. Blocking HTTP (a few seconds at most)."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request

_TIMEOUT_S = 5.0

# title -> PromQL; `{since}` is a Prometheus range such as 600s.
QUERIES = {
    "busy ratio": "sum by (pool) (rate(splitscope_worker_busy_seconds_total[{since}])) / sum by (pool) (splitscope_pool_workers)",
    "requests waiting": "sum by (pool) (avg_over_time(splitscope_requests_waiting[{since}]))",
}


class PrometheusError(RuntimeError):
    """Prometheus could not be queried; the message says why."""


def instant_query(base_url: str, promql: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of each series of an instant vector. Raises PrometheusError."""
    url = base_url.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    try:
        with urllib.request.urlopen(url, timeout=_TIMEOUT_S) as response:
            body = json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise PrometheusError(f"Prometheus at {base_url} could not be queried: {exc}") from None
    if body.get("status") != "success" or body.get("data", {}).get("resultType") != "vector":
        raise PrometheusError(
            f"Prometheus at {base_url} answered {body.get('error') or body.get('status')!r} to {promql!r}"
        )
    return [(series.get("metric", {}), float(series["value"][1])) for series in body["data"]["result"]]


def pool_evidence(base_url: str, since_s: float) -> list[str]:
    """One evidence line per query, e.g. `Prometheus busy ratio over 600s: decode 0.92, prefill 0.31`."""
    lines = []
    for title, template in QUERIES.items():
        series = instant_query(base_url, template.format(since=f"{int(since_s)}s"))
        values = ", ".join(
            f"{labels.get('pool', '?')} {value:.2f}"
            for labels, value in sorted(series, key=lambda s: s[0].get("pool", ""))
        )
        lines.append(f"Prometheus {title} over {int(since_s)}s: {values or 'no series'}")
    return lines
