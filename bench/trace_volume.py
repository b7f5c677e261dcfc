"""Trace volume: bytes per request on the wire, OTLP/JSON and OTLP protobuf, by sampling setting.

    .venv/bin/python bench/trace_volume.py [--preset small] [--duration 30] [--layout colocated]

Serves the demo's layout and workload (reference_server/launch/demo.py: short chats plus bursts of long prompts)
twice, with every step span (`--step-sample 1`) and at the default rate, both with the demo's SLOs on the
router (`--slo-ttft 2 --slo-itl 0.1`), and measures what the traces files hold. Then it applies the
sidecar's tail sampler (tracer/sidecar/tail_sampler.py, `--keep-violations --sample-rate R`) to the
default run's spans: once as they are (the run's own SLO violators kept whole), once as if every request
had met its SLOs (the steady state). Bytes per request = the bytes of the kept spans, encoded as the
exporters send them (one ExportTraceServiceRequest per exported batch, as in the file), over all the
run's requests. Also prints the report's verdict on each run's traces (full and sampled steps), and on
the first run's step spans thinned by the exporter's rule (tests/report/sampled_traces.py): the same
requests and steps, only sampled, so that verdict must equal the first one.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import tempfile
from pathlib import Path

from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)

# The step sampling of a written file lives with the tests (tests/report/sampled_traces.py): `python
# bench/trace_volume.py` from the repo root puts bench/ first on the path, so the root is added for it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reference_server.launch.demo import LAYOUTS, DemoWorkload, _kv_bytes_per_token, _load_config  # noqa: E402
from reference_server.launch.process import ServerProcess  # noqa: E402
from reference_server.launch.serve import ServeConfig  # noqa: E402
from tests.report.sampled_traces import sample_step_spans  # noqa: E402
from tracer import spans as s  # noqa: E402
from tracer.load import run_load_sync  # noqa: E402
from tracer.report.build import ReportOptions, build_report  # noqa: E402
from tracer.report.render import headline  # noqa: E402
from tracer.report.simulate import SLO  # noqa: E402
from tracer.sidecar.tail_sampler import TailSampler  # noqa: E402
from tracer.step_sampling import DEFAULT_DECODE_SAMPLE_EVERY  # noqa: E402

TARGET_BYTES_PER_REQUEST = 2048
_ID_FIELDS = ("traceId", "spanId", "parentSpanId")


def _protobuf_bytes(request: dict) -> int:
    """The request's OTLP protobuf size. OTLP/JSON carries ids as hex; protobuf's JSON mapping wants base64."""
    request = json.loads(json.dumps(request))
    for resource_spans in request["resourceSpans"]:
        for scope_spans in resource_spans["scopeSpans"]:
            for span in scope_spans["spans"]:
                for key in _ID_FIELDS:
                    if span.get(key):
                        span[key] = base64.b64encode(bytes.fromhex(span[key])).decode()
                for link in span.get("links", ()):
                    for key in ("traceId", "spanId"):
                        link[key] = base64.b64encode(bytes.fromhex(link[key])).decode()
    return len(json_format.ParseDict(request, ExportTraceServiceRequest()).SerializeToString())


def _json_bytes(request: dict) -> int:
    return len(json.dumps(request, separators=(",", ":")).encode())


def _attribute(raw: dict, key: str):
    for attribute in raw.get("attributes", ()):
        if attribute["key"] == key:
            return next(iter(attribute["value"].values()))
    return None


def volume(path: Path, tail: TailSampler | None, *, forget_violations: bool = False) -> dict:
    """Bytes per request of the spans of `path` that `tail` keeps (all without it)."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    requests = sum(
        1
        for r in lines
        for rs in r["resourceSpans"]
        for ss in rs["scopeSpans"]
        for sp in ss["spans"]
        if sp.get("kind") == s.KIND_SERVER
    )
    kept_ids: set[int] | None = None
    violators: int | str = "-"  # counted where the tail sampler reads them
    if tail is not None:
        # The sampler sees each span as the sidecar would (its id standing in for the span), in file order.
        everything = []
        violators = 0
        for line_index, request in enumerate(lines):
            for rs in request["resourceSpans"]:
                for ss in rs["scopeSpans"]:
                    for raw in ss["spans"]:
                        violated = _attribute(raw, s.ATTR_SLO_VIOLATED) is True and not forget_violations
                        error = (raw.get("status") or {}).get("code") == 2
                        violators += bool(violated)
                        everything.append(
                            s.SpanData(
                                raw["name"],
                                raw.get("kind", s.KIND_INTERNAL),
                                int(raw["traceId"], 16),
                                id(raw),
                                0,
                                0,
                                0,
                                {s.ATTR_SLO_VIOLATED: violated},
                                error_type="error" if error else "",
                            )
                        )
        released = tail.offer("all", everything) + tail.flush()
        kept_ids = {span.span_id for _, batch in released for span in batch}
    json_total = protobuf_total = spans_kept = 0
    for request in lines:
        kept_request = {"resourceSpans": []}
        for rs in request["resourceSpans"]:
            scopes = []
            for ss in rs["scopeSpans"]:
                spans = [raw for raw in ss["spans"] if kept_ids is None or id(raw) in kept_ids]
                if spans:
                    scopes.append({**ss, "spans": spans})
                    spans_kept += len(spans)
            if scopes:
                kept_request["resourceSpans"].append({**rs, "scopeSpans": scopes})
        if kept_request["resourceSpans"]:
            json_total += _json_bytes(kept_request)
            protobuf_total += _protobuf_bytes(kept_request)
    return {
        "requests": requests,
        "spans": spans_kept,
        "violators": violators,
        "json_per_request": json_total / requests,
        "protobuf_per_request": protobuf_total / requests,
    }


def run(folder: Path, preset: str, layout: str, workload: DemoWorkload, slo: SLO, step_sample: int) -> Path:
    traces = folder / f"{layout}-step{step_sample}.jsonl"
    args = [
        "--preset",
        preset,
        "--traces-file",
        str(traces),
        *LAYOUTS[layout],
        "--step-sample",
        str(step_sample),
        "--slo-ttft",
        str(slo.ttft_s),
        "--slo-itl",
        str(slo.itl_s),
    ]
    server = ServerProcess(args, log_path=folder / f"{layout}-step{step_sample}.log").start()
    try:
        result = run_load_sync(_load_config(server.url, preset, workload, slo))
    finally:
        server.stop()
    print(f"  step-sample {step_sample}: {result.summary.ok} ok / {result.summary.errors} errors", flush=True)
    return traces


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="colocated")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of load per run")
    parser.add_argument("--sample-rate", type=float, default=0.1, help="tail sampler's share of non-violating traces")
    parser.add_argument("--slo-ttft", type=float, default=2.0)
    parser.add_argument("--slo-itl", type=float, default=0.1)
    parser.add_argument("--keep", type=Path, help="folder to keep the traces in")
    args = parser.parse_args()
    folder = args.keep or Path(tempfile.mkdtemp(prefix="trace-volume-"))
    folder.mkdir(parents=True, exist_ok=True)
    workload = DemoWorkload(duration_s=args.duration)
    slo = SLO(args.slo_ttft, args.slo_itl)
    print(
        f"{args.layout}, {args.preset}, demo workload for {args.duration:g} s, SLO ttft {slo.ttft_s:g} s itl {slo.itl_s:g} s"
    )
    full = run(folder, args.preset, args.layout, workload, slo, 1)
    sampled = run(folder, args.preset, args.layout, workload, slo, DEFAULT_DECODE_SAMPLE_EVERY)
    rows = [
        ("every step span, no tail sampling", volume(full, None)),
        (f"steps 1 in {DEFAULT_DECODE_SAMPLE_EVERY} (default), no tail sampling", volume(sampled, None)),
        (
            f"default steps + sidecar --keep-violations --sample-rate {args.sample_rate:g}",
            volume(sampled, TailSampler(args.sample_rate, keep_violations=True)),
        ),
        (
            "  the same, no request violating its SLOs (steady state)",
            volume(sampled, TailSampler(args.sample_rate, keep_violations=True), forget_violations=True),
        ),
    ]
    print(f"\n{'setting':<70} {'requests':>8} {'violators':>9} {'spans':>7} {'JSON B/req':>10} {'proto B/req':>11}")
    for label, row in rows:
        print(
            f"{label:<70} {row['requests']:>8} {row['violators']:>9} {row['spans']:>7} "
            f"{row['json_per_request']:>10,.0f} {row['protobuf_per_request']:>11,.0f}"
        )
    steady = rows[-1][1]
    print(
        f"\nsteady state: {steady['protobuf_per_request']:,.0f} B/request OTLP protobuf, "
        f"{steady['json_per_request']:,.0f} B/request OTLP/JSON (target {TARGET_BYTES_PER_REQUEST} B)"
    )
    # The same run's step spans thinned by the exporter's own rule (weighted): the one comparison where
    # only sampling differs, so the verdicts must agree; the second run's differs in its noise too.
    thinned = folder / f"{args.layout}-step1-sampled.jsonl"
    seen, kept = sample_step_spans(full, thinned)
    print(f"\nthe first run's {seen} step spans sampled as a worker would: {kept} kept (weighted)")
    options = ReportOptions(slo, kv_bytes_per_token=_kv_bytes_per_token(args.preset), max_batch=ServeConfig.max_batch)
    for label, path in (
        ("every step span (first run)", full),
        ("the first run's step spans, sampled", thinned),
        (f"the second run (served with steps 1 in {DEFAULT_DECODE_SAMPLE_EVERY})", sampled),
    ):
        print(f"report on {label}: {headline(build_report([path], options))}")


if __name__ == "__main__":
    main()
