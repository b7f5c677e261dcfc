"""End to end, engines without step timing: the oracle's vLLM-shaped `llm_request` spans through real
sidecars into a real Prometheus with the committed rules (shortened `for:` and windows).

Two deployments of the same traffic (the oracle's `medium-max-gap` case on two colocated workers, replayed
at 10x its own timeline), each in its own Prometheus, exactly as stock vLLM would be watched: one sidecar
per engine receiving its `llm_request` spans over OTLP/HTTP and scraping the engine's /metrics (here a
vLLM-named exposition fed with the oracle's own time-to-first-token and token gaps):

- interfering: whole prefills of 500-1500 tokens join decode steps. The oracle's goodput search calls for
  enable-chunked-prefill; DecodeInterference (request-level signal) and ChunkedPrefillRecommended fire.
- free prefills: the same requests on an engine whose prefill tokens cost nothing, so decodes overlap
  prefills as often but are not slowed. Nothing fires.

The rule settings use this case's SLO (1.5 s to the first token, gaps at the 75 ms bucket edge, the case's
80 ms rounded down to an edge) and count a miss when more than 2% of gaps miss: the rules judge token
gaps, while the case's SLO is each request's largest gap, which one interfered step breaks.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from prometheus_client import CollectorRegistry, Histogram

from tests.conftest import free_port
from tests.oracle.cases import CASES, traffic
from tests.oracle.engine import Run, serve
from tests.oracle.observe import observe
from tests.oracle.traces import MODEL, vllm_request_lines
from tests.prom import running_prometheus, serving_registry
from tests.vllm_layouts import VLLM_ITL_BUCKETS_S, VLLM_TTFT_BUCKETS_S
from tracer.alerts.rules import render_rules_yaml
from tracer.alerts.settings import AlertSettings
from tracer.sidecar.server import Sidecar, SidecarConfig
from tracer.vocabulary import Mode, Pool

CASE = CASES["medium-max-gap"]
REQUESTS = 1200
RATE_PER_S = 3.0  # the oracle's timeline; replayed SPEEDUP times faster
SPEEDUP = 10.0
TICK_S = 0.25  # wall seconds between posts of the requests finished meanwhile
SETTINGS = replace(
    AlertSettings(), ttft_slo_s=1.5, itl_slo_s=0.075, itl_fallback_edge_s=0.05, recommend_attainment_ratio=0.98
)
FOR_SCALE = 0.005  # 10m -> 3 s, 15m -> 4.5 s
WINDOW = "20s"  # every 5m window: 200 s of the oracle's timeline
HORIZON = "30s"
RECOMMENDATIONS = ("DecodeInterference", "SplitRecommended", "ChunkedPrefillRecommended")


@dataclass
class Engine:
    """One oracle worker as a stock vLLM: a sidecar (OTLP in, /metrics out) and the engine's /metrics."""

    sidecar: Sidecar
    ttft: Histogram
    itl: Histogram

    def post(self, lines: list[str]) -> None:
        for line in lines:
            request = urllib.request.Request(
                f"http://127.0.0.1:{self.sidecar.http_port}/v1/traces",
                data=line.encode(),
                headers={"Content-Type": "application/json"},
                method="POST",
            )
            with urllib.request.urlopen(request, timeout=10) as response:
                assert response.status == 200


@contextmanager
def deployment(run: Run, stack: ExitStack) -> Iterator[list[str]]:
    """Start one sidecar and one vLLM-named exposition per worker; yields the sidecars' scrape targets and
    replays `run` into them on a thread until the block exits."""
    engines = []
    for worker in range(run.deployment.workers):
        registry = CollectorRegistry()
        # vLLM's own buckets, so the rules' fallback edges are exercised.
        ttft = Histogram(
            "vllm:time_to_first_token_seconds", "TTFT", ["model_name"], buckets=VLLM_TTFT_BUCKETS_S, registry=registry
        )
        itl = Histogram(
            "vllm:inter_token_latency_seconds", "ITL", ["model_name"], buckets=VLLM_ITL_BUCKETS_S, registry=registry
        )
        engine_target = stack.enter_context(serving_registry(registry, free_port()))
        config = SidecarConfig(
            http_port=0,
            grpc_port=None,
            metrics_port=0,
            pool=Pool.COLOCATED,
            worker=f"vllm-{worker}",
            mode=Mode.COLOCATED,
            gpu=False,
            environ={},
            scrape=[("vllm", f"http://{engine_target}/metrics")],
        )
        sidecar = Sidecar(config).start()
        stack.callback(sidecar.stop, 2.0)
        engines.append(Engine(sidecar, ttft.labels(model_name=MODEL), itl.labels(model_name=MODEL)))
    stop = threading.Event()
    thread = threading.Thread(target=_replay, args=(run, engines, stop), daemon=True)
    thread.start()
    try:
        yield [f"127.0.0.1:{e.sidecar.metrics_port}" for e in engines]
    finally:
        stop.set()
        thread.join(10)


def _replay(run: Run, engines: list[Engine], stop: threading.Event) -> None:
    """Each request's span reaches its sidecar when the request ends on the replayed timeline, and its
    TTFT and gaps reach its engine's /metrics then, as vLLM records them."""
    finished = sorted(run.requests, key=lambda r: r.end_s)
    origin_s, started, tick, i = finished[0].arrival_s, time.monotonic(), 0, 0
    while i < len(finished) and not stop.is_set():
        tick += 1
        now_s = origin_s + (time.monotonic() - started) * SPEEDUP
        batch = []
        while i < len(finished) and finished[i].end_s <= now_s:
            batch.append(finished[i])
            i += 1
        for worker, engine in enumerate(engines):
            mine = [r for r in batch if r.prefill_worker == worker]
            if not mine:
                continue
            engine.post(vllm_request_lines(replace(run, requests=mine), worker, seed=tick))
            for r in mine:
                engine.ttft.observe(r.ttft_s)
                for gap in r.gaps_s:
                    engine.itl.observe(float(gap))
        stop.wait(TICK_S)  # replay pacing: the timeline advances with the wall clock


def _alerts_named(prom, names: tuple[str, ...]) -> list[dict]:
    return [a for a in prom.alerts() if a["labels"]["alertname"] in names]


def test_request_level_interference_alerts_fire_for_the_interfering_deployment_only(tmp_path: Path) -> None:
    truth = observe(CASE.name, 0, 0.15)
    assert truth.expected.verdict == "enable-chunked-prefill"  # the oracle's own goodput search
    sample = traffic(CASE, REQUESTS, seed=7)
    free = replace(CASE.physics, per_prefill_token_s=0.0, per_attention_token2_s=0.0)
    runs = {
        name: serve(
            CASE.current,
            sample.at(RATE_PER_S),
            sample.prompt_tokens,
            sample.output_tokens,
            physics,
            noise_sigma=0.03,
            seed=7,
        )
        for name, physics in (("interfering", CASE.physics), ("free", free))
    }
    rules = tmp_path / "rules.yaml"
    rules.write_text(
        render_rules_yaml(for_scale=FOR_SCALE, range_override=WINDOW, settings=SETTINGS, horizon_override=HORIZON),
        encoding="utf-8",
    )

    with ExitStack() as stack:
        targets = {name: stack.enter_context(deployment(run, stack)) for name, run in runs.items()}
        proms = {name: stack.enter_context(running_prometheus(t, rule_files=[rules])) for name, t in targets.items()}
        interfering, quiet = proms["interfering"], proms["free"]

        interfering.wait_for('ALERTS{alertname="DecodeInterference", alertstate="firing"}', bool, timeout_s=120)
        interfering.wait_for('ALERTS{alertname="ChunkedPrefillRecommended", alertstate="firing"}', bool, timeout_s=120)
        fired = _alerts_named(interfering, RECOMMENDATIONS)
        decode = next(a for a in fired if a["labels"]["alertname"] == "DecodeInterference")
        assert decode["labels"]["signal"] == "request_tpot" and decode["labels"]["pool"] == "colocated"
        assert "from request spans" in decode["annotations"]["summary"]
        assert "SplitRecommended" not in {a["labels"]["alertname"] for a in fired}
        chunked = next(a for a in fired if a["labels"]["alertname"] == "ChunkedPrefillRecommended")
        assert "judged from request spans" in chunked["annotations"]["description"]

        # The request-read step ratio is plausible on both: well over the factor where prefills cost
        # time, about 1 where they do not although requests overlap as often.
        ratio = "pool:splitscope_decode_overlap:interference_ratio5m"
        interfering_ratio = float(interfering.query(ratio)[0]["value"][1])
        quiet_ratio = float(quiet.wait_for(ratio, bool, timeout_s=30)[0]["value"][1])
        assert interfering_ratio > 3.0, interfering_ratio
        assert 0.8 < quiet_ratio < 1.2, quiet_ratio
        overlapped = 'pool_prefill_overlap:splitscope_decode_tpot_seconds_count:rate5m{prefill_overlap="true"}'
        assert float(quiet.query(overlapped)[0]["value"][1]) > 1.0  # the free engine overlapped all along
        # Never pending nor firing over the whole run (ALERTS has a sample for every evaluation an alert
        # was active), although the same windows made the interfering deployment's fire.
        assert quiet.query(f'count_over_time(ALERTS{{alertname=~"{"|".join(RECOMMENDATIONS)}"}}[10m])') == []
        print(f"request-read step ratio: interfering {interfering_ratio:.2f}, free prefills {quiet_ratio:.2f}")
