"""Prefill/decode interference, measured: the same workload through colocated, chunked and disaggregated.

Each mode runs the reference server (`splitscope serve`, same preset, same number of worker processes:
2 colocated/chunked workers, or 1 prefill + 1 decode) under one open-loop workload from `tracer.load`:
a steady stream of short prompts with long outputs (the running decodes) plus, every few seconds, one
long prompt. After the load, the server's merged /metrics gives the step durations split by
`prefill_in_step` and the server-side inter-token latency; the load result gives what clients saw.

Printed ratios all come from this one run:
- interference factor = mean step time with prefill tokens / without (colocated and chunked workers);
- inter-token latency p99 of colocated and chunked over disaggregated (client-side, every gap).

Run: `python bench/interference.py` (about 2 minutes on a 2-core CPU machine). `--quick` shortens it.
The default workload puts one long prompt in every 0.75 s: often enough that the stalls it causes in a
colocated worker are more than 1% of all inter-token gaps, so they show in p99.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tracer.load import BurstSpec, ClientSLO, LengthSpec, LoadConfig, run_load_sync

REPO_ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def layouts(chunk_budget: int) -> dict[str, list[str]]:
    return {
        "colocated": ["--mode", "colocated", "--workers", "2"],
        "chunked": ["--mode", "chunked", "--workers", "2", "--chunk-budget", str(chunk_budget)],
        "disaggregated": ["--mode", "disaggregated", "--prefill-workers", "1", "--decode-workers", "1"],
    }


def start_server(preset: str, layout: list[str], port: int, log_path: Path) -> subprocess.Popen:
    command = ["serve", "--preset", preset, "--port", str(port), *layout]
    return start_answering(command, f"http://127.0.0.1:{port}/health", log_path, timeout_s=300)


def start_answering(cli_args: list[str], url: str, log_path: Path, timeout_s: float, nice: int = 0) -> subprocess.Popen:
    """Start `splitscope <cli_args>` at CPU priority `nice` (set before it starts: its threads inherit it),
    output to `log_path`; return once `url` answers 200. Exits the bench if it dies or never answers."""
    command = ["nice", "-n", str(nice), sys.executable, "-c", "from tracer.cli.main import main; main()", *cli_args]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"`splitscope {cli_args[0]}` exited early; see {log_path}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return process
        except OSError:
            pass
        time.sleep(0.2)
    process.kill()
    raise SystemExit(f"`splitscope {cli_args[0]}` did not answer {url} in {timeout_s:.0f} s; see {log_path}")


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    # Each worker's series carry its `worker` (and `namespace`) label; add them up per pool here, as a
    # `sum by` would in Prometheus.
    samples: dict[tuple[str, tuple], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k not in ("worker", "namespace")))
            key = (sample.name, labels)
            samples[key] = samples.get(key, 0.0) + sample.value
    return samples


def scrape_when_complete(port: int, requests_ok: int, timeout_s: float = 15.0) -> dict[tuple[str, tuple], float]:
    """The merged metrics once the router's spans of every answered request reached them (the pipelines
    export a few times a second)."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(port)
        counted = sum(v for (name, _), v in samples.items() if name == "gen_ai_server_request_duration_seconds_count")
        if counted >= requests_ok or time.monotonic() > deadline:
            return samples
        time.sleep(0.2)


def step_means_ms(samples: dict, pool: str) -> tuple[float | None, float | None, int, int]:
    """Mean step time (ms) with and without prefill tokens on `pool`, and the step counts."""
    out = []
    for in_step in ("true", "false"):
        labels = (("pool", pool), ("prefill_in_step", in_step))
        count = samples.get(("splitscope_step_duration_seconds_count", labels), 0.0)
        total = samples.get(("splitscope_step_duration_seconds_sum", labels), 0.0)
        out.append((1000 * total / count if count else None, int(count)))
    return out[0][0], out[1][0], out[0][1], out[1][1]


def histogram_quantile(samples: dict, name: str, labels: tuple, q: float) -> float | None:
    """Prometheus-style quantile from cumulative buckets (linear within a bucket)."""
    buckets = sorted(
        (float(dict(series)["le"]), v)
        for (n, series), v in samples.items()
        if n == name + "_bucket" and tuple(x for x in series if x[0] != "le") == labels
    )
    if not buckets or buckets[-1][1] == 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / max(count - lower_count, 1e-9)
        lower_bound, lower_count = bound, count
    return None


def run_mode(mode: str, layout: list[str], opts: argparse.Namespace, work_dir: Path) -> dict:
    port = free_port()
    print(f"[{mode}] starting {' '.join(layout)}", file=sys.stderr, flush=True)
    process = start_server(opts.preset, layout, port, work_dir / f"{mode}.log")
    try:
        config = LoadConfig(
            url=f"http://127.0.0.1:{port}",
            model=opts.preset,
            rate_rps=opts.rate,
            duration_s=opts.duration,
            prompt=LengthSpec(opts.prompt_tokens),
            output=LengthSpec(opts.output_tokens),
            burst=BurstSpec(every_s=opts.burst_every, count=1, prompt_tokens=opts.long_prompt_tokens),
            slo=ClientSLO(ttft_s=opts.slo_ttft, itl_s=opts.slo_itl),
            seed=opts.seed,
            timeout_s=120,
        )
        print(
            f"[{mode}] load: {opts.rate} rps x {opts.duration:g} s + one {opts.long_prompt_tokens}-token prompt "
            f"every {opts.burst_every:g} s",
            file=sys.stderr,
            flush=True,
        )
        result = run_load_sync(config)
        samples = scrape_when_complete(port, result.summary.ok)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
    summary = result.summary
    pool = "decode" if mode == "disaggregated" else "colocated"
    with_ms, without_ms, with_n, without_n = step_means_ms(samples, pool if mode != "disaggregated" else "decode")
    if mode == "disaggregated":
        with_ms, _, with_n, _ = step_means_ms(samples, "prefill")
    itl_server_p99 = histogram_quantile(samples, "splitscope_inter_token_latency_seconds", (("pool", pool),), 0.99)
    latency = summary.latency
    return {
        "mode": mode,
        "requests_ok": summary.ok,
        "errors": summary.errors,
        "step_with_prefill_ms": with_ms,
        "step_without_prefill_ms": without_ms,
        "steps_with_prefill": with_n,
        "steps_without_prefill": without_n,
        "interference_factor": (with_ms / without_ms) if with_ms and without_ms and mode != "disaggregated" else None,
        "itl_p50_ms": 1000 * latency["itl_s"].p50 if latency["itl_s"].p50 is not None else None,
        "itl_p99_ms": 1000 * latency["itl_s"].p99 if latency["itl_s"].p99 is not None else None,
        "itl_server_p99_ms": 1000 * itl_server_p99 if itl_server_p99 is not None else None,
        "ttft_p50_ms": 1000 * latency["ttft_s"].p50 if latency["ttft_s"].p50 is not None else None,
        "ttft_p99_ms": 1000 * latency["ttft_s"].p99 if latency["ttft_s"].p99 is not None else None,
        "slo_attainment": summary.attainment,
    }


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--rate", type=float, default=3.0, help="short requests per second (the decodes)")
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=96)
    parser.add_argument("--long-prompt-tokens", type=int, default=1024)
    parser.add_argument("--burst-every", type=float, default=0.75, help="seconds between long prompts")
    parser.add_argument("--chunk-budget", type=int, default=128)
    parser.add_argument("--slo-ttft", type=float, default=2.0)
    parser.add_argument("--slo-itl", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--modes", default="colocated,chunked,disaggregated")
    parser.add_argument("--quick", action="store_true", help="10 s of load per mode")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    opts = parser.parse_args()
    if opts.quick:
        opts.duration = 10.0
    work_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"splitscope-interference-{os.getpid()}"
    work_dir.mkdir(parents=True, exist_ok=True)
    all_layouts = layouts(opts.chunk_budget)
    rows = [run_mode(mode, all_layouts[mode], opts, work_dir) for mode in opts.modes.split(",")]

    print(
        f"\n# interference: preset {opts.preset}, {opts.rate:g} rps x {opts.prompt_tokens}->{opts.output_tokens} tokens "
        f"+ one {opts.long_prompt_tokens}-token prompt every {opts.burst_every:g} s, {opts.duration:g} s per mode, "
        f"{os.cpu_count()} CPUs"
    )
    print(
        "| mode | ok/err | step with prefill ms (n) | step without ms (n) | interference | ITL p50 ms | ITL p99 ms "
        "| server ITL p99 ms | TTFT p50 ms | TTFT p99 ms | SLO attainment |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['requests_ok']}/{r['errors']} | {fmt(r['step_with_prefill_ms'])} ({r['steps_with_prefill']}) "
            f"| {fmt(r['step_without_prefill_ms'])} ({r['steps_without_prefill']}) | {fmt(r['interference_factor'], 2)} "
            f"| {fmt(r['itl_p50_ms'])} | {fmt(r['itl_p99_ms'])} | {fmt(r['itl_server_p99_ms'])} | {fmt(r['ttft_p50_ms'])} "
            f"| {fmt(r['ttft_p99_ms'])} | {fmt(r['slo_attainment'], 2)} |"
        )
    by_mode = {r["mode"]: r for r in rows}
    disagg = by_mode.get("disaggregated")
    if disagg and disagg["itl_p99_ms"]:
        for mode in ("colocated", "chunked"):
            if mode in by_mode and by_mode[mode]["itl_p99_ms"]:
                print(
                    f"ITL p99 {mode} / disaggregated: {by_mode[mode]['itl_p99_ms'] / disagg['itl_p99_ms']:.2f}x "
                    f"(server-side: {fmt((by_mode[mode]['itl_server_p99_ms'] or 0) / (disagg['itl_server_p99_ms'] or 1), 2)}x)"
                )
    for mode in ("colocated", "chunked"):
        if mode in by_mode and by_mode[mode]["interference_factor"]:
            print(f"step time with / without prefill, {mode}: {by_mode[mode]['interference_factor']:.2f}x")
    if opts.json:
        opts.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
