"""Advise cost per window: one window of 1k, 10k and 100k spans, read incrementally and decided.

    .venv/bin/python bench/advise_windows.py [--spans 1000,10000,100000]

For each size, a ground-truth trace file (tests.synthetic: colocated x4, prompts 800-1600 tokens,
6 requests/s; about 55 spans per request, so the window is spans / 55 / 6 seconds wide) is written (not
timed), then, as `advise --follow` does when that window closes: the file is read through the tail and the
span tables (tracer.advise.tail, accumulate: every record, span by span), the tables are built (`data()`),
and the window is decided (build.decide_window: one report, bootstrap off as advise's default). Wall and
CPU seconds of each part, measured in this run, in one process; the machine's load average is printed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

# The synthetic trace writer lives with the tests (tests/synthetic.py): `python bench/advise_windows.py` from
# the repo root puts bench/ first on the path, so the root is added for it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.synthetic import ground_truth_costs, synthetic_workload, write_traces  # noqa: E402
from tracer.advise.build import decide_window  # noqa: E402
from tracer.advise.follow import Follower  # noqa: E402
from tracer.advise.windows import Window  # noqa: E402
from tracer.report.build import ReportOptions  # noqa: E402
from tracer.report.simulate import SLO, Layout  # noqa: E402

SPANS_PER_REQUEST = 55
RATE_RPS = 6.0


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _since(start: tuple[float, float]) -> tuple[float, float]:
    wall, cpu = _clock()
    return wall - start[0], cpu - start[1]


def measure(spans: int, folder: Path) -> dict[str, float]:
    requests = max(spans // SPANS_PER_REQUEST, 25)
    workload = synthetic_workload(requests, RATE_RPS, prompt_tokens=(800, 1600), output_tokens=(50, 150), seed=1)
    path = folder / f"window-{spans}.jsonl"
    write_traces(path, Layout("colocated", workers=4), workload, ground_truth_costs(), seed=2)
    window_s = float(workload.arrival_s.max()) + 1.0  # the whole file is one window
    follower = Follower([str(path)], ReportOptions(SLO(1.0, 0.1), confidence_resamples=0), window_s, 3, 0.0)

    started = _clock()
    for tail in follower.tails:  # what poll() reads, without closing the window
        for record in tail.poll():
            follower.take_record(tail.path, record.trace_format, record.number, record.data)
    read = _since(started)
    started = _clock()
    data = follower.tables.data([str(path)])
    build = _since(started)
    start_ns = int(data.requests.arrival_ns.min())
    window = Window(start_ns, start_ns + int(window_s * 1e9))
    started = _clock()
    decision = decide_window(data, [window], 0, follower.options)
    decide = _since(started)
    return {
        "spans": follower.stats.spans,
        "requests": len(data.requests),
        "read_s": read[0],
        "read_cpu_s": read[1],
        "tables_s": build[0],
        "decide_s": decide[0],
        "decide_cpu_s": decide[1],
        "verdict": decision.verdict,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", default="1000,10000,100000", help="window sizes in spans, comma-separated")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="advise-bench-") as tmp:
        for spans in (int(s) for s in args.spans.split(",")):
            rows.append(measure(spans, Path(tmp)))
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print("| spans in the window | requests | read (tail + tables, CPU) | build tables | decide (CPU) | "
          "window total | verdict |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        total = r["read_s"] + r["tables_s"] + r["decide_s"]
        print(
            f"| {r['spans']:,} | {r['requests']:,} | {r['read_s']:.2f} s ({r['read_cpu_s']:.2f}) | {r['tables_s']:.2f} s "
            f"| {r['decide_s']:.2f} s ({r['decide_cpu_s']:.2f}) | {total:.2f} s | {r['verdict']} |"
        )


if __name__ == "__main__":
    main()
