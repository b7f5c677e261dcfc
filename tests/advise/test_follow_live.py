"""`splitscope advise --follow --metrics-port` as a real process, tailing trace files while they are being
written, scraped by a real Prometheus that evaluates `LayoutChangeAdvised`.

1. A growing file with a change of traffic known by construction (tests.synthetic, as in
   test_advise.py: steady short prompts, stay-colocated; from CHANGE_S on, long prompts, chunked prefill
   wins). The test appends the traces chunk by chunk and waits, after each, for the advisor to print the
   windows the chunk closes. Judged: a window never closes before spans past its end + grace were written
   (the close rule, against what the test wrote); the held advice changes after the switch and not before;
   Prometheus, with the committed rules rendered with a short `for:` (for_scale), has LayoutChangeAdvised
   firing for the chunked-prefill advice only once it is held (not while the steady advice was); and the
   overview's advice panels return data from that Prometheus (the e2e panel test leaves them to this one).
2. A real reference server (`tiny`, colocated) whose load turns from steady short prompts into bursts of
   long prompts halfway, its trace file tailed by the advisor while the server writes it. Judged: windows
   close while the load still runs (the advisor follows, it does not wait for the end), consecutively from
   the first request's arrival, each counting no more requests than arrived in it (counted here from the
   file, independently); a `changed` advice only after the switch; the advisor's series reach Prometheus
   with the namespace the server's spans carry. What the real server's windows decide is not judged: on a
   shared CPU machine the report's model check refuses most short windows (steady short prompts give
   steps too alike for the step fit), so the verdicts are the synthetic case's job.

Nothing sleeps to wait: every wait is `wait_for` on the advisor's output or on Prometheus.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import orjson
import pytest

from tests.advise.test_advise import CHANGE_S, SLO_ITL_S, SLO_TTFT_S
from tests.conftest import REPO_ROOT, free_port, wait_for
from tests.e2e.live import BackgroundLoad, finite_values
from tests.prom import running_prometheus
from tests.reference_server.server_harness import Server
from tests.synthetic import EPOCH_NS, SYNTHETIC_ROUTER, scenario, write_traces
from tracer import spans as s
from tracer.alerts.rules import render_rules_yaml
from tracer.dashboards import advice, overview
from tracer.dashboards.catalogue import dashboard_queries, grafana_to_promql
from tracer.load import BurstSpec, LengthSpec, LoadConfig
from tracer.otlp import SPAN_KIND_SERVER, iter_spans

FOR_SCALE = 0.005  # LayoutChangeAdvised 15m -> 4.5 s
# The grace covers the synthetic requests' lengths (a few seconds of decode): each window then sees all its
# requests when it closes, and decides as the offline advisor does on the whole file.
WINDOW_S, HOLD, GRACE_S = 10.0, 2, 10.0
SPANS_PER_LINE = 500
CHUNKS = 12
DECIDE_WAIT_S = 120.0  # a window's decision is a report (about a second here; several on a busy machine)
# The bootstrap is off (it costs about five times the decision): the confidence series is absent, which
# tests/advise/test_exposition.py checks; its panel target is the one advice query not run here.
CONFIDENCE_QUERY = "splitscope_advice_confidence_ratio"


@dataclass
class Advisor:
    """`python -m tracer.cli.main advise --follow --format json ...`; its stdout lines, parsed, as they come."""

    process: subprocess.Popen[bytes]
    port: int
    lines: list[dict] = field(default_factory=list)
    received_s: list[float] = field(default_factory=list)  # monotonic time each line arrived

    def read(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            self.received_s.append(time.monotonic())
            self.lines.append(json.loads(raw))

    def wait_windows(self, n: int, what: str) -> list[dict]:
        def enough() -> bool:
            if self.process.poll() is not None:
                pytest.fail(f"the advisor exited with {self.process.returncode}")
            return len(self.lines) >= n

        wait_for(enough, DECIDE_WAIT_S, what)
        return self.lines


@pytest.fixture
def start_advisor(tmp_path: Path) -> Iterator:
    started: list[Advisor] = []

    def start(traces: Path, *args: str, window_s: float = WINDOW_S, grace_s: float = GRACE_S) -> Advisor:
        port = free_port()
        command = [sys.executable, "-m", "tracer.cli.main", "advise", str(traces), "--follow", "--format", "json"]
        command += ["--window", f"{window_s:g}s", "--hold", str(HOLD), "--grace", f"{grace_s:g}s"]
        command += ["--poll-interval", "0.2s", "--metrics-port", str(port), *args]
        stderr = open(tmp_path / f"advise-{len(started)}.log", "wb")  # noqa: SIM115  (closed with the process)
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=stderr)
        stderr.close()
        advisor = Advisor(process, port)
        threading.Thread(target=advisor.read, daemon=True).start()
        started.append(advisor)
        # Serving /metrics: its signal handlers are installed (before the server starts), so SIGTERM is clean.
        wait_for(lambda: _answers(f"http://127.0.0.1:{port}/metrics"), 60, "the advisor's /metrics")
        return advisor

    yield start
    for advisor in started:
        if advisor.process.poll() is None:
            advisor.process.send_signal(signal.SIGTERM)
        assert advisor.process.wait(30) == 0  # SIGTERM ends it cleanly


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def _exporter_lines(paths: list[Path], spans_per_line: int) -> list[bytes]:
    """The spans of `paths` re-batched as a live exporter writes them: in end-time order (a span is written
    when it ends), `spans_per_line` to a line, grouped by resource inside each line."""
    resources: dict[bytes, dict] = {}
    spans: list[tuple[int, bytes, dict]] = []
    for path in paths:
        for line in path.read_bytes().splitlines():
            for resource_spans in orjson.loads(line)["resourceSpans"]:
                key = orjson.dumps(resource_spans.get("resource", {}))
                resources[key] = resource_spans.get("resource", {})
                for scope in resource_spans["scopeSpans"]:
                    spans += [(int(span["endTimeUnixNano"]), key, span) for span in scope["spans"]]
    spans.sort(key=lambda item: item[0])
    lines = []
    for start in range(0, len(spans), spans_per_line):
        by_resource: dict[bytes, list[dict]] = {}
        for _, key, span in spans[start : start + spans_per_line]:
            by_resource.setdefault(key, []).append(span)
        batch = [{"resource": resources[k], "scopeSpans": [{"spans": v}]} for k, v in by_resource.items()]
        lines.append(orjson.dumps({"resourceSpans": batch}))
    return lines


def _watermark_ns(lines: list[bytes]) -> int:
    """The latest span end in `lines` (the close rule's clock), read here without the advisor's code."""
    latest = 0
    for line in lines:
        for resource in orjson.loads(line)["resourceSpans"]:
            for scope in resource["scopeSpans"]:
                for span in scope["spans"]:
                    latest = max(latest, int(span["endTimeUnixNano"]))
    return latest


def test_a_change_of_traffic_changes_the_held_advice_and_raises_layout_change_advised(
    tmp_path: Path, start_advisor
) -> None:  # type: ignore[no-untyped-def]
    short = scenario("chatty", n_requests=320)
    long = scenario("long-prompts", n_requests=200)
    shifted = replace(long.workload, arrival_s=long.workload.arrival_s + CHANGE_S)
    write_traces(tmp_path / "steady.jsonl", short.layout, short.workload, short.costs, seed=7)
    write_traces(tmp_path / "long.jsonl", long.layout, shifted, long.costs, seed=8)
    lines = _exporter_lines([tmp_path / "steady.jsonl", tmp_path / "long.jsonl"], SPANS_PER_LINE)
    growing = tmp_path / "growing.jsonl"
    rules = tmp_path / "rules.yaml"
    rules.write_text(render_rules_yaml(for_scale=FOR_SCALE), encoding="utf-8")

    advisor = start_advisor(growing, "--slo-ttft", str(SLO_TTFT_S), "--slo-itl", str(SLO_ITL_S), "--router",
                            SYNTHETIC_ROUTER, "--sim-requests", "100", "--namespace", "team-a")  # fmt: skip
    window_ns, grace_ns = int(WINDOW_S * 1e9), int(GRACE_S * 1e9)
    change_ns = EPOCH_NS + int(CHANGE_S * 1e9)
    with running_prometheus([f"127.0.0.1:{advisor.port}"], rule_files=[rules], job="splitscope-advisor") as prom:
        step = -(-len(lines) // CHUNKS)
        steady_seen = False
        for start in range(0, len(lines), step):
            with open(growing, "ab") as handle:
                handle.write(b"\n".join(lines[start : start + step]) + b"\n")
            # Windows [EPOCH + k W, EPOCH + (k+1) W) whose end + grace the written spans reach: exactly those close.
            closable = max(0, (_watermark_ns(lines[: start + step]) - grace_ns - EPOCH_NS) // window_ns)
            printed = advisor.wait_windows(closable, f"{closable} windows closed")
            assert len(printed) == closable, "a window closed before spans past its end + grace were written"
            if not steady_seen and closable >= CHANGE_S / WINDOW_S:
                steady_seen = True  # every steady window is out and scraped: the alert must be silent
                wait_for(
                    lambda: finite_values(prom.query("sum(splitscope_advice_decisions_total)")) == [closable],
                    30, "the steady windows scraped",
                )  # fmt: skip
                assert prom.query('ALERTS{alertname="LayoutChangeAdvised"}') == []
                assert finite_values(prom.query("splitscope_advice_differs")) == [0.0]

        windows = advisor.lines
        starts = [w["window"]["start_unix_ns"] for w in windows]
        assert starts == [EPOCH_NS + k * window_ns for k in range(len(windows))]
        before = [w for w in windows if w["window"]["end_unix_ns"] <= change_ns]
        after = [w for w in windows if w["window"]["start_unix_ns"] >= change_ns]
        assert len(before) == 4 and len(after) >= HOLD
        assert {w["advice"]["verdict"] for w in before} == {"stay-colocated"}
        assert [w["reason"] for w in before] == ["first", "agreed", "agreed", "agreed"]
        changed = [w for w in windows if w["reason"] == "changed"]
        assert len(changed) == 1 and changed[0] is after[HOLD - 1]  # the HOLD-th window of long prompts
        assert [w["reason"] for w in after[: HOLD - 1]] == ["held"] * (HOLD - 1)
        assert changed[0]["advice"]["verdict"] == "enable-chunked-prefill"
        assert all(w["deployed"] == "colocated" for w in windows)
        # The grace covers every request: each window counted exactly the requests that arrived in it.
        arrivals = _arrivals_ns(growing)
        for w in windows:
            start_ns, end_ns = w["window"]["start_unix_ns"], w["window"]["end_unix_ns"]
            assert w["window"]["requests"] == sum(start_ns <= a < end_ns for a in arrivals), w

        firing = prom.wait_for('ALERTS{alertname="LayoutChangeAdvised", alertstate="firing"}', bool, timeout_s=60)
        (alert,) = firing
        assert (alert["metric"]["namespace"], alert["metric"]["verdict"], alert["metric"]["deployed"]) == (
            "team-a", "enable-chunked-prefill", "colocated",
        )  # fmt: skip
        assert alert["metric"]["target"] == str(changed[0]["advice"]["chunk_budget_tokens"])

        queries = [(t, grafana_to_promql(e)) for uid, t, e in dashboard_queries() if uid == overview.UID]
        panels = [(title, promql) for title, promql in queries if title in advice.PANELS]
        assert {title for title, _ in panels} == set(advice.PANELS)
        empty = [(t, q) for t, q in panels if CONFIDENCE_QUERY not in q and not finite_values(prom.query(q))]
        assert empty == []


# ------------------------------------------------------------------------------------ a real server

PRESET = "tiny"
SERVER_WINDOW_S, SERVER_GRACE_S = 5.0, 2.0
PHASE_S = 15.0  # steady short prompts, then as long with bursts of long prompts
STEADY = {"rate_rps": 6.0, "prompt": LengthSpec(16), "output": LengthSpec(32)}
BURST = BurstSpec(every_s=2.0, count=3, prompt_tokens=1000)


def _arrivals_ns(traces: Path) -> list[int]:
    """Start of every request span in the file (the router's SERVER root spans), read without the advisor."""
    return sorted(
        span.start_ns
        for span in iter_spans([traces], growing=True)
        if span.name.startswith(s.ROOT_SPAN_PREFIXES) and span.kind == SPAN_KIND_SERVER
    )


def test_the_advisor_follows_a_real_server_as_it_writes(tmp_path: Path, start_advisor) -> None:  # type: ignore[no-untyped-def]
    server = Server(tmp_path, "--mode", "colocated", "--workers", "1", "--namespace", "team-live")
    try:
        advisor = start_advisor(
            server.traces_file,
            "--slo-ttft",
            "1",
            "--slo-itl",
            "0.1",
            "--sim-requests",
            "100",
            window_s=SERVER_WINDOW_S,
            grace_s=SERVER_GRACE_S,
        )
        config = LoadConfig(url=server.url, model=PRESET, duration_s=PHASE_S, seed=3, timeout_s=60, **STEADY)
        with running_prometheus([f"127.0.0.1:{advisor.port}"], job="splitscope-advisor") as prom:
            steady = BackgroundLoad(config).start().join()
            switch_ns = time.time_ns()
            bursts = BackgroundLoad(replace(config, burst=BURST, seed=4)).start().join()
            load_end_s = time.monotonic()
            assert steady.summary.ok > 0 and bursts.summary.ok > 0
            # The advisor decides windows while the server writes, not only once the load is over.
            advisor.wait_windows(2, "windows closed during the load")
            assert advisor.received_s[0] < load_end_s
            closed = len(advisor.lines)
            wait_for(
                lambda: finite_values(prom.query('sum(splitscope_advice_decisions_total{namespace="team-live"})'))
                == [float(len(advisor.lines))],
                30, "the advisor's windows scraped with the server's namespace",
            )  # fmt: skip
    finally:
        server.stop()

    windows = [w["window"] for w in advisor.lines[:closed]]
    print(
        "real server windows:",
        [(w["requests"], w["verdict"], line["reason"]) for w, line in zip(windows, advisor.lines, strict=False)],
    )
    arrivals = _arrivals_ns(server.traces_file)
    width_ns = int(SERVER_WINDOW_S * 1e9)
    assert windows[0]["start_unix_ns"] == arrivals[0]
    assert all(a["end_unix_ns"] == b["start_unix_ns"] for a, b in zip(windows, windows[1:], strict=False))
    assert all(w["end_unix_ns"] - w["start_unix_ns"] == width_ns for w in windows)
    for w in windows:
        arrived = sum(w["start_unix_ns"] <= t < w["end_unix_ns"] for t in arrivals)
        assert 0 <= w["requests"] <= arrived, w
    assert sum(w["requests"] for w in windows) > 0
    for line in advisor.lines:
        if line["reason"] == "changed":  # a window of the new traffic is needed to change: only after the switch
            assert line["window"]["end_unix_ns"] > switch_ns, line
    assert os.path.getsize(server.traces_file) > 0
