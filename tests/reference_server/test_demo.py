"""`splitscope demo` end to end on the tiny preset: two real servers, load, traces, reports, the table."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

from tracer import spans as s
from tracer.traces import iter_spans
from tracer.vocabulary import Verdict


def test_demo_serves_both_layouts_and_writes_reports(tmp_path):
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "tracer.cli.main",
            "demo",
            "--preset",
            "tiny",
            "--duration",
            "7",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(summary["layouts"]) == {"colocated", "disaggregated"}
    for layout, load in summary["layouts"].items():
        assert load["ok"] > 0 and load["errors"] == 0, (layout, load)
        names = {span.name for span in iter_spans([run_dir / layout / "traces.jsonl"])}
        assert {"text_completion tiny", "splitscope.prefill", "splitscope.decode", "splitscope.step"} <= names
        if layout == "disaggregated":
            assert {"splitscope.kv_transfer", "splitscope.kv_transfer.send", "splitscope.kv_transfer.recv"} <= names
        for suffix in ("md", "html", "json"):
            assert (run_dir / layout / f"report.{suffix}").stat().st_size > 0
        report = json.loads((run_dir / layout / "report.json").read_text())
        assert report["current_layout"] == ("colocated x2" if layout == "colocated" else "split 1:1")
        assert report["verdict"] == summary["verdicts"][layout]["verdict"]
        if report["verdict"] == Verdict.INSUFFICIENT_DATA:  # honest, but never without its reasons
            assert report["evidence"] and (report["unconfirmed_best_guess"] or report["read"]["requests"] < 20)
    # The workload's bursts of long prompts land in colocated decode steps: the raw step spans show it.
    steps = [x for x in iter_spans([run_dir / "colocated" / "traces.jsonl"]) if x.name == s.SPAN_STEP]
    with_long_prefill = [x.duration_s for x in steps if x.attributes[s.ATTR_STEP_PREFILL_TOKENS] >= 512]
    decode_only = [x.duration_s for x in steps if x.attributes[s.ATTR_STEP_PREFILL_TOKENS] == 0]
    assert with_long_prefill and decode_only
    assert statistics.median(with_long_prefill) > 1.5 * statistics.median(decode_only)
    assert "verdict for the colocated deployment" in completed.stdout
    assert "measured by the client, same workload" in completed.stdout  # the side-by-side table
