"""Does scraping /metrics slow what it observes? TTFT and client-seen gaps with and without a scraper.

One reference server (`splitscope serve`, colocated, 2 workers, `small` preset) serves the same open-loop
workload from `tracer.load` in alternating rounds: unscraped and scraped 3 times a second on the router's
/metrics (OpenMetrics, as Prometheus asks), which of the two goes first alternating from round to round.
Each condition pools the requests of its rounds; printed: TTFT p90 and the p99 of every client-seen gap
between text chunks, per condition, their ratios (scraped / unscraped) from this one run, and (from five
rounds) a 90% bootstrap interval of each ratio over rounds: what the run can tell from noise. Alternating
rounds on one server keeps slow drift of a shared machine out of the ratio. Before the rounds, the CPU one
scrape costs each process (router, workers) is measured on the idle server from back-to-back scrapes.

`--via-exporter` runs the server as a deployment should be scraped: `splitscope serve --exporter-port`, whose
metrics exporter (a sidecar at nice 19 that every process ships its spans and gauges to) serves the whole
server's /metrics, and scrapes that. `--via-sidecar` is the manual version of the same: a `splitscope
sidecar` started by this script (`--sidecar-nice 19` for the lowest CPU priority) and the workers shipping to
it; its /metrics is scraped. In both, no serving process does any work for a scrape, so what remains is the
CPU the scrape takes elsewhere on the machine.

Run: `python bench/metrics_scrape.py` from bench/ or the repository root (about 5 minutes on a 2-core CPU
machine); `--quick` shortens it.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
from interference import free_port, start_answering, start_server  # bench/interference.py: the same start-up

from tracer.load import LengthSpec, LoadConfig, run_load_sync

OPENMETRICS_ACCEPT = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def _scrape_loop(url: str, interval_s: float, nice: int, stop: Any, results: Any) -> None:
    """The scraper process: GET `url` every `interval_s` until `stop` is set; put (scrapes, bytes, seconds)."""
    os.nice(nice)
    scrapes, size, seconds = 0, 0, []
    next_at = time.monotonic()
    while not stop.is_set():
        started = time.monotonic()
        request = urllib.request.Request(url, headers={"Accept": OPENMETRICS_ACCEPT})
        with urllib.request.urlopen(request, timeout=10) as response:
            size += len(response.read())
        seconds.append(time.monotonic() - started)
        scrapes += 1
        next_at += interval_s
        stop.wait(max(0.0, next_at - time.monotonic()))
    results.put((scrapes, size, seconds))


class Scraper:
    """Scrapes `url` every `interval_s` from a process of its own, as Prometheus would: a scraper thread in
    this process would take the load generator's GIL and skew the client-side timings it measures."""

    def __init__(self, url: str, interval_s: float, nice: int = 0) -> None:
        context = multiprocessing.get_context("spawn")
        self._stop, self._results = context.Event(), context.Queue()
        self._process = context.Process(
            target=_scrape_loop,
            args=(url, interval_s, nice, self._stop, self._results),
            name="bench-scraper",
            daemon=True,
        )
        self.scrapes, self.bytes, self.seconds = 0, 0, []
        self.started = self.stopped = 0.0

    def __enter__(self) -> Scraper:
        self._process.start()
        self.started = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.scrapes, self.bytes, self.seconds = self._results.get(timeout=30)
        self.stopped = time.monotonic()
        self._process.join(30)


def server_pids(pid: int) -> list[int]:
    """The server process `pid` (the router) and its children (the workers)."""
    try:
        return [pid, *(int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split())]
    except OSError:
        return [pid]


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by process `pid`."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15 of proc(5))


def cpu_s_of(pids: list[int]) -> float:
    """CPU seconds used so far by the processes `pids` (the router, its workers, a sidecar)."""
    return sum(process_cpu_s(each) for each in pids)


def start_sidecar(directory: Path, metrics_port: int, nice: int = 0) -> subprocess.Popen:
    """`splitscope sidecar` on `directory`/sidecar.sock, serving /metrics on `metrics_port` (no OTLP
    listeners; spans go to a traces file, as in the fault tests), at CPU priority `nice`. Returns once
    /metrics answers."""
    directory.mkdir(parents=True, exist_ok=True)
    cli_args = ["sidecar", "--socket", str(directory / "sidecar.sock"), "--no-http", "--no-grpc", "--no-gpu"]
    cli_args += ["--metrics-port", str(metrics_port), "--traces-file", str(directory / "traces.jsonl")]
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    return start_answering(cli_args, url, directory / "sidecar.log", timeout_s=60, nice=nice)


def idle_scrape_cost_ms(url: str, pids: list[int], scrapes: int) -> list[float]:
    """CPU milliseconds one scrape of `url` costs each of `pids`, from `scrapes` back-to-back scrapes of an
    otherwise idle server, less what each process used idle for as long just before."""
    before = [process_cpu_s(p) for p in pids]
    started = time.monotonic()
    time.sleep(5.0)  # the idle baseline: pipeline threads, health checks
    idle_per_s = [(process_cpu_s(p) - b) / (time.monotonic() - started) for p, b in zip(pids, before)]
    before = [process_cpu_s(p) for p in pids]
    started = time.monotonic()
    for _ in range(scrapes):
        request = urllib.request.Request(url, headers={"Accept": OPENMETRICS_ACCEPT})
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()
    wall_s = time.monotonic() - started
    return [((process_cpu_s(p) - b) - idle * wall_s) * 1000 / scrapes for p, b, idle in zip(pids, before, idle_per_s)]


Samples = tuple[np.ndarray, np.ndarray]


def samples(result: Any) -> Samples:
    """(TTFT s of each successful request, every client-seen gap s between their chunks) of one run."""
    records = [r for r in result.records if r.status == "ok"]
    ttft = np.asarray([r.ttft_s for r in records if r.ttft_s is not None])
    gaps = np.asarray([g for r in records for g in (r.itl_s or ())])
    return ttft, gaps


def pooled(runs: list[Samples]) -> tuple[float, float]:
    """(TTFT p90 s, client gap p99 s) over every request of `runs`."""
    ttft = np.concatenate([run[0] for run in runs])
    gaps = np.concatenate([run[1] for run in runs])
    return float(np.percentile(ttft, 90)), float(np.percentile(gaps, 99))


def ratios(unscraped: list[Samples], scraped: list[Samples]) -> tuple[float, float]:
    """Scraped over unscraped (TTFT p90, client gap p99), each side pooled over its runs."""
    (t0, g0), (t1, g1) = pooled(unscraped), pooled(scraped)
    return t1 / t0, g1 / g0


def round_bootstrap(
    unscraped: list[Samples], scraped: list[Samples], resamples: int = 2000, seed: int = 0
) -> np.ndarray:
    """`ratios` over `resamples` draws of whole rounds with replacement, each round's two runs drawn
    together: shape (resamples, 2).

    Rounds, not requests, are the unit: the machine's noise comes in stretches (a busy minute slows every
    request of a run), so requests within a run are not independent and resampling them would claim a
    precision the bench does not have.
    """
    rng = np.random.default_rng(seed)
    draws = (rng.integers(0, len(unscraped), len(unscraped)) for _ in range(resamples))
    return np.asarray([ratios([unscraped[j] for j in drawn], [scraped[j] for j in drawn]) for drawn in draws])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second")
    parser.add_argument("--round-s", type=float, default=15.0, help="seconds of load per round")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per condition")
    parser.add_argument("--scrapes-per-s", type=float, default=3.0)
    parser.add_argument("--cost-scrapes", type=int, default=200, help="back-to-back scrapes of the idle server")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 10 s per condition")
    parser.add_argument(
        "--via-exporter",
        action="store_true",
        help="serve with `--exporter-port` and scrape the exporter's /metrics (the recommended deployment)",
    )
    parser.add_argument(
        "--via-sidecar",
        action="store_true",
        help="the server ships its records to a `splitscope sidecar`, and the scraper scrapes the sidecar's /metrics",
    )
    parser.add_argument(
        "--sidecar-nice",
        type=int,
        default=0,
        help="with --via-sidecar: the sidecar's nice value (19: lowest CPU priority)",
    )
    parser.add_argument(
        "--scraper-nice",
        type=int,
        default=0,
        help="the scraper's nice value: it stands for Prometheus, which usually runs on another machine; at 19"
        " its own CPU (a request, reading the body) yields to serving and what is left is what answering costs",
    )
    args = parser.parse_args()
    if args.quick:
        args.round_s, args.rounds = 10.0, 2
    port = free_port()
    log_path = Path("/tmp") / f"bench-metrics-scrape-{port}.log"
    layout = ["--mode", "colocated", "--workers", str(args.workers)]
    url = f"http://127.0.0.1:{port}"
    metrics_url, sidecar = url + "/metrics", None
    if args.via_sidecar:
        sidecar_dir, sidecar_port = Path("/tmp") / f"bench-metrics-scrape-{port}-sidecar", free_port()
        sidecar = start_sidecar(sidecar_dir, sidecar_port, args.sidecar_nice)
        layout += ["--sidecar-socket", str(sidecar_dir / "sidecar.sock")]
        metrics_url = f"http://127.0.0.1:{sidecar_port}/metrics"
    if args.via_exporter:
        exporter_port = free_port()
        layout += ["--exporter-port", str(exporter_port)]
        metrics_url = f"http://127.0.0.1:{exporter_port}/metrics"
    server = start_server(args.preset, layout, port, log_path)
    measured_pids = [*server_pids(server.pid), *([sidecar.pid] if sidecar is not None else [])]
    results: dict[str, list] = {"unscraped": [], "scraped": []}
    scrapes = []
    cpu_s = {"unscraped": 0.0, "scraped": 0.0}
    try:
        warm = LoadConfig(
            url=url,
            model=args.preset,
            rate_rps=args.rate,
            duration_s=5.0,
            prompt=LengthSpec(128),
            output=LengthSpec(64),
            seed=1,
            timeout_s=60,
        )
        run_load_sync(warm)  # first requests pay one-off costs (allocations, caches)
        cost_ms = idle_scrape_cost_ms(metrics_url, measured_pids, args.cost_scrapes)
        print(
            f"CPU per scrape of the idle server (router, each child process{' (the exporter first)' if args.via_exporter else ''}"
            f"{', the sidecar' if sidecar else ''}): "
            f"{', '.join(f'{c:.2f}' for c in cost_ms)} ms "
            f"({sum(cost_ms):.1f} ms in all, {args.cost_scrapes} scrapes)",
            flush=True,
        )
        for index in range(args.rounds):
            # ABBA order: the condition that goes first in a round alternates, so warm-up and drift within a
            # round (seen as a steady 0.5-0.9 first-round bias when unscraped always went first) cancel out.
            for condition in ("unscraped", "scraped") if index % 2 == 0 else ("scraped", "unscraped"):
                # Both runs of a round replay one schedule (arrivals, lengths) with their own prompt text: a
                # repeated text would be served from the server's prefix cache and flatter the second run; a
                # schedule of its own per run made the two conditions carry different loads (155 vs 175
                # requests in one run).
                text_seed = 1000 + 2 * index + (condition == "scraped")
                config = LoadConfig(
                    url=url,
                    model=args.preset,
                    rate_rps=args.rate,
                    duration_s=args.round_s,
                    prompt=LengthSpec(128),
                    output=LengthSpec(64),
                    seed=100 + index,
                    text_seed=text_seed,
                    timeout_s=60,
                )
                cpu_before = cpu_s_of(measured_pids)
                if condition == "scraped":
                    with Scraper(metrics_url, 1.0 / args.scrapes_per_s, args.scraper_nice) as scraper:
                        results[condition].append(run_load_sync(config))
                    scrapes.append(scraper)
                else:
                    results[condition].append(run_load_sync(config))
                cpu_s[condition] += cpu_s_of(measured_pids) - cpu_before
                print(
                    f"round {index + 1}/{args.rounds} {condition}: {results[condition][-1].summary.ok} ok", flush=True
                )
    finally:
        server.terminate()
        server.wait(30)
        if sidecar is not None:
            sidecar.terminate()
            sidecar.wait(30)

    by_run = {name: [samples(result) for result in runs] for name, runs in results.items()}
    total_scrapes = sum(s.scrapes for s in scrapes)
    scrape_s = np.asarray([x for s in scrapes for x in s.seconds])
    print()
    print("| condition | requests ok | TTFT p90 ms | client gap p99 ms |")
    print("|---|---|---|---|")
    for name, runs in by_run.items():
        ttft_p90, gap_p99 = pooled(runs)
        ok = sum(1 for result in results[name] for r in result.records if r.status == "ok")
        print(f"| {name} | {ok} | {ttft_p90 * 1000:.1f} | {gap_p99 * 1000:.1f} |")
    ttft_ratio, gap_ratio = ratios(by_run["unscraped"], by_run["scraped"])
    print()
    print(f"scraped / unscraped: TTFT p90 {ttft_ratio:.3f}, client gap p99 {gap_ratio:.3f}")
    # The same ratios round by round (each scraped run against the unscraped run of its round):
    # their spread is the machine's noise.
    paired = [ratios([u], [s]) for u, s in zip(by_run["unscraped"], by_run["scraped"])]
    print(
        "per round: TTFT p90 "
        + ", ".join(f"{t:.2f}" for t, _ in paired)
        + "; gap p99 "
        + ", ".join(f"{g:.2f}" for _, g in paired)
    )
    if args.rounds >= 5:
        low, high = np.percentile(round_bootstrap(by_run["unscraped"], by_run["scraped"]), [5, 95], axis=0)
        print(
            f"90% interval over rounds (bootstrap): TTFT p90 {low[0]:.3f}-{high[0]:.3f}, "
            f"gap p99 {low[1]:.3f}-{high[1]:.3f}; within 5% only if the interval lies in 0.95-1.05"
        )
    extra_cpu_ms = (cpu_s["scraped"] - cpu_s["unscraped"]) * 1000 / max(total_scrapes, 1)
    measured = "router + workers" + (" + sidecar" if sidecar is not None else "")
    print(
        f"server CPU ({measured}): unscraped {cpu_s['unscraped']:.1f} s, scraped {cpu_s['scraped']:.1f} s; "
        f"{extra_cpu_ms:.1f} ms more per scrape"
    )
    scraping_s = sum(s.stopped - s.started for s in scrapes)
    print(
        f"scrapes: {total_scrapes} ({total_scrapes / scraping_s:.2f}/s while scraped), "
        f"{sum(s.bytes for s in scrapes) / max(total_scrapes, 1) / 1024:.0f} KiB each, "
        f"scrape time p50 {np.percentile(scrape_s, 50) * 1000:.1f} ms, p99 {np.percentile(scrape_s, 99) * 1000:.1f} ms"
    )


if __name__ == "__main__":
    main()
