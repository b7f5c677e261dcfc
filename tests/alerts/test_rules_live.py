"""End to end: the SAME rules, with shortened `for:` and windows, fire in a real Prometheus scraping a real
/metrics endpoint whose step histograms show interference."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

from tests.prom import running_prometheus, serving_registry
from tracer.alerts.rules import render_rules_yaml

PREFILL_STEPS_PER_S, PREFILL_STEP_S = 10.0, 0.2
DECODE_STEPS_PER_S, DECODE_STEP_S = 20.0, 0.05


class InterferingPool:
    """Collector for a colocated pool whose counters grow with wall time (read at scrape time).

    Steps with prefill: 10/s of 0.2 s; decode-only steps: 20/s of 0.05 s, so the mean ratio is exactly 4.
    """

    def __init__(self) -> None:
        self.start_s = time.monotonic()

    def collect(self) -> Iterator[object]:
        elapsed_s = time.monotonic() - self.start_s
        steps = HistogramMetricFamily(
            "splitscope_step_duration_seconds", "Engine iteration time", labels=["pool", "prefill_in_step"]
        )
        for kind, rate_hz, step_s in (
            ("true", PREFILL_STEPS_PER_S, PREFILL_STEP_S),
            ("false", DECODE_STEPS_PER_S, DECODE_STEP_S),
        ):
            count = rate_hz * elapsed_s
            buckets = [(f"{bound}", count if step_s <= bound else 0.0) for bound in (0.1, 0.3)]
            steps.add_metric(["colocated", kind], buckets + [("+Inf", count)], sum_value=count * step_s)
        yield steps
        workers = GaugeMetricFamily("splitscope_pool_workers", "Workers in each pool", labels=["pool"])
        workers.add_metric(["colocated"], 1)
        yield workers


@pytest.fixture
def interfering_exposition(port: int) -> Iterator[str]:
    registry = CollectorRegistry()
    registry.register(InterferingPool())
    with serving_registry(registry, port) as target:
        yield target


def _firing(alerts: list[dict]) -> list[dict]:
    return [a for a in alerts if a["state"] == "firing"]


def test_decode_interference_fires_in_a_live_prometheus(interfering_exposition: str, tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    # 10m -> 3 s; every window 10 s (ten scrapes at 1 s).
    rules.write_text(render_rules_yaml(for_scale=0.005, range_override="10s"), encoding="utf-8")
    with running_prometheus([interfering_exposition], rule_files=[rules]) as prom:
        prom.wait_targets_up(timeout_s=30)
        ratio = prom.wait_for(
            "pool:splitscope_step_duration_seconds:interference_ratio5m", lambda r: len(r) == 1, timeout_s=30
        )
        assert ratio[0]["metric"]["pool"] == "colocated"
        assert float(ratio[0]["value"][1]) == pytest.approx(PREFILL_STEP_S / DECODE_STEP_S, rel=1e-6)

        prom.wait_for('ALERTS{alertname="DecodeInterference", alertstate="firing"}', bool, timeout_s=60)
        firing = _firing(prom.alerts())
        interference = next(a for a in firing if a["labels"]["alertname"] == "DecodeInterference")
        assert interference["labels"]["pool"] == "colocated"
        assert interference["labels"]["severity"] == "warning"
        assert "4.00x slower" in interference["annotations"]["summary"]
        # Nothing else is wrong with this pool: no SLO data, telemetry present.
        assert {a["labels"]["alertname"] for a in firing} == {"DecodeInterference"}
