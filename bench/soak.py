"""Soak: mixed load on the reference server for 10 minutes while its OTLP collector dies and comes back.

Not part of the test suite (it runs for minutes); its results go into bench/RESULTS.md ("## Soak").

Layout: `splitscope serve --mode disaggregated` (1 prefill + 2 decode workers, tiny preset), writing a
traces file and exporting OTLP/HTTP to a collector (`splitscope sidecar` on a fixed port). Every
`--outage-every-s` the collector is SIGKILLed and stays dead for `--outage-s`, so the export queues fill
and drop (counted as `export_queue_full`) and recover, over and over.

Load (tracer.load, open loop): Poisson arrivals at `--rate`, lognormal prompt and output lengths,
sessions sharing a prefix (prefix-cache hits), and bursts of long prompts; every request streams.

Every `--sample-s` it records the RSS (VmRSS) of the router (the launcher process) and each worker, the
merged /metrics drop counters by reason and the pending-records gauge, and the client's request counts.
Printed at the end, and written as JSON with `--out`: the samples, per-process RSS after warm-up / at the
end / at peak with the post-warm-up growth rate (least squares, MiB per hour), drops by reason, errors
and request counts. `--markdown` prints the RESULTS.md section.

Run: `python bench/soak.py --out runs/soak.json --markdown` (10 minutes; `--duration-s 60` for a try).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

# Imported after the path insert so that `python bench/soak.py` runs from a checkout without an install.
from reference_server.launch.process import ServerProcess  # noqa: E402
from tracer.load import BurstSpec, LengthSpec, LoadConfig, RunProgress, run_load_sync  # noqa: E402

DROP_REASONS = ("ring_full", "pending_full", "bad_record", "sidecar_unreachable", "export_queue_full")
MIB = 1 << 20


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except FileNotFoundError:
        return None
    return None


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


def metrics(url: str) -> dict[str, float]:
    """Drop counters by reason, the pending gauge and KV transfer failures from the merged /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    out = {f"dropped_{reason}": 0.0 for reason in DROP_REASONS}
    out.update(pending_records=0.0, kv_transfer_failures=0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "splitscope_tracer_dropped_records_total":
                out[f"dropped_{sample.labels['reason']}"] = (
                    out.get(f"dropped_{sample.labels['reason']}", 0.0) + sample.value
                )
            elif sample.name == "splitscope_tracer_pending_records":
                out["pending_records"] += sample.value
            elif sample.name == "splitscope_kv_transfer_failures_total":
                out["kv_transfer_failures"] += sample.value
    return out


class Collector:
    """`splitscope sidecar` as an OTLP/HTTP collector on a fixed port, which we kill and restart."""

    def __init__(self, port: int, workdir: Path) -> None:
        self.port = port
        self.workdir = workdir
        self.process: subprocess.Popen | None = None
        self.outages = 0

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        command = [
            sys.executable,
            "-c",
            "from tracer.cli.main import main; main()",
            "sidecar",
            "--no-gpu",
            "--no-grpc",
            "--http-port",
            str(self.port),
            "--traces-file",
            str(self.workdir / "collector-traces.jsonl"),
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER_OTLP")}  # no export loop
        with open(self.workdir / "collector.log", "ab") as log:
            self.process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                if self.process.poll() is not None:
                    raise SystemExit(f"collector exited; see {self.workdir / 'collector.log'}") from None
                time.sleep(0.1)  # poll interval while it starts
        raise SystemExit("collector did not listen within 60 s")

    def kill(self) -> None:
        if self.alive:
            self.process.kill()
            self.process.wait(10)
            self.outages += 1


def least_squares_slope(xs: list[float], ys: list[float]) -> float:
    if len(xs) < 2:
        return 0.0
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var if var else 0.0


def summarise(samples: list[dict], warmup_s: float) -> dict:
    names = [k for k in samples[0]["rss"]]
    after = [s for s in samples if s["t_s"] >= warmup_s] or samples
    processes = {}
    for name in names:
        points = [(s["t_s"], s["rss"][name]) for s in after if s["rss"].get(name)]
        all_points = [s["rss"][name] for s in samples if s["rss"].get(name)]
        processes[name] = {
            "rss_start_mib": samples[0]["rss"][name] / MIB,
            "rss_after_warmup_mib": points[0][1] / MIB,
            "rss_end_mib": points[-1][1] / MIB,
            "rss_peak_mib": max(all_points) / MIB,
            "growth_after_warmup_mib": (points[-1][1] - points[0][1]) / MIB,
            "slope_mib_per_hour": least_squares_slope([t for t, _ in points], [r / MIB for _, r in points]) * 3600,
        }
    return processes


def markdown(result: dict) -> str:
    cfg, load, last = result["config"], result["load"], result["samples"][-1]
    lines = [
        "## Soak",
        "",
        (
            f"`python bench/soak.py` ({cfg['duration_s']:.0f} s, {cfg['preset']} preset, disaggregated 1 prefill + 2 decode "
            f"workers, {cfg['rate']:g} req/s Poisson with lognormal lengths, shared-prefix sessions and bursts of "
            f"{cfg['burst']} long prompts; OTLP/HTTP collector SIGKILLed for {cfg['outage_s']:g} s every "
            f"{cfg['outage_every_s']:g} s, {result['collector_outages']} outages; export queues of {cfg['export_queue']} spans). "
            "Same run for every figure below."
        ),
        "",
        (
            f"Requests: {load['scheduled']} scheduled, {load['ok']} ok, {load['errors']} errors "
            f"({', '.join(f'{k} {v}' for k, v in load['errors_by_kind'].items() if v) or 'none'}), "
            f"{load['skipped_inflight_cap']} skipped at the in-flight cap; {load['output_tokens_per_s']:.0f} output tokens/s."
        ),
        "",
        "Drops by reason (all processes, end of run): "
        + ", ".join(f"{r} {last['metrics'][f'dropped_{r}']:.0f}" for r in DROP_REASONS)
        + f"; KV transfer failures {last['metrics']['kv_transfer_failures']:.0f}.",
        "",
        "| process | RSS start MiB | after warm-up | end | peak | growth after warm-up | slope MiB/h |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, p in result["processes"].items():
        lines.append(
            f"| {name} | {p['rss_start_mib']:.1f} | {p['rss_after_warmup_mib']:.1f} | {p['rss_end_mib']:.1f} | "
            f"{p['rss_peak_mib']:.1f} | {p['growth_after_warmup_mib']:+.1f} | {p['slope_mib_per_hour']:+.1f} |"
        )
    lines += [
        "",
        "RSS (MiB) over time, one row a minute:",
        "",
        "| t (s) | collector | " + " | ".join(result["processes"]) + " | ok | errors | dropped export_queue_full |",
        "|---" * (len(result["processes"]) + 5) + "|",
    ]
    next_t, shown_t, samples = 0.0, -60.0, result["samples"]
    for s in samples:
        due = s["t_s"] + 1 >= next_t if s is not samples[-1] else s["t_s"] - shown_t >= 30
        if not due:
            continue  # the first sample of each minute, and the final one unless a row just showed it
        next_t, shown_t = (int(s["t_s"] + 1) // 60 + 1) * 60, s["t_s"]
        rss = " | ".join(f"{(s['rss'].get(n) or 0) / MIB:.1f}" for n in result["processes"])
        lines.append(
            f"| {s['t_s']:.0f} | {'up' if s['collector_alive'] else 'dead'} | {rss} | {s['ok']} | {s['errors']} | "
            f"{s['metrics']['dropped_export_queue_full']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--rate", type=float, default=6.0, help="requests per second (Poisson)")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument("--warmup-s", type=float, default=60.0, help="growth is measured after this")
    parser.add_argument("--outage-every-s", type=float, default=120.0)
    parser.add_argument("--outage-s", type=float, default=40.0)
    parser.add_argument("--burst", type=int, default=3, help="long prompts per burst (every 30 s)")
    parser.add_argument(
        "--export-queue",
        type=int,
        default=2048,
        help="OTEL_BSP_MAX_QUEUE_SIZE of every process (small enough that an outage fills it)",
    )
    parser.add_argument("--workdir", type=Path, default=REPO_ROOT / "runs" / "soak")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON result here")
    parser.add_argument("--markdown", action="store_true", help="print the RESULTS.md section")
    args = parser.parse_args()
    if args.duration_s <= 0 or args.rate <= 0 or args.sample_s <= 0:
        parser.error("--duration-s, --rate and --sample-s must be positive")
    args.workdir.mkdir(parents=True, exist_ok=True)

    collector = Collector(free_port(), args.workdir)
    collector.start()
    os.environ.update(
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{collector.port}",
        OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
        OTEL_BSP_MAX_QUEUE_SIZE=str(args.export_queue),
    )
    traces_file = args.workdir / "traces.jsonl"
    traces_file.unlink(missing_ok=True)
    server = ServerProcess(
        [
            "--preset",
            args.preset,
            "--mode",
            "disaggregated",
            "--prefill-workers",
            "1",
            "--decode-workers",
            "2",
            "--traces-file",
            str(traces_file),
        ],
        log_path=args.workdir / "serve.log",
    )
    server.start()
    try:
        workers = {w["name"]: w["pid"] for w in get_json(server.url + "/health")["workers"]}
        pids = {"router": server.process.pid, **workers}
        config = LoadConfig(
            url=server.url,
            model=args.preset,
            rate_rps=args.rate,
            duration_s=args.duration_s,
            prompt=LengthSpec(160, 0.8, 600),
            output=LengthSpec(48, 0.8, 200),
            burst=BurstSpec(30.0, args.burst, 700),
            sessions=8,
            shared_prefix_tokens=64,
            seed=7,
            timeout_s=120.0,
        )
        progress = RunProgress()
        outcome: dict = {}
        load_thread = threading.Thread(
            target=lambda: outcome.update(result=run_load_sync(config, progress=progress)), daemon=True
        )
        started = time.monotonic()
        load_thread.start()
        samples: list[dict] = []

        def sample(t: float) -> None:
            samples.append(
                {
                    "t_s": round(t, 1),
                    "rss": {name: rss_bytes(pid) for name, pid in pids.items()},
                    "metrics": metrics(server.url),
                    "sent": progress.sent,
                    "ok": progress.ok,
                    "errors": progress.errors,
                    "collector_alive": collector.alive,
                }
            )
            last = samples[-1]
            print(
                f"t={t:5.0f}s ok={last['ok']} errors={last['errors']} collector={'up' if collector.alive else 'dead'} "
                + " ".join(f"{n}={(r or 0) / MIB:.0f}MiB" for n, r in last["rss"].items())
                + f" export_queue_full={last['metrics']['dropped_export_queue_full']:.0f}",
                flush=True,
            )

        next_sample, next_outage, outage_until = 0.0, args.outage_every_s, None
        while load_thread.is_alive():
            t = time.monotonic() - started
            if outage_until is None and next_outage <= t < args.duration_s - args.outage_s:
                collector.kill()
                outage_until, next_outage = t + args.outage_s, next_outage + args.outage_every_s
            elif outage_until is not None and t >= outage_until:
                collector.start()
                outage_until = None
            if t >= next_sample:
                sample(t)
                next_sample += args.sample_s
            load_thread.join(0.2)  # the loop's tick: outages and samples fall due between joins
        if not collector.alive:
            collector.start()  # so the server's final flush has somewhere to go
        sample(time.monotonic() - started)
        load_thread.join()
        load = outcome["result"].summary
    finally:
        server.stop()
        collector.kill()
    result = {
        "config": {
            "duration_s": args.duration_s,
            "rate": args.rate,
            "preset": args.preset,
            "outage_s": args.outage_s,
            "outage_every_s": args.outage_every_s,
            "burst": args.burst,
            "warmup_s": args.warmup_s,
            "export_queue": args.export_queue,
        },
        "load": {
            "scheduled": load.scheduled,
            "ok": load.ok,
            "errors": load.errors,
            "errors_by_kind": load.errors_by_kind,
            "skipped_inflight_cap": load.skipped_inflight_cap,
            "output_tokens_per_s": load.output_tokens_per_s or 0.0,
        },
        "collector_outages": collector.outages,
        "processes": summarise(samples, args.warmup_s),
        "samples": samples,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("load", "collector_outages", "processes")}, indent=1))
    if args.markdown:
        print(markdown(result))


if __name__ == "__main__":
    main()
