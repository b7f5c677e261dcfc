"""End to end: the committed alert rules, rendered with shortened `for:` and range windows from the same
source, in a real Prometheus scraping a real colocated reference server (`small` preset, one worker).

- Steady short prompts (running decodes, no long prompts): DecodeInterference, SplitRecommended and
  ChunkedPrefillRecommended stay inactive, while the recording rules they read have data.
- The same steady stream plus bursts of long prompts: DecodeInterference and one of the two
  recommendations become pending or firing.
- Recurring bursts with quiet stretches between them: a recommendation still comes, judged over a horizon
  (60 s here, an hour in the committed file) longer than the windows (10 s here, 5 minutes there).

The windows are 20 s instead of 5 minutes, so a rule's first evaluations see only a few scrapes. In
production a 5-minute window is always full; the silent case therefore judges the run once one whole window
of load has been scraped (its warm-up would be a window of 2 or 3 scrapes, which no deployment sees).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from reference_server.launch.process import ServerProcess
from tests.e2e.live import BackgroundLoad, finite_values
from tests.prom import PrometheusHandle, running_prometheus
from tracer.alerts.rules import render_rules_yaml
from tracer.alerts.settings import DEFAULT_SETTINGS
from tracer.load import BurstSpec, ClientSLO, LengthSpec, LoadConfig

PRESET = "small"
WINDOW_S = 20  # every range window of every rule (5m, 30m, 1h, 6h in the committed file)
FOR_SCALE = 0.01  # DecodeInterference 10m -> 6 s, the recommendations 15m -> 9 s
STEADY_S = 40.0  # the silent case: two windows of steady load; the second one is judged
INTERFERENCE_LIMIT_S = 120.0  # the interfering load stops as soon as the alerts are seen
ALERT_WAIT_S = 100.0

WATCHED = ("DecodeInterference", "SplitRecommended", "ChunkedPrefillRecommended")
WATCHED_REGEX = "|".join(WATCHED)
RATIO = "pool:splitscope_step_duration_seconds:interference_ratio5m"
STEP_RATE = "pool_prefill_in_step:splitscope_step_duration_seconds_count:rate5m"
ITL_MISS = "pool:splitscope_inter_token_latency_seconds:slo_miss_ratio_rate5m"

# Short prompts with long outputs, often enough that several decodes are always running: every new
# prompt's prefill joins a decode step. On this CPU server such a step costs more than its tokens: the
# worker admits the request, starts its stream and records its spans while the step runs, which made steps
# with a 1-token prefill (the same forward as a decode) 1.11-1.22x as long as decode-only ones over 20 s
# (four runs). 8-token prompts add a causal-attention slice on top: 1.11-1.37x, and windowed peaks of 1.51
# and 1.53 (one in CI) crossed the rule's 1.5x. 2-token prompts are still a real prefill (the causal path)
# and measured 1.09-1.17x (four runs); this test's windowed peak was 1.14-1.32x in five runs. The level moves
# from run to run with the machine, not within a run (the windowed ratio is smooth). Many arrivals per window
# keep the mean of the rarer steps-with-prefill steady: at 3 requests/s (192-token outputs) one run of three
# reached 2.7x in a 20 s window.
STEADY_RATE_RPS, STEADY_PROMPT, STEADY_OUTPUT = 6.0, LengthSpec(2), LengthSpec(96)
# The stream is sized to the machine by the client's in-flight cap, at the worker's batch (16 sequences):
# on a quiet machine 6 requests/s of 96 tokens keep about 12 decodes running, under the cap; on a busy one
# (CI, three cores' worth of other work here) a decode step took 80 ms instead of 20, 6 requests/s were
# twice what the worker could serve, the queue grew for the whole run (time to first token 24-32 s) and the
# requests behind it timed out. With the cap an arrival that finds the batch full is not sent (counted as
# skipped), so the worker runs a full batch of short requests and never queues one: the load this test means.
STEADY_MAX_INFLIGHT = 16
# What bench/interference.py measures, made heavier for one worker: four 2048-token prompts every second
# beside a stream of short requests. That is more prefill work than one worker does in a second however
# fast the machine is (a 2048-token prefill takes 0.3-0.8 s here), so whole prefills stall every running
# decode and the requests queued behind them (up to --max-inflight) pass the 2 s time-to-first-token
# objective. A lighter burst made the test depend on how busy the machine was: on an idle one the same
# four 1024-token prompts a second fit, and no objective was missed.
BURST = BurstSpec(every_s=1.0, count=4, prompt_tokens=2048)
BURST_STREAM_RATE_RPS, BURST_STREAM_PROMPT, BURST_STREAM_OUTPUT = 2.0, LengthSpec(32), LengthSpec(64)

# Recurring bursts: twelve 2048-token prompts every 30 s beside the steady stream of the silent case. Each
# burst is a few seconds of prefill work that queues the stream past the 2 s TTFT objective, so its 10 s
# windows interfere while missing it; before the first burst (and between bursts, where the machine lets the
# queue drain) the stream alone keeps the windows quiet (the silent case's load). The recommendation comes
# once windows that interfered while missing an objective make a quarter of the horizon's (six windows):
# after the first, second or third burst in runs here (50-124 s). The run stops there, and its requests in
# flight are cancelled, not awaited (hundreds of them when the machine is busy). Beside the lighter burst stream (32-token prompts, few running
# decodes) every prefill step was 1.5x a decode step on a busy CI machine and no window was quiet; a client
# in-flight cap starved later bursts (their prompts were never sent), so this load has none.
RECURRING_WINDOW_S, RECURRING_HORIZON_S = 10, 60
RECURRING_BURST = BurstSpec(every_s=30.0, count=12, prompt_tokens=2048)
RECURRING_LIMIT_S = 200.0
ACTIVE = "pool:splitscope_interference:active5m"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log_path = tmp_path_factory.mktemp("e2e-interference") / "serve.log"
    with ServerProcess(["--preset", PRESET, "--mode", "colocated", "--workers", "1"], log_path=log_path) as running:
        yield running


@pytest.fixture
def rules_file(tmp_path: Path) -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text(render_rules_yaml(for_scale=FOR_SCALE, range_override=f"{WINDOW_S}s"), encoding="utf-8")
    return path


def _target(server: ServerProcess) -> str:
    return server.url.removeprefix("http://")


def _load(server: ServerProcess, **overrides: object) -> LoadConfig:
    return LoadConfig(
        url=server.url,
        model=PRESET,
        slo=ClientSLO(ttft_s=DEFAULT_SETTINGS.ttft_slo_s, itl_s=DEFAULT_SETTINGS.itl_slo_s),
        seed=11,
        timeout_s=60,
        **overrides,
    )


def _watched_alerts(prom: PrometheusHandle) -> list[tuple[str, str]]:
    return sorted((a["labels"]["alertname"], a["state"]) for a in prom.alerts() if a["labels"]["alertname"] in WATCHED)


def test_steady_short_prompts_keep_interference_alerts_silent(server: ServerProcess, rules_file: Path) -> None:
    judged_s = int(STEADY_S - WINDOW_S)
    with running_prometheus([_target(server)], rule_files=[rules_file]) as prom:
        prom.wait_targets_up(timeout_s=30)
        load = BackgroundLoad(
            _load(
                server,
                rate_rps=STEADY_RATE_RPS,
                duration_s=STEADY_S,
                prompt=STEADY_PROMPT,
                output=STEADY_OUTPUT,
                max_inflight=STEADY_MAX_INFLIGHT,
            )
        ).start()
        result = load.join()
        # At least one request a second completed (on a quiet machine about six), none failed.
        assert result.summary.errors == 0, result.summary.errors_by_kind
        assert result.summary.ok >= STEADY_S, result.summary

        # Not vacuous: over the judged window both kinds of step ran often enough for the rules to trust
        # the ratio, the ratio and the inter-token miss ratio were computed...
        step_rates = prom.query(f'min_over_time({STEP_RATE}{{pool="colocated"}}[{judged_s}s])')
        assert {s["metric"]["prefill_in_step"] for s in step_rates} == {"true", "false"}
        assert min(finite_values(step_rates)) >= DEFAULT_SETTINGS.interference_min_steps_per_s, step_rates
        ratio_max = finite_values(prom.query(f'max_over_time({RATIO}{{pool="colocated"}}[{judged_s}s])'))
        assert ratio_max, "no interference ratio recorded while the steady load ran"
        print(
            f"steady load: interference ratio peaked at {ratio_max[0]:.2f} over the judged {judged_s} s;"
            f" {result.summary.ok} requests in {result.summary.wall_s:.1f} s"
        )
        assert finite_values(prom.query(f'max_over_time({ITL_MISS}{{pool="colocated"}}[{judged_s}s])'))
        # ...and it stayed under the threshold, so none of the alerts that read it was ever pending.
        assert ratio_max[0] <= DEFAULT_SETTINGS.interference_factor, f"interference ratio reached {ratio_max[0]:.2f}"
        ever_active = prom.query(f'count_over_time(ALERTS{{alertname=~"{WATCHED_REGEX}"}}[{judged_s}s])')
        assert ever_active == []
        assert _watched_alerts(prom) == []


def test_long_prompts_raise_decode_interference_and_a_recommendation(server: ServerProcess, rules_file: Path) -> None:
    with running_prometheus([_target(server)], rule_files=[rules_file]) as prom:
        prom.wait_targets_up(timeout_s=30)
        load = BackgroundLoad(
            _load(
                server,
                rate_rps=BURST_STREAM_RATE_RPS,
                duration_s=INTERFERENCE_LIMIT_S,
                prompt=BURST_STREAM_PROMPT,
                output=BURST_STREAM_OUTPUT,
                burst=BURST,
                max_inflight=16,
            )
        ).start()
        try:
            interference = prom.wait_for('ALERTS{alertname="DecodeInterference"}', bool, timeout_s=ALERT_WAIT_S)
            recommendation = prom.wait_for(
                'ALERTS{alertname=~"SplitRecommended|ChunkedPrefillRecommended"}', bool, timeout_s=ALERT_WAIT_S
            )
            ratio = finite_values(prom.query(f'{RATIO}{{pool="colocated"}}'))
            active = {a["labels"]["alertname"]: a for a in prom.alerts()}
        finally:
            load.stop()
        result = load.join()

    assert result.stopped_early and result.summary.ok > 0
    assert interference[0]["metric"]["pool"] == "colocated"
    assert interference[0]["metric"]["alertstate"] in ("pending", "firing")
    assert recommendation[0]["metric"]["alertstate"] in ("pending", "firing")
    assert ratio and ratio[0] > DEFAULT_SETTINGS.interference_factor
    if "DecodeInterference" in active:
        assert (
            "slower than pure decode steps in pool colocated" in active["DecodeInterference"]["annotations"]["summary"]
        )


def test_recurring_bursts_raise_a_recommendation_judged_over_the_horizon(server: ServerProcess, tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(
        render_rules_yaml(
            for_scale=FOR_SCALE, range_override=f"{RECURRING_WINDOW_S}s", horizon_override=f"{RECURRING_HORIZON_S}s"
        ),
        encoding="utf-8",
    )
    with running_prometheus([_target(server)], rule_files=[rules]) as prom:
        prom.wait_targets_up(timeout_s=30)
        load = BackgroundLoad(
            _load(
                server,
                rate_rps=STEADY_RATE_RPS,
                duration_s=RECURRING_LIMIT_S,
                prompt=STEADY_PROMPT,
                output=STEADY_OUTPUT,
                burst=RECURRING_BURST,
            )
        ).start()
        try:
            recommendation = prom.wait_for(
                'ALERTS{alertname=~"SplitRecommended|ChunkedPrefillRecommended"}', bool, timeout_s=RECURRING_LIMIT_S
            )
            # The pattern recurred rather than interfering throughout: some windows of the run were quiet.
            active = prom.query(f'{ACTIVE}{{pool="colocated"}}[{int(RECURRING_LIMIT_S)}s]')
        finally:
            load.stop()
        result = load.join()

    assert result.summary.ok > 0
    assert recommendation[0]["metric"]["pool"] == "colocated"
    assert recommendation[0]["metric"]["alertstate"] in ("pending", "firing")
    values = [float(v) for series in active for _, v in series["values"]]
    assert 0.0 in values and 1.0 in values, f"interference indicator over the run: {values}"
