"""`splitscope demo` end to end on the tiny preset: two real servers, load, traces, reports, the table."""

from __future__ import annotations

import json
import subprocess
import sys

from tracer.traces import iter_spans


def test_demo_serves_both_layouts_and_writes_reports(tmp_path):
    completed = subprocess.run(
        [sys.executable, "-m", "tracer.cli", "demo", "--preset", "tiny", "--duration", "4", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=400,
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
        assert summary["verdicts"][layout]["verdict"]
    assert "verdict for the colocated deployment" in completed.stdout
    assert "measured by the client, same workload" in completed.stdout  # the side-by-side table
