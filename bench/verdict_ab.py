"""The verdict against the real server: predicted goodput per layout, then each layout served and measured.

For each workload shape, on the reference server (CPU, `small` preset, the same worker count for every
layout):

1. serve it colocated with traces on, drive the shape at a rate below but near capacity (so the step fit
   sees batches like the ones it will price), and build the report
   from that ONE run: its predicted goodput (requests/s per GPU meeting both SLOs at 90% attainment) for
   colocated, chunked prefill (the best budget it simulated) and every P:D split of the worker count;
2. serve each of those layouts for real and measure its goodput with a rate search driven by
   `tracer.load` (open loop): the highest rate whose SLO attainment is at least the report's target.

One shape, one schedule: the shape's arrivals (Poisson, plus bursts of long prompts) and lengths are
drawn once from a seed, and every rate replays that same schedule with its times stretched to the rate,
which is what the report's own search does to the traced requests (common random numbers). Each layout
is driven at the rates prediction x step^k (k = -2..1, `--step` default 1.25), lowest first, and on up
by step while every rate passed (up to three more); its measured goodput is the highest rate that passes
with every lower rate passing too, and the next rate tried fails: the truth lies in that bracket, and the table gives its geometric middle (within a factor
sqrt(step), about +-12% at 1.25, of the truth: the search's resolution).

Measured goodput is the report's definition, so the two are comparable: a rate per GPU at which at least
90% of the requests meet both SLOs (time to first token, and each request's p99 inter-token gap), over
`--horizon-s` seconds of arrivals (30, the report's own default; at least 40 requests); the report is asked
to simulate runs of the same length. A shorter run measures how fast a layout drains one burst, not what
it sustains. Each measured
layout is traced, and the attainment is judged on the server's spans (per-token gaps, as the report
judges); the client's own judgement is shown beside it. The two differ because the reference server's
byte tokenizer holds back a partial UTF-8 character: the client then sees two tokens in one chunk, and a
gap twice a step long, which a per-token model does not predict.

Run: `python bench/verdict_ab.py` (every shape, about 25-30 minutes on an idle 2-core CPU machine), or
`--shape chat` for one. `--json FILE` writes every measured point. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from reference_server.launch.process import ServerProcess
from reference_server.launch.serve import ServeConfig
from tracer.load import BurstSpec, LengthSpec, LoadConfig, run_load_sync
from tracer.load import ClientSLO as LoadSLO
from tracer.load.replay_formats import read_replay
from tracer.load.workload import build_schedule
from tracer.report.build import (
    OptionResult,
    Report,
    ReportOptions,
    build_report,
    measure,
)
from tracer.report.render import render
from tracer.report.simulate import SLO
from tracer.report.tables import StepTable, load_traces

PRESET = "small"
MAX_BATCH = ServeConfig.max_batch
DEFAULT_STEP = 1.25
# The slowest rate tried takes at most this long to send its requests: below it, goodput is "under the floor".
MAX_POINT_S = 60.0
WARMUP_REQUESTS = 6
# The load generator's seed sets the prompts' text (arrivals and lengths come from the schedule). The
# reference server caches prefixes, so a run that replays text it has served prefills only the uncached
# tail: the warm-up and every rate get text of their own.
WARMUP_TEXT_SEED = 10_000
# Every rate sends the arrivals of this many seconds (the report's own horizon: a capacity is what a layout
# sustains, not how fast it drains one short burst), and at least MIN_POINT_REQUESTS requests.
DEFAULT_HORIZON_S = 30.0
MIN_POINT_REQUESTS = 40
# Rates tried per layout: prediction x step^k, k from -GRID_BELOW to GRID_ABOVE.
GRID_BELOW, GRID_ABOVE = 2, 1
# Rates tried above the grid while every rate so far passed, so the search ends in a bracket.
EXTRA_RATES = 3
# The highest rate the search may try, as a multiple of the shape's base rate.
CEILING_OVER_BASE = 8.0
AZURE_CONV_TRACE = Path(__file__).resolve().parents[1] / "tests/oracle/data/azure_llm_2023_conv_head1000.csv"


@dataclass(frozen=True)
class Shape:
    """A workload shape: a Poisson stream of short requests, optionally with bursts of long prompts.

    `base_rate_rps` and the burst period fix the shape's mix at one total rate; every other rate replays
    the same schedule stretched in time. `traced_rate_rps` is the total rate of the traced colocated run.
    """

    name: str
    prompt_tokens: int
    output_tokens: int
    base_rate_rps: float
    traced_rate_rps: float
    burst: BurstSpec | None = None
    # A production trace instead of Poisson arrivals: its arrivals (pattern kept, stretched to the base rate)
    # and lengths, each length scaled by the factor and kept within the bounds (a CPU serves a small model).
    trace: Path | None = None
    prompt_scale: float = 1.0
    output_scale: float = 1.0
    prompt_bounds: tuple[int, int] = (1, 4096)
    output_bounds: tuple[int, int] = (2, 4096)
    # A trace is not stationary (its long prompts come when they came): every run replays the same first
    # `fixed_requests` of it stretched to its rate, the traced run included, so the report sees the very
    # requests each rate is measured on. 0: each rate sends `--horizon-s` of arrivals.
    fixed_requests: int = 0
    slo_ttft_s: float = 2.0
    slo_itl_s: float = 0.1
    seed: int = 11

    @property
    def slo(self) -> SLO:
        return SLO(ttft_s=self.slo_ttft_s, itl_s=self.slo_itl_s)


SHAPES = {
    # Short prompts, longer answers: a short prefill joining a decode step costs little, so two colocated
    # workers both decode, while a 1:1 split leaves one of them prefilling short prompts, mostly idle.
    "chat": Shape("chat", prompt_tokens=64, output_tokens=128, base_rate_rps=4.0, traced_rate_rps=6.0, slo_itl_s=0.15),
    # Short chats plus, every few seconds, two long prompts at once: a whole long prefill in a colocated
    # step stalls every decode beside it past the inter-token objective.
    "bursts": Shape(
        "bursts",
        prompt_tokens=64,
        output_tokens=64,
        base_rate_rps=2.0,
        traced_rate_rps=2.0,
        burst=BurstSpec(every_s=4.0, count=2, prompt_tokens=1024),
    ),
    # Production-shaped: Azure's 2023 conversation trace (tests/oracle/data, CC-BY 4.0, provenance beside it),
    # read as `splitscope load --replay` reads it: its bursts and lulls (gap coefficient of variation 1.3), and
    # each request's prompt and answer lengths together, scaled to what a small CPU model serves (1/4 each:
    # over the 520 requests used, prompts median 249 tokens, p90 328, and 6% near 1,024; answers median 54).
    "production": Shape(
        "production",
        prompt_tokens=0,
        output_tokens=0,
        base_rate_rps=2.0,
        traced_rate_rps=2.5,
        trace=AZURE_CONV_TRACE,
        prompt_scale=1 / 4,
        output_scale=1 / 4,
        prompt_bounds=(8, 2048),
        output_bounds=(4, 160),
        fixed_requests=240,
    ),
}


@dataclass
class Point:
    rate_rps: float
    attainment: float  # judged by the client: per-chunk gaps
    ok: int
    errors: int
    ttft_p90_s: float | None
    itl_p99_p90_s: float | None  # p90 over requests of each request's p99 gap
    wall_s: float
    started_unix_s: float = 0.0
    span_attainment: float | None = None  # judged on the server's spans: per-token gaps, as the report does


@dataclass
class Row:
    label: str
    serve_args: list[str]
    predicted_per_gpu: float
    measured_bracket_per_gpu: tuple[float, float] = (float("nan"), float("nan"))  # (passes, fails), per-token gaps
    client_bracket_per_gpu: tuple[float, float] = (float("nan"), float("nan"))  # the same judged on chunk gaps
    points: list[Point] = field(default_factory=list)
    attainment_target: float = 0.9
    # This layout's decode-only steps against the traced run's at equal batch sizes (decode_step_ratio):
    # under 1, its steps ran faster than the ones the report was fitted on. None: too few to compare.
    decode_step_ratio: float | None = None

    @property
    def measured_per_gpu(self) -> float:
        """The bracket's geometric middle (its lower end when nothing failed): within sqrt(step) of the truth."""
        low, high = self.measured_bracket_per_gpu
        return low if math.isinf(high) or low == 0 else math.sqrt(low * high)

    @property
    def monotone(self) -> bool:
        """False when a rate passed (on spans) above one that failed: noise from outside moved a point."""
        ordered = sorted(self.points, key=lambda p: p.rate_rps)
        passed = [p.span_attainment is not None and p.span_attainment >= self.attainment_target for p in ordered]
        first_fail = passed.index(False) if False in passed else len(passed)
        return not any(passed[first_fail:])

    @property
    def error(self) -> float:
        measured = self.measured_per_gpu
        if not measured or math.isnan(measured):
            return float("nan")
        return (self.predicted_per_gpu - measured) / measured


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------- schedules


def base_schedule(shape: Shape, horizon_s: float) -> list[dict]:
    """The shape's arrivals and lengths at its base rate (replay-file entries, times from 0): enough of them
    to fill `horizon_s` at the search's ceiling rate."""
    burst_rate_rps = shape.burst.count / shape.burst.every_s if shape.burst else 0.0
    requests = math.ceil((shape.base_rate_rps + burst_rate_rps) * CEILING_OVER_BASE * horizon_s) + MIN_POINT_REQUESTS
    if shape.trace is not None:
        return trace_schedule(shape, requests)
    config = LoadConfig(
        url="http://127.0.0.1:1",
        model=PRESET,
        rate_rps=shape.base_rate_rps,
        requests=requests,
        prompt=LengthSpec(shape.prompt_tokens),
        output=LengthSpec(shape.output_tokens),
        burst=shape.burst,
        seed=shape.seed,
    )
    return [
        {"arrival_s": p.arrival_s, "prompt_tokens": p.prompt_tokens, "output_tokens": p.output_tokens}
        for p in build_schedule(config)
    ]


def trace_schedule(shape: Shape, requests: int) -> list[dict]:
    """The first `requests` of the shape's trace (all of it if shorter), read by the load generator's own
    replay reader, arrivals stretched to the base rate and lengths scaled within the shape's bounds."""
    entries = read_replay(shape.trace)[: shape.fixed_requests or requests]
    if len(entries) < MIN_POINT_REQUESTS:
        raise SystemExit(f"{shape.trace}: {len(entries)} requests, fewer than a rate's {MIN_POINT_REQUESTS}")
    span_s = entries[-1].arrival_s - entries[0].arrival_s
    stretch = (len(entries) - 1) / span_s / shape.base_rate_rps
    return [
        {
            "arrival_s": (e.arrival_s - entries[0].arrival_s) * stretch,
            "prompt_tokens": int(np.clip(round(e.prompt_tokens * shape.prompt_scale), *shape.prompt_bounds)),
            "output_tokens": int(np.clip(round(e.output_tokens * shape.output_scale), *shape.output_bounds)),
        }
        for e in entries
    ]


def warmup(schedule: list[dict]) -> list[dict]:
    """Requests to send before measuring, not measured: a fresh worker's first batches and its first long
    prompt pay for allocations and kernel selection (a cold 1024-token prefill took over a second).
    The schedule's first few requests, then its longest prompt."""
    head = schedule[:WARMUP_REQUESTS]
    longest = max(schedule, key=lambda entry: entry["prompt_tokens"])
    return [*head, {**longest, "arrival_s": head[-1]["arrival_s"]}]


def schedule_rate_rps(schedule: list[dict]) -> float:
    """Mean total arrival rate the way the report counts it: (n - 1) / (last arrival - first)."""
    span_s = schedule[-1]["arrival_s"] - schedule[0]["arrival_s"]
    return (len(schedule) - 1) / span_s


def run_horizon_s(shape: Shape, horizon_s: float) -> float:
    """Seconds of arrivals each run sends: all of a fixed set of requests, else `horizon_s`."""
    return math.inf if shape.fixed_requests else horizon_s


def stretched(schedule: list[dict], rate_rps: float, horizon_s: float) -> list[dict]:
    """The same requests with arrival times scaled to a mean total rate of `rate_rps` (first at 0), cut to
    the arrivals of the first `horizon_s` seconds (at least MIN_POINT_REQUESTS of them)."""
    scale = schedule_rate_rps(schedule) / rate_rps
    first = schedule[0]["arrival_s"]
    entries = [{**entry, "arrival_s": (entry["arrival_s"] - first) * scale} for entry in schedule]
    within = sum(entry["arrival_s"] < horizon_s for entry in entries)
    return entries[: max(within, MIN_POINT_REQUESTS)]


def run_schedule(url: str, schedule: list[dict], shape: Shape, workdir: Path, seed: int) -> Point:
    """Drive `schedule` at `url` (open loop) and summarise it against the shape's SLOs."""
    replay = workdir / "replay.jsonl"
    replay.write_text("".join(json.dumps(entry) + "\n" for entry in schedule))
    result = run_load_sync(
        LoadConfig(
            url=url,
            model=PRESET,
            replay_path=str(replay),
            slo=LoadSLO(ttft_s=shape.slo_ttft_s, itl_s=shape.slo_itl_s),
            seed=seed,
            timeout_s=120.0,
        )
    )
    s = result.summary
    ttft = [r.ttft_s for r in result.records if r.ttft_s is not None]
    itl = [float(np.percentile(r.itl_s, 99)) for r in result.records if r.itl_s]
    return Point(
        rate_rps=schedule_rate_rps(schedule),
        attainment=s.attainment or 0.0,
        ok=s.ok,
        errors=s.errors,
        ttft_p90_s=float(np.percentile(ttft, 90)) if ttft else None,
        itl_p99_p90_s=float(np.percentile(itl, 90)) if itl else None,
        wall_s=s.wall_s,
        started_unix_s=result.started_unix_s,
    )


# --------------------------------------------------------------------------------------- the search


def rate_grid_rps(
    center_rps: float, step: float, below: int, above: int, floor_rps: float, ceiling_rps: float
) -> list[float]:
    """Rates center * step^k for k in [-below, above], within [floor, ceiling], ascending."""
    rates = [center_rps * step**k for k in range(-below, above + 1)]
    return [r for r in rates if floor_rps <= r <= ceiling_rps] or [min(max(center_rps, floor_rps), ceiling_rps)]


def goodput_from_points(points: list[Point], attainment: float, judge: str) -> tuple[float, float]:
    """(highest rate passing with every lower tried rate passing too, the next tried rate above it or inf).

    `judge`: "span" (per-token gaps from the server's spans) or "client" (per-chunk gaps)."""
    low, high = 0.0, math.inf
    for point in sorted(points, key=lambda p: p.rate_rps):
        value = point.span_attainment if judge == "span" else point.attainment
        if value is not None and value >= attainment:
            low = point.rate_rps
        else:
            high = point.rate_rps
            break
    return low, high


def measure_layout(
    serve_args: list[str],
    shape: Shape,
    schedule: list[dict],
    rates_rps: list[float],
    horizon_s: float,
    workdir: Path,
    gpus: int,
    step: float,
    ceiling_rps: float,
) -> tuple[list[Point], StepTable]:
    """Serve one layout with traces on and drive the schedule at each rate (ascending, stopping after two
    failing rates on the client's judgement); while every rate passed, go on up by `step` (at most
    EXTRA_RATES more, below `ceiling_rps`) so the search ends in a bracket. Then judge every point on the
    server's spans too. Returns the points and the server's step spans."""
    points: list[Point] = []
    traces = workdir / f"traces-{'-'.join(serve_args[1::2])}.jsonl"
    traces.unlink(missing_ok=True)
    with ServerProcess(
        ["--preset", PRESET, "--max-batch", str(MAX_BATCH), "--traces-file", str(traces), *serve_args],
        log_path=workdir / "server.log",
    ) as server:
        run_schedule(server.url, warmup(schedule), shape, workdir, seed=WARMUP_TEXT_SEED)
        failures, extra_left = 0, EXTRA_RATES
        rates_rps = list(rates_rps)  # grows while every rate passes
        for index, rate_rps in enumerate(rates_rps):
            point = run_schedule(
                server.url,
                stretched(schedule, rate_rps, run_horizon_s(shape, horizon_s)),
                shape,
                workdir,
                seed=shape.seed + 1 + index,  # new text each rate: the server's prefix cache has seen none of it
            )
            points.append(point)
            log(
                f"  {rate_rps / gpus:.3f} req/s/GPU: client attainment {point.attainment:.0%} "
                f"(TTFT p90 {_ms(point.ttft_p90_s)} ms, chunk-gap p99 p90 {_ms(point.itl_p99_p90_s)} ms, {point.wall_s:.0f} s)"
            )
            # Past two failing rates, higher ones only take time (per-token gaps pass at least as often as
            # the client's chunk gaps, so a client failure may still pass on spans: one more is tried).
            failures += point.attainment < shape.slo.attainment
            if failures >= 2:
                break
            if rate_rps == rates_rps[-1] and not failures and extra_left and rate_rps * step <= ceiling_rps:
                rates_rps.append(rate_rps * step)
                extra_left -= 1
    requests = load_traces([traces]).requests
    for point in points:
        start_ns = int(point.started_unix_s * 1e9)
        window = (requests.arrival_ns >= start_ns) & (requests.arrival_ns < start_ns + int(point.wall_s * 1e9))
        selected = requests.select(window)
        point.span_attainment = measure(selected, shape.slo).attainment if len(selected) else None
        log(
            f"  {point.rate_rps / gpus:.3f} req/s/GPU: span attainment "
            f"{'-' if point.span_attainment is None else f'{point.span_attainment:.0%}'} ({len(selected)} requests)"
        )
    return points, load_traces([traces]).steps


# Batch sizes compared by decode_step_ratio need this many decode-only steps on each side.
MIN_STEPS_PER_BATCH = 20


def decode_step_ratio(steps: StepTable, traced: StepTable) -> float | None:
    """How many times longer `steps`' decode-only steps took than `traced`'s, at equal batch sizes: per batch
    size the ratio of mean durations, then the median over sizes weighted by the steps compared. Raw step
    spans, no fit: the measured reason a layout's capacity differs from what a fit on the traced run says
    (on shared CPU cores a worker's steps run faster when its neighbour idles)."""

    def decode_only(table: StepTable) -> StepTable:
        return table.select(table.prefill_tokens == 0)

    here, there = decode_only(steps), decode_only(traced)
    ratios, counts = [], []
    for batch in np.unique(here.decode_requests):
        mine, theirs = here.decode_requests == batch, there.decode_requests == batch
        compared = min(int(mine.sum()), int(theirs.sum()))
        if compared >= MIN_STEPS_PER_BATCH:
            ratios.append(float(np.mean(here.duration_s[mine]) / np.mean(there.duration_s[theirs])))
            counts.append(compared)
    if not counts:
        return None
    return float(np.quantile(ratios, 0.5, weights=counts, method="inverted_cdf"))


def rate_limits_rps(schedule: list[dict]) -> tuple[float, float]:
    """The search's floor (MIN_POINT_REQUESTS sent in MAX_POINT_S) and ceiling (a multiple of the base rate)."""
    return MIN_POINT_REQUESTS / MAX_POINT_S, schedule_rate_rps(schedule) * CEILING_OVER_BASE


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _ms(value_s: float | None) -> str:
    return "-" if value_s is None else f"{value_s * 1e3:.0f}"


# --------------------------------------------------------------------------------------- the report


def traced_report(
    shape: Shape, schedule: list[dict], workers: int, horizon_s: float, workdir: Path, confidence: int
) -> Report:
    """Serve colocated with traces, drive the shape at its traced rate, and report on that one run."""
    traces = workdir / "traces.jsonl"
    args = [
        "--preset",
        PRESET,
        "--max-batch",
        str(MAX_BATCH),
        "--mode",
        "colocated",
        "--workers",
        str(workers),
        "--traces-file",
        str(traces),
    ]
    with ServerProcess(args, log_path=workdir / "server.log") as server:
        run_schedule(server.url, warmup(schedule), shape, workdir, seed=WARMUP_TEXT_SEED)
        point = run_schedule(
            server.url,
            stretched(schedule, shape.traced_rate_rps, run_horizon_s(shape, horizon_s)),
            shape,
            workdir,
            seed=shape.seed,
        )
    log(f"traced colocated x{workers} run: {point.ok} ok, attainment {point.attainment:.0%}, {point.wall_s:.0f} s")
    options = ReportOptions(
        shape.slo,
        kv_bytes_per_token=_kv_bytes_per_token(),
        max_batch=MAX_BATCH,
        confidence_resamples=confidence,
        # The served workers' token budget: a colocated or prefill-only step joins whole prompts up to it.
        max_prefill_tokens_per_step=ServeConfig.token_budget,
        # Simulated runs as long as the measured ones: a short overload queues less than a long one.
        sim_requests=shape.fixed_requests or MIN_POINT_REQUESTS,
        sim_max_requests=len(schedule),
        sim_duration_s=1.0 if shape.fixed_requests else horizon_s,
    )
    return build_report([traces], options)


def _kv_bytes_per_token() -> int:
    import torch

    from reference_server.kv_cache import kv_bytes_per_token
    from reference_server.model import ModelArgs

    return kv_bytes_per_token(ModelArgs.from_name(PRESET), torch.float32)


def candidate_rows(report: Report, workers: int) -> list[Row]:
    """Colocated, the best chunked budget, and every P:D split of `workers`, with their predictions."""
    rows: list[Row] = []
    by_mode: dict[str, list[OptionResult]] = {}
    for option in report.goodput:
        by_mode.setdefault(option.mode, []).append(option)
    for option in by_mode.get("colocated", []):
        rows.append(Row(option.label, ["--mode", "colocated", "--workers", str(workers)], option.goodput_per_gpu))
    chunked = [o for o in by_mode.get("chunked", []) if (o.chunk_budget_tokens or 0) > MAX_BATCH]
    if chunked:
        best = max(chunked, key=lambda o: o.goodput_per_gpu)
        rows.append(
            Row(
                best.label,
                ["--mode", "chunked", "--workers", str(workers), "--chunk-budget", str(best.chunk_budget_tokens)],
                best.goodput_per_gpu,
            )
        )
    for option in by_mode.get("disaggregated", []):
        p, d = (int(x) for x in (option.ratio or "0:0").split(":"))
        rows.append(
            Row(
                option.label,
                ["--mode", "disaggregated", "--prefill-workers", str(p), "--decode-workers", str(d)],
                option.goodput_per_gpu,
            )
        )
    return rows


# --------------------------------------------------------------------------------------- one shape


@dataclass
class ShapeResult:
    shape: str
    horizon_s: float
    workers: int
    step: float
    verdict: str
    target: str  # the split ratio or chunk budget the verdict names ("" when none)
    confidence: float | None  # share of the report's bootstrap re-runs agreeing (None: --confidence 0)
    unconfirmed: str | None
    model_check: dict[str, float]
    rows: list[Row]
    load_before: float
    load_after: float
    seconds: float

    @property
    def predicted_best(self) -> Row:
        """The row predicted best; among rows predicted alike (chunked at a budget no prompt reaches is
        colocated under another name), the one measured best: the model does not tell them apart."""
        top = max(r.predicted_per_gpu for r in self.rows)
        tied = [r for r in self.rows if r.predicted_per_gpu >= top * (1 - 1e-9)]
        return max(tied, key=lambda r: r.measured_per_gpu)

    @property
    def measured_best(self) -> Row:
        return max(self.rows, key=lambda r: r.measured_per_gpu)

    @property
    def best_agrees(self) -> bool:
        """The predicted best layout's measured goodput is within the search's resolution of the best
        measured one: the two are indistinguishable by this search."""
        return self.predicted_best.measured_per_gpu * self.step >= self.measured_best.measured_per_gpu


def run_shape(
    shape: Shape,
    workers: int,
    horizon_s: float,
    step: float,
    confidence: int,
    workdir: Path,
    only: set[str] | None = None,
) -> ShapeResult:
    started = time.monotonic()
    load_before = _load1()
    schedule = base_schedule(shape, horizon_s)
    log(f"shape {shape.name}: {len(schedule)} requests, base rate {schedule_rate_rps(schedule):.2f} req/s total")
    report = traced_report(shape, schedule, workers, horizon_s, workdir, confidence)
    log(
        f"report: {report.verdict} {report.ratio or report.chunk_budget_tokens or ''} "
        f"{'(unconfirmed: ' + report.unconfirmed + ')' if report.unconfirmed else ''}"
    )
    (workdir / "report.md").write_text(render(report, "md"))
    rows = candidate_rows(report, workers)
    if only is not None:
        rows = [r for r in rows if r.serve_args[1] in only]
    for row in rows:
        log(f"{row.label}: predicted {row.predicted_per_gpu:.3f} req/s/GPU; measuring")
        floor_rps, ceiling_rps = rate_limits_rps(schedule)
        rates = rate_grid_rps(row.predicted_per_gpu * workers, step, GRID_BELOW, GRID_ABOVE, floor_rps, ceiling_rps)
        row.points, steps = measure_layout(
            row.serve_args, shape, schedule, rates, horizon_s, workdir, workers, step, ceiling_rps
        )
        if report.data is not None:
            row.decode_step_ratio = decode_step_ratio(steps, report.data.steps)
        for judge, attr in (("span", "measured_bracket_per_gpu"), ("client", "client_bracket_per_gpu")):
            low, high = goodput_from_points(row.points, shape.slo.attainment, judge)
            setattr(row, attr, (low / workers, high / workers))
        log(
            f"{row.label}: measured {row.measured_per_gpu:.3f} req/s/GPU (bracket {row.measured_bracket_per_gpu}, "
            f"on chunk gaps {row.client_bracket_per_gpu}); decode steps {_ratio(row.decode_step_ratio)} the traced run's"
        )
    return ShapeResult(
        shape.name,
        horizon_s,
        workers,
        step,
        report.verdict,
        str(report.ratio or report.chunk_budget_tokens or ""),
        report.confidence,
        report.unconfirmed,
        report.model_check,
        rows,
        load_before,
        _load1(),
        time.monotonic() - started,
    )


def _load1() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return float("nan")


def markdown(result: ShapeResult) -> str:
    lines = [
        f"shape `{result.shape}`: {result.horizon_s:g} s of arrivals per rate, {result.workers} workers; "
        f"report verdict from the traced colocated run: {result.verdict}"
        + (f" {result.target}" if result.target else "")
        + ("" if result.confidence is None else f", confidence {result.confidence:.0%}")
        + (f" (unconfirmed: {result.unconfirmed})" if result.unconfirmed else ""),
        "",
        "| layout | predicted req/s/GPU | measured req/s/GPU | passes / fails at | error | decode steps vs traced run | on client chunk gaps: passes / fails at |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result.rows:
        low, high = row.measured_bracket_per_gpu
        c_low, c_high = row.client_bracket_per_gpu
        lines.append(
            f"| {row.label} | {row.predicted_per_gpu:.3f} | {row.measured_per_gpu:.3f} | {low:.3f}{'' if row.monotone else '*'} / {high:.3f} | "
            f"{row.error:+.0%} | {_ratio(row.decode_step_ratio)} | {c_low:.3f} / {c_high:.3f} |"
        )
    lines += [
        "",
        (
            f"predicted best: {result.predicted_best.label}; measured best: {result.measured_best.label}; "
            f"agree within the search's resolution (x{result.step:g}): {'yes' if result.best_agrees else 'NO'}. "
            f"Load average (1 min) {result.load_before:.2f} before, {result.load_after:.2f} after; {result.seconds:.0f} s."
        ),
    ]
    return "\n".join(lines)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), action="append", help="workload shape(s) (default: all)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes in every layout")
    parser.add_argument(
        "--horizon-s",
        type=float,
        default=DEFAULT_HORIZON_S,
        help="seconds of arrivals per rate, measured and simulated",
    )
    parser.add_argument("--step", type=float, default=DEFAULT_STEP, help="rate search step factor (> 1)")
    parser.add_argument("--confidence", type=int, default=0, help="report bootstrap re-runs (0 skips)")
    parser.add_argument("--json", type=Path, default=None, help="write every result here")
    parser.add_argument("--workdir", type=Path, default=None, help="keep traces, reports and server logs here")
    args = parser.parse_args(argv)
    if args.step <= 1 or args.horizon_s < 5 or args.workers < 2:
        parser.error("--step must exceed 1, --horizon-s be at least 5, --workers at least 2")
    # SIGTERM unwinds like Ctrl-C, so every server started is stopped on the way out.
    signal.signal(signal.SIGTERM, _interrupt)
    results = []
    with tempfile.TemporaryDirectory(prefix="verdict-ab-") as tmp:
        for name in args.shape or list(SHAPES):
            workdir = (args.workdir or Path(tmp)) / name
            workdir.mkdir(parents=True, exist_ok=True)
            results.append(run_shape(SHAPES[name], args.workers, args.horizon_s, args.step, args.confidence, workdir))
            print(markdown(results[-1]) + "\n", flush=True)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2, default=str))
    return 0 if all(r.best_agrees for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
