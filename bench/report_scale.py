"""Report scale: a trace file of about a million spans to a verdict (target <= 15 s, <= 1 GiB peak).

    .venv/bin/python bench/report_scale.py [--spans 1000000] [--keep DIR] [--compare-generic-reader]

Generates the file from a ground-truth cost model (tracer.report.synthetic; not timed), then runs
`build_report` in a fresh child process and prints its wall time, peak RSS, the share spent reading the
file (tracer.report.read + our column extraction) and spans per second, all measured in this run.
`--compare-generic-reader` also runs the report with the generic reader (tracer.traces.iter_spans: a Span
with every attribute for every span), one child after the other, prints the load-time ratio of the two and
checks that both give the same verdict and the same goodput table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tracer.report.simulate import Layout
from tracer.report.synthetic import ground_truth_costs, synthetic_workload, write_traces

_SPANS_PER_REQUEST = 55  # colocated x4, prompts 800-1600, outputs 50-150 at 6 req/s: about 51 steps per request

_CHILD = r"""
import json, resource, sys, time
import tracer.report.tables
if sys.argv[2] == "generic":
    from tracer.traces import iter_spans
    tracer.report.tables.iter_report_spans = lambda paths, *, skip_bad, stats, steps: iter_spans(
        paths, skip_bad=skip_bad, stats=stats
    )
from tracer.report.build import ReportOptions, report_from_data
from tracer.report.tables import load_traces
from tracer.report.render import headline, render
from tracer.report.simulate import SLO
started = time.perf_counter()
data = load_traces([sys.argv[1]])
loaded = time.perf_counter()
report = report_from_data(data, ReportOptions(SLO(1.0, 0.1)))
decided = time.perf_counter()
rendered_json = json.loads(render(report, "json"))
rendered = time.perf_counter()
print(json.dumps({
    "spans": data.read.spans, "requests": len(data.requests), "steps": len(data.steps),
    "load_s": loaded - started, "decide_s": decided - loaded, "render_json_s": rendered - decided,
    "total_s": rendered - started, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    "verdict": headline(report), "goodput": rendered_json["goodput"],
}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=1_000_000)
    parser.add_argument("--keep", type=Path, help="folder to keep (and reuse) the generated trace file in")
    parser.add_argument("--compare-generic-reader", action="store_true")
    args = parser.parse_args()
    folder = args.keep or Path(tempfile.mkdtemp(prefix="report-scale-"))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"scale-{args.spans}.jsonl"
    if not path.exists():
        started = time.perf_counter()
        n_requests = max(20, args.spans // _SPANS_PER_REQUEST)
        workload = synthetic_workload(n_requests, 6.0, prompt_tokens=(800, 1600), output_tokens=(50, 150), seed=11)
        write_traces(path, Layout("colocated", workers=4), workload, ground_truth_costs(), noise_sigma=0.05, seed=11)
        print(
            f"generated {path.stat().st_size / 2**20:.0f} MiB in {time.perf_counter() - started:.1f} s (not part of the figures)"
        )
    figures = _child(path, "typed")
    print(
        f"file: {path.stat().st_size / 2**20:.0f} MiB, {figures['spans']} spans ({figures['requests']} requests, {figures['steps']} steps)"
    )
    print(f"verdict: {figures['verdict']}")
    print(
        f"total {figures['total_s']:.1f} s (target 15 s: {figures['total_s'] / 15:.2f}x of budget); "
        f"peak RSS {figures['peak_rss_bytes'] / 2**30:.2f} GiB (target 1 GiB: {figures['peak_rss_bytes'] / 2**30:.2f}x)"
    )
    print(
        f"load {figures['load_s']:.1f} s ({figures['load_s'] / figures['total_s']:.0%} of total, "
        f"{figures['spans'] / figures['load_s']:,.0f} spans/s); decide {figures['decide_s']:.1f} s; render json {figures['render_json_s']:.2f} s"
    )
    if args.compare_generic_reader:
        generic = _child(path, "generic")
        print(
            f"generic reader: load {generic['load_s']:.1f} s, total {generic['total_s']:.1f} s, peak RSS "
            f"{generic['peak_rss_bytes'] / 2**30:.2f} GiB, verdict {generic['verdict']}; typed/generic load time "
            f"{figures['load_s'] / generic['load_s']:.2f}"
        )
        same = figures["verdict"] == generic["verdict"] and figures["goodput"] == generic["goodput"]
        print(f"same verdict and goodput table with both readers: {'yes' if same else 'NO'}")


def _child(path: Path, reader: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), reader],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
