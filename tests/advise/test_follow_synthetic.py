"""`splitscope advise --follow --metrics-port` as a real process on traffic known by construction, fed as a
growing file or as OTLP exports, scraped by a real Prometheus that evaluates `LayoutChangeAdvised`.

A change of traffic known by construction (tests.synthetic, as in test_advise.py: steady short prompts,
stay-colocated; from CHANGE_S on, long prompts, chunked prefill wins), fed to the advisor twice: as a
growing file, and through --otlp-port by the OpenTelemetry SDK's OTLP/HTTP exporter (no file for the
advisor). The test feeds the traces chunk by chunk and waits, after each, for the advisor to print the
windows the chunk closes. Judged, for both feeds: a window never closes before spans past its end + grace
were sent (the close rule, against what the test sent); the held advice changes after the switch and not
before; Prometheus, with the committed rules rendered with a short `for:` (for_scale), has
LayoutChangeAdvised firing for the chunked-prefill advice only once it is held (not while the steady advice
was); and the overview's advice panels return data from that Prometheus (the e2e panel test leaves them to
this one).

Nothing sleeps to wait: every wait is `wait_for` on the advisor's output or on Prometheus. Untimed (the
synthetic spans carry their own times): it runs beside the unit tests.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import orjson
import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export import SpanExportResult

from tests.advise.conftest import FOR_SCALE, HOLD, arrivals_ns
from tests.advise.test_advise import CHANGE_S, SLO_ITL_S, SLO_TTFT_S
from tests.conftest import free_port, wait_for
from tests.e2e.live import finite_values
from tests.prom import running_prometheus
from tests.synthetic import EPOCH_NS, SYNTHETIC_ROUTER, scenario, write_traces
from tracer.alerts.rules import render_rules_yaml
from tracer.dashboards import advice, overview
from tracer.dashboards.catalogue import dashboard_queries, grafana_to_promql
from tracer.export.otel import to_readable_span
from tracer.otlp.requests import decode_json

# The grace covers the synthetic requests' lengths (a few seconds of decode): each window then sees all its
# requests when it closes, and decides as the offline advisor does on the whole file.
WINDOW_S, GRACE_S = 10.0, 10.0
SPANS_PER_LINE = 500
CHUNKS = 12
# The file-fed advisor runs without the bootstrap (the default: it costs about five times the decision), so
# its confidence series is absent (tests/advise/test_exposition.py checks that); the OTLP-fed one runs each
# live window's bootstrap, and there every advice panel, the confidence target included, must show data.
CONFIDENCE_QUERY = "splitscope_advice_confidence_ratio"
CONFIDENCE_RESAMPLES = 20


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


class OtlpFeed:
    """Sends exporter lines to the advisor's --otlp-port with the OpenTelemetry SDK's OTLP/HTTP exporter
    (protobuf), one export per line, as a service's BatchSpanProcessor would; keeps a copy of what it sent."""

    def __init__(self, port: int, copy: Path) -> None:
        self.exporter = OTLPSpanExporter(endpoint=f"http://127.0.0.1:{port}/v1/traces")
        self.copy = copy

    def send(self, lines: list[bytes]) -> None:
        for line in lines:
            spans = [to_readable_span(span, Resource(attributes)) for attributes, batch in decode_json(line)
                     for span in batch]  # fmt: skip
            assert self.exporter.export(spans) == SpanExportResult.SUCCESS
        with open(self.copy, "ab") as handle:
            handle.write(b"\n".join(lines) + b"\n")


@pytest.mark.parametrize("feed", ["file", "otlp"])
def test_a_change_of_traffic_changes_the_held_advice_and_raises_layout_change_advised(
    tmp_path: Path, start_advisor, feed: str
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

    otlp_port = free_port()
    source = (
        ["--otlp-port", str(otlp_port), "--confidence-resamples", str(CONFIDENCE_RESAMPLES)] if feed == "otlp" else []
    )
    advisor = start_advisor(growing if feed == "file" else None, "--slo-ttft", str(SLO_TTFT_S), "--slo-itl",
                            str(SLO_ITL_S), "--router", SYNTHETIC_ROUTER, "--sim-requests", "100", "--namespace",
                            "team-a", *source, window_s=WINDOW_S, grace_s=GRACE_S)  # fmt: skip
    otlp = OtlpFeed(otlp_port, growing) if feed == "otlp" else None
    window_ns, grace_ns = int(WINDOW_S * 1e9), int(GRACE_S * 1e9)
    change_ns = EPOCH_NS + int(CHANGE_S * 1e9)
    with running_prometheus([f"127.0.0.1:{advisor.port}"], rule_files=[rules], job="splitscope-advisor") as prom:
        step = -(-len(lines) // CHUNKS)
        steady_seen = False
        for start in range(0, len(lines), step):
            if otlp is not None:
                otlp.send(lines[start : start + step])
            else:
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
        if feed == "otlp":  # each live window ran its bootstrap: a confidence in (0, 1] per decided window
            assert all(
                0 < w["window"]["confidence"] <= 1 for w in windows if w["window"]["verdict"] != "insufficient-data"
            )
        # The grace covers every request: each window counted exactly the requests that arrived in it.
        arrivals = arrivals_ns(growing)
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
        skipped = CONFIDENCE_QUERY if feed == "file" else "no query skipped"
        empty = [(t, q) for t, q in panels if skipped not in q and not finite_values(prom.query(q))]
        assert empty == []
