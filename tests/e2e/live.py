"""Helpers for the end-to-end tests: load running in the background, real /metrics expositions, result checks.

Nothing here sleeps to wait for something: a background load is joined, expositions are fetched once.
"""

from __future__ import annotations

import asyncio
import math
import threading
import urllib.request
from collections.abc import Sequence
from typing import Any

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from tracer.load import LoadConfig, LoadResult, run_load

_HTTP_TIMEOUT_S = 10.0


class BackgroundLoad:
    """`run_load(config)` on its own thread and event loop, so a test can watch Prometheus meanwhile.

    `start()` returns at once. `stop()` (any thread) ends the run early: nothing more is sent, and requests
    still in flight are cancelled (recorded as `cancelled`, neither ok nor errors) rather than awaited, so a
    test that has seen what it waited for does not sit out a queue of long answers. `join()` blocks until
    the run is over and returns its LoadResult, re-raising whatever the run raised.
    """

    def __init__(self, config: LoadConfig) -> None:
        self.config = config
        self.result: LoadResult | None = None
        self._error: Exception | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._cancel: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="e2e-load", daemon=True)

    def start(self) -> BackgroundLoad:
        self._thread.start()
        self._ready.wait(_HTTP_TIMEOUT_S)
        return self

    def _run(self) -> None:
        async def main() -> LoadResult:
            self._loop, self._stop, self._cancel = asyncio.get_running_loop(), asyncio.Event(), asyncio.Event()
            self._ready.set()
            return await run_load(self.config, stop=self._stop, cancel=self._cancel)

        try:
            self.result = asyncio.run(main())
        except Exception as exc:  # noqa: BLE001 - re-raised by join(): a failing load must fail the test
            self._error = exc
        finally:
            self._ready.set()

    def stop(self) -> None:
        loop, stop, cancel = self._loop, self._stop, self._cancel
        if loop is not None and stop is not None and cancel is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(stop.set)
                loop.call_soon_threadsafe(cancel.set)
            except RuntimeError:
                pass  # the loop closed between the check and the call: the run is over anyway

    def join(self, timeout_s: float | None = None) -> LoadResult:
        """The run's result; raises TimeoutError if it is still running after `timeout_s`."""
        limit_s = timeout_s if timeout_s is not None else (self.config.duration_s or 0) + self.config.timeout_s + 30
        self._thread.join(limit_s)
        if self._thread.is_alive():
            raise TimeoutError(f"load still running after {limit_s:g} s")
        if self._error is not None:
            raise self._error
        assert self.result is not None
        return self.result


def exposed_families(metrics_url: str) -> dict[str, Metric]:
    """Family name -> family of one /metrics answer (Prometheus text format, as a scraper without
    OpenMetrics support reads it). Families with no samples (a labelled metric with no child yet) count."""
    with urllib.request.urlopen(metrics_url, timeout=_HTTP_TIMEOUT_S) as response:
        text = response.read().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def missing_families(referenced: Sequence[str], families: dict[str, Metric]) -> list[str]:
    """The referenced names (architecture.md §5 spelling: counters with `_total`) no family of `families` provides.

    prometheus_client names a counter's family without `_total`; that family must then be a counter.
    """
    missing = []
    for name in sorted(referenced):
        family = families.get(name)
        if family is None and name.endswith("_total"):
            family = families.get(name.removesuffix("_total"))
            if family is not None and family.type != "counter":
                family = None
        if family is None:
            missing.append(name)
    return missing


def finite_values(result: list[dict[str, Any]]) -> list[float]:
    """The finite sample values of an instant-query result (NaN from 0/0 or an empty histogram is no data)."""
    values = [float(series["value"][1]) for series in result]
    return [v for v in values if math.isfinite(v)]


def finite_range_values(result: list[dict[str, Any]]) -> list[float]:
    """The finite sample values of a range-query result, every series and step together."""
    values = [float(value) for series in result for _, value in series["values"]]
    return [v for v in values if math.isfinite(v)]
