"""Report scale: a trace file of about a million spans to a verdict (target <= 15 s, <= 1 GiB peak).

    .venv/bin/python bench/report_scale.py [--spans 1000000] [--keep DIR] [--compare-generic-reader] [--proto]

Generates the file from a ground-truth cost model (tests.synthetic; not timed), then runs
`build_report` in a fresh child process and prints its wall time, peak RSS, the share spent reading the
file (tracer.report.read + our column extraction) and spans per second, all measured in this run.
`--compare-generic-reader` also runs the report with the generic reader (tracer.otlp.iter_spans: a Span
with every attribute for every span), one child after the other, prints the load-time ratio of the two and
checks that both give the same verdict and the same goodput table. `--proto` also writes the same spans as
the OpenTelemetry Collector file exporter's `format: proto` file (4-byte big-endian length, then a
`TracesData` message; not timed), runs the report on it and checks it gives the same verdict and goodput.
The machine's load average is printed before and after: the figures are only as quiet as the machine.
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

import orjson

# The synthetic trace writer lives with the tests (tests/synthetic.py): `python bench/report_scale.py` from
# the repo root puts bench/ first on the path, so the root is added for it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.synthetic import SYNTHETIC_ROUTER, ground_truth_costs, synthetic_workload, write_traces  # noqa: E402
from tracer.report.simulate import Layout  # noqa: E402

_SPANS_PER_REQUEST = 55  # colocated x4, prompts 800-1600, outputs 50-150 at 6 req/s: about 51 steps per request

_CHILD = r"""
import json, resource, sys, time
import tracer.report.tables
if sys.argv[2] == "generic":
    from tracer.otlp import iter_spans
    tracer.report.tables.iter_report_spans = lambda paths, *, skip_bad, stats, steps: iter_spans(
        paths, skip_bad=skip_bad, stats=stats
    )
from tracer.report.build import ReportOptions, report_from_data
from tracer.report.tables import load_traces
from tracer.report.render import headline, render
from tracer.report.simulate import SLO
started, started_cpu = time.perf_counter(), time.process_time()
data = load_traces([sys.argv[1]])
loaded, loaded_cpu = time.perf_counter(), time.process_time()
report = report_from_data(data, ReportOptions(SLO(1.0, 0.1), router=sys.argv[3]))
decided = time.perf_counter()
rendered_json = json.loads(render(report, "json"))
rendered = time.perf_counter()
print(json.dumps({
    "spans": data.read.spans, "requests": len(data.requests), "steps": len(data.steps),
    "load_s": loaded - started, "load_cpu_s": loaded_cpu - started_cpu, "decide_s": decided - loaded, "render_json_s": rendered - decided,
    "total_s": rendered - started, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    "verdict": headline(report), "goodput": rendered_json["goodput"],
    "confidence": rendered_json.get("confidence"), "confidence_resamples": rendered_json.get("confidence_resamples"),
}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=1_000_000)
    parser.add_argument("--keep", type=Path, help="folder to keep (and reuse) the generated trace file in")
    parser.add_argument("--compare-generic-reader", action="store_true")
    parser.add_argument("--proto", action="store_true", help="also read the same spans as a protobuf file")
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
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min)")
    figures = _child(path, "typed")
    print(
        f"file: {path.stat().st_size / 2**20:.0f} MiB, {figures['spans']} spans ({figures['requests']} requests, {figures['steps']} steps)"
    )
    print(
        f"verdict: {figures['verdict']}; confidence {figures['confidence']} ({figures['confidence_resamples']} resamples)"
    )
    print(
        f"total {figures['total_s']:.1f} s (target 15 s: {figures['total_s'] / 15:.2f}x of budget); "
        f"peak RSS {figures['peak_rss_bytes'] / 2**30:.2f} GiB (target 1 GiB: {figures['peak_rss_bytes'] / 2**30:.2f}x)"
    )
    print(
        f"load {figures['load_s']:.1f} s (CPU {figures['load_cpu_s']:.1f} s; {figures['load_s'] / figures['total_s']:.0%} of total, "
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
    if args.proto:
        proto_path = path.with_suffix(".pb")
        if not proto_path.exists():
            _write_proto(path, proto_path)
        proto = _child(proto_path, "typed")
        same = figures["verdict"] == proto["verdict"] and figures["goodput"] == proto["goodput"]
        print(
            f"protobuf file: {proto_path.stat().st_size / 2**20:.0f} MiB, load {proto['load_s']:.1f} s "
            f"({proto['spans'] / proto['load_s']:,.0f} spans/s), total {proto['total_s']:.1f} s, peak RSS "
            f"{proto['peak_rss_bytes'] / 2**30:.2f} GiB; same verdict and goodput table as OTLP/JSON: {'yes' if same else 'NO'}"
        )
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def _write_proto(source: Path, target: Path) -> None:
    """Every OTLP/JSON line of `source` as one length-prefixed TracesData record (the collector file
    exporter's framing), built field by field with the opentelemetry-proto messages."""
    from opentelemetry.proto.trace.v1.trace_pb2 import TracesData

    started = time.perf_counter()
    with open(source, "rb") as lines, open(target, "wb") as out:
        for line in lines:
            message = TracesData()
            for resource_spans in orjson.loads(line)["resourceSpans"]:
                proto_resource_spans = message.resource_spans.add()
                _set_attributes(proto_resource_spans.resource.attributes, resource_spans["resource"]["attributes"])
                for scope_spans in resource_spans["scopeSpans"]:
                    proto_scope_spans = proto_resource_spans.scope_spans.add()
                    for span in scope_spans["spans"]:
                        _add_span(proto_scope_spans.spans.add(), span)
            record = message.SerializeToString()
            out.write(len(record).to_bytes(4, "big") + record)
    print(
        f"wrote {target.stat().st_size / 2**20:.0f} MiB of protobuf in {time.perf_counter() - started:.1f} s (not timed)"
    )


def _add_span(proto, span: dict) -> None:  # type: ignore[no-untyped-def]
    proto.trace_id = bytes.fromhex(span["traceId"])
    proto.span_id = bytes.fromhex(span["spanId"])
    proto.parent_span_id = bytes.fromhex(span.get("parentSpanId", ""))
    proto.name = span["name"]
    proto.kind = span["kind"]
    proto.start_time_unix_nano = int(span["startTimeUnixNano"])
    proto.end_time_unix_nano = int(span["endTimeUnixNano"])
    proto.status.code = span.get("status", {}).get("code", 0)
    _set_attributes(proto.attributes, span["attributes"])
    for event in span.get("events", ()):
        proto_event = proto.events.add(name=event["name"], time_unix_nano=int(event["timeUnixNano"]))
        _set_attributes(proto_event.attributes, event["attributes"])


def _set_attributes(proto, attributes: list) -> None:  # type: ignore[no-untyped-def]
    for kv in attributes:
        value = proto.add(key=kv["key"]).value
        ((field, raw),) = kv["value"].items()  # the synthetic writer uses these four kinds
        if field == "intValue":
            value.int_value = int(raw)
        elif field == "doubleValue":
            value.double_value = float(raw)
        elif field == "boolValue":
            value.bool_value = raw
        else:
            value.string_value = raw


def _child(path: Path, reader: str) -> dict:
    done = subprocess.run(
        # The report simulates the router the traces were written under (tests.synthetic's), as a user
        # passes --router: with the default (least-outstanding) its model check misses and it refuses.
        [sys.executable, "-c", _CHILD, str(path), reader, SYNTHETIC_ROUTER],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
