"""One /metrics for the whole server: the router's own families merged with every worker's.

At scrape time `merged_exposition` fetches each worker's /metrics concurrently (OpenMetrics, so trace-id
exemplars survive) with a short timeout, parses them with prometheus_client's own parser, and merges the
families by name with the router's registry. A worker that does not answer in time is just missing from
that scrape.

Series that several processes export under the same labels (e.g. `splitscope_tokens_total{pool,phase}`
from two workers of one pool, or each process's `splitscope_tracer_dropped_records_total{reason}`) are
summed: counters, histogram buckets/counts/sums and the pending-records gauge all add up across
processes; `_created` keeps the earliest. Every other gauge carries a `worker` label (or is set by the
router alone), so it never collides. One exemplar per merged sample is kept (the latest seen).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from typing import Any

import aiohttp
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

log = logging.getLogger(__name__)

OPENMETRICS_ACCEPT = "application/openmetrics-text; version=1.0.0; charset=utf-8"


class StaticCollection:
    """A registry-like object over fixed families: what the exposition encoders need (`collect()`)."""

    def __init__(self, families: Sequence[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return iter(self._families)


def merge_families(groups: Iterable[Iterable[Metric]]) -> list[Metric]:
    """Families of several processes merged by name; equal series summed (see the module docstring)."""
    merged: dict[str, Metric] = {}
    series: dict[str, dict[tuple, Sample]] = {}
    for families in groups:
        for family in families:
            target = merged.get(family.name)
            if target is None:
                target = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                series[family.name] = {}
            elif target.type != family.type:
                log.warning("metric %s is a %s here and a %s elsewhere; keeping the first", family.name,
                            target.type, family.type)  # fmt: skip
                continue
            table = series[family.name]
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                old = table.get(key)
                if old is None:
                    table[key] = sample
                    continue
                if sample.name.endswith("_created"):
                    value = min(old.value, sample.value)
                else:
                    value = old.value + sample.value
                table[key] = Sample(sample.name, sample.labels, value, old.timestamp, sample.exemplar or old.exemplar)
    for name, target in merged.items():
        target.samples = list(series[name].values())
    return list(merged.values())


async def fetch_families(session: aiohttp.ClientSession, url: str, timeout_s: float) -> list[Metric]:
    """One worker's families; [] when it does not answer in time or answers garbage."""
    try:
        async with session.get(url, headers={"Accept": OPENMETRICS_ACCEPT}, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            if response.status != 200:
                return []
            text = await response.text()
        return list(text_string_to_metric_families(text))
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as exc:
        log.debug("metrics of %s unavailable: %s", url, exc)
        return []


async def merged_exposition(
    own: Any,
    worker_metrics_urls: Sequence[str],
    session: aiohttp.ClientSession,
    accept_header: str | None,
    timeout_s: float = 2.0,
) -> tuple[bytes, str]:
    """(body, content type) of the router's registry `own` merged with every worker's metrics."""
    fetched = await asyncio.gather(*(fetch_families(session, url, timeout_s) for url in worker_metrics_urls))
    families = merge_families([list(own.collect()), *fetched])
    encoder, content_type = choose_encoder(accept_header or "")
    return encoder(StaticCollection(families)), content_type
