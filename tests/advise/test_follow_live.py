"""`splitscope advise --follow --metrics-port` as a real process beside a real reference server, tailing the
trace file the server writes, scraped by a real Prometheus that evaluates `LayoutChangeAdvised`.

A real reference server (`small`, two colocated workers) serving the demo's traffic, which turns bursty
halfway (steady short chats, then bursts of long prompts beside them), its trace file tailed by the
advisor while the server writes it. Judged: windows close while the load still runs, consecutively from
the first request's arrival, each counting no more requests than arrived in it (counted here from the
file, independently); both steady windows advise staying colocated, both bursty windows chunked prefill,
and the held advice changes at the second bursty window, not before; a real Prometheus scrapes the
advisor and fires `LayoutChangeAdvised` with the server's namespace and the colocated deployment.

Nothing sleeps to wait: every wait is `wait_for` on the advisor's output or on Prometheus. Timed (what
the windows decide rests on the interference this machine shows): it runs in the serial phase.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from tests.advise.conftest import FOR_SCALE, arrivals_ns
from tests.conftest import wait_for
from tests.e2e.live import BackgroundLoad, finite_values
from tests.prom import running_prometheus
from tests.reference_server.server_harness import Server
from tracer.alerts.rules import render_rules_yaml
from tracer.load import LoadConfig

# The demo's workload on its model: two colocated `small` workers serving short chats (2 req/s, 96-token
# prompts, 64-token answers); from SWITCH_S on, two 1536-token prompts arrive every BURST_EVERY_S beside
# them, the first BURST_OFFSET_S after the switch: the windows start at the first request's arrival at the
# server, which lags the client's first send by a connection set-up (about 0.1 s, more on a busy machine), so
# a burst sent right at the switch can land in the last steady window. A 1536-token prefill stalls the running decodes past the 100 ms ITL objective (about 1 s a prefill
# here), which chunked prefill removes; 96-token prompts stall nothing. Measured with `splitscope advise` on
# such runs, quiet and beside a busy core: stay-colocated in the steady windows, enable-chunked-prefill in
# the bursty ones.
PRESET = "small"
SERVER_WINDOW_S, SERVER_GRACE_S = 10.0, 4.0
SWITCH_S = 2 * SERVER_WINDOW_S  # two steady windows, then two bursty ones
LOAD_S = 4 * SERVER_WINDOW_S + SERVER_GRACE_S + 2.0  # spans end past the 4th window's end + grace: it closes
STEADY_RPS, SHORT_PROMPT_TOKENS, OUTPUT_TOKENS = 2.0, 96, 64
BURST_EVERY_S, BURST_COUNT, BURST_PROMPT_TOKENS, BURST_OFFSET_S = 5.0, 2, 1536, 1.0
SERVER_SLO = ("--slo-ttft", "2", "--slo-itl", "0.1")


def _write_workload(path: Path, seed: int) -> None:
    """The replay file (`splitscope load --replay`, splitscope JSONL): Poisson short chats over [0, LOAD_S),
    plus BURST_COUNT long prompts at SWITCH_S + BURST_OFFSET_S and every BURST_EVERY_S after. The first
    arrival is at 0, so the advisor's windows (which start at the first arrival) have an edge at SWITCH_S."""
    rng = random.Random(seed)
    rows = [(0.0, SHORT_PROMPT_TOKENS)]
    while (arrival_s := rows[-1][0] + rng.expovariate(STEADY_RPS)) < LOAD_S:
        rows.append((arrival_s, SHORT_PROMPT_TOKENS))
    burst_s = SWITCH_S + BURST_OFFSET_S
    while burst_s < LOAD_S - BURST_EVERY_S:
        rows += [(burst_s, BURST_PROMPT_TOKENS)] * BURST_COUNT
        burst_s += BURST_EVERY_S
    rows.sort()
    path.write_text("".join(json.dumps([a, p, OUTPUT_TOKENS]) + "\n" for a, p in rows), encoding="utf-8")


def _summary(line: dict) -> tuple:
    """One advisor line, short: what the window decided and what it did to the held advice."""
    window = line["window"]
    return window["requests"], window["verdict"], window.get("chunk_budget_tokens"), line["reason"], window["reason"]


def test_the_advisor_follows_a_real_server_and_changes_its_advice_when_traffic_turns_bursty(
    tmp_path: Path, start_advisor
) -> None:  # type: ignore[no-untyped-def]
    workload = tmp_path / "workload.jsonl"
    _write_workload(workload, seed=3)
    rules = tmp_path / "rules.yaml"
    rules.write_text(render_rules_yaml(for_scale=FOR_SCALE), encoding="utf-8")
    server = Server(tmp_path, "--mode", "colocated", "--workers", "2", "--namespace", "team-live", preset=PRESET)
    try:
        advisor = start_advisor(server.traces_file, *SERVER_SLO, window_s=SERVER_WINDOW_S, grace_s=SERVER_GRACE_S)
        config = LoadConfig(url=server.url, model=PRESET, replay_path=str(workload), seed=3, timeout_s=120)
        with running_prometheus([f"127.0.0.1:{advisor.port}"], rule_files=[rules], job="splitscope-advisor") as prom:
            load = BackgroundLoad(config).start().join()
            load_end_s = time.monotonic()
            assert load.summary.errors == 0 and load.summary.ok > 0
            # The advisor decides windows while the server writes, not only once the load is over.
            advisor.wait_windows(4, "the four windows closed")
            assert advisor.received_s[1] < load_end_s
            closed = len(advisor.lines)
            print("real server windows:", [_summary(line) for line in advisor.lines[:closed]])
            wait_for(
                lambda: finite_values(prom.query('sum(splitscope_advice_decisions_total{namespace="team-live"})'))
                == [float(closed)],
                30, "the advisor's windows scraped with the server's namespace",
            )  # fmt: skip
            firing = prom.wait_for('ALERTS{alertname="LayoutChangeAdvised", alertstate="firing"}', bool, 60)
    finally:
        server.stop()

    lines = advisor.lines[:closed]
    windows = [line["window"] for line in lines]
    arrivals = arrivals_ns(server.traces_file)
    width_ns = int(SERVER_WINDOW_S * 1e9)
    switch_ns = arrivals[0] + int(SWITCH_S * 1e9)
    assert windows[0]["start_unix_ns"] == arrivals[0]
    assert all(a["end_unix_ns"] == b["start_unix_ns"] for a, b in zip(windows, windows[1:], strict=False))
    assert all(w["end_unix_ns"] - w["start_unix_ns"] == width_ns for w in windows)
    for w in windows:  # counted here from the file, independently of the advisor
        assert 0 < w["requests"] <= sum(w["start_unix_ns"] <= t < w["end_unix_ns"] for t in arrivals), w
    # Steady short chats: every window decides, and the advice is to stay colocated.
    steady, bursty = lines[:2], lines[2:4]
    assert windows[1]["end_unix_ns"] == switch_ns
    assert [line["window"]["verdict"] for line in steady] == ["stay-colocated"] * 2
    assert [line["advice"]["verdict"] for line in steady] == ["stay-colocated"] * 2
    # Bursts of long prompts: chunked prefill wins both windows, and the held advice changes at the HOLD-th.
    assert [line["window"]["verdict"] for line in bursty] == ["enable-chunked-prefill"] * 2
    assert [line["reason"] for line in bursty] == ["held", "changed"]
    advice = bursty[1]["advice"]
    assert advice["verdict"] == "enable-chunked-prefill" and advice["since_unix_ns"] >= switch_ns
    # Prometheus evaluates the committed rule on the advisor's series: the held advice differs from the
    # colocated deployment the server's spans describe.
    (alert,) = firing
    assert (alert["metric"]["namespace"], alert["metric"]["verdict"], alert["metric"]["deployed"]) == (
        "team-live", "enable-chunked-prefill", "colocated",
    )  # fmt: skip
    assert alert["metric"]["target"] == str(advice["chunk_budget_tokens"])
