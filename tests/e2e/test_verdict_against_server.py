"""The report's predicted goodput, checked on the real reference server (the short version of
bench/verdict_ab.py: one workload, two layouts, a coarse search).

Workload: short chats (64-token prompts, 128-token answers, Poisson), SLO TTFT 2 s and per-request p99
inter-token gap 150 ms for 90% of requests. From ONE traced colocated run on two workers the report
predicts each layout's goodput (requests/s per worker meeting both SLOs); then each layout is served and
driven open loop for HORIZON_S seconds of arrivals:

- colocated (the layout the report ranks first on short prompts) must pass at PASS_AT x its prediction
  and fail at FAIL_AT x: its measured goodput lies within [PASS_AT, FAIL_AT] x the predicted one;
- the 1:1 split must pass at PASS_AT x its prediction. It is not checked from above: on a shared CPU its
  prefill worker mostly idles and leaves the cores to the decode worker, which then runs faster than the
  colocated fit prices it (bench/verdict_ab.py measured it 18-34% above the prediction; the report
  states this limit in its assumptions). On a GPU each worker has its own device.

bench/verdict_ab.py is the full check: two shapes, every layout, a finer search.

Attainment is the client's (per streamed chunk), which can only be stricter than the per-token gaps the
report models: at 150 ms the objective is several decode steps even at a full batch, so a chunk of two
tokens does not decide a request. The report simulates the same horizon it is checked on.

The prediction is fitted on the traced run and judged on runs a minute or two later, and this machine's
speed drifts within minutes (a decode-alone request here took 0.66 s and 1.22 s half a minute apart on one
idle server). So each colocated run's decode steps are compared with the traced run's at equal batch sizes, from
the server's own step spans and without the report's model (`step_time_ratio`). A check that fails on a run
whose steps ran more than MAX_MACHINE_SPEED_CHANGE slower or faster than the traced run's is blamed on the
machine: the whole check is tried once more on a fresh server, and that second try is judged as it is. A
check that fails on a machine that kept its speed fails the test at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from reference_server.kv_cache import kv_bytes_per_token
from reference_server.launch.process import ServerProcess
from reference_server.launch.serve import ServeConfig
from reference_server.model import ModelArgs
from tests.slow_link.trace_window import copy_window
from tracer.load import ClientSLO, LengthSpec, LoadConfig, run_load_sync
from tracer.report.build import OptionResult, ReportOptions, build_report
from tracer.report.simulate import SLO
from tracer.report.tables import StepTable, load_traces

PRESET = "small"
WORKERS = 2
SLO_TTFT_S, SLO_ITL_S = 2.0, 0.15
PROMPT, OUTPUT = LengthSpec(64), LengthSpec(128)
# Total, about half of capacity here, so the step fit sees batches of up to about ten requests. Traced at 3
# req/s (batches of 4-6) the fit priced a request's decode step dearer than full batches cost on this CPU:
# the measured capacity sat 1.0-1.5x over the prediction, mostly 1.25-1.5x, at the top of the tolerance (one
# run here passed at FAIL_AT). Traced at 4.5 it sat 1.0-1.25x over in three runs.
TRACED_RATE_RPS = 4.5
# On a machine busy enough that the traced rate is already past capacity: traced again at this share of it,
# down to the floor (below it too few batches of more than one request for the step fit). A small step, so
# the fitted run stays near capacity and the fit sees the batch sizes the prediction needs: backed off by
# 0.6 (4.5 -> 2.7 req/s beside a busy core) the fit extrapolated past its batches and the prediction sat
# 1.3x over what the machine served (PASS_AT attainment 0.88 and 0.77 in two runs).
TRACED_RATE_BACKOFF, MIN_TRACED_RATE_RPS = 0.8, 1.5
HORIZON_S = 20.0
MIN_REQUESTS = 40
PASS_AT, FAIL_AT = 0.75, 1.5
TARGET_ATTAINMENT = 0.9
# A run whose decode steps took this many times longer (or shorter) than the traced run's at the same batch
# sizes was served by a machine of another speed than the one the prediction was fitted on.
MAX_MACHINE_SPEED_CHANGE = 1.25
# Decode-only steps needed at one batch size on both sides for that size to count, and in all for a ratio.
MIN_STEPS_PER_BATCH, MIN_STEPS_COMPARED = 5, 20


def _attainment(url: str, rate_rps: float, seed: int) -> float:
    """Client-side SLO attainment of HORIZON_S seconds of the workload's arrivals at `rate_rps` (total)."""
    duration_s = max(HORIZON_S, MIN_REQUESTS / rate_rps)
    result = run_load_sync(
        LoadConfig(
            url=url,
            model=PRESET,
            rate_rps=rate_rps,
            duration_s=duration_s,
            prompt=PROMPT,
            output=OUTPUT,
            slo=ClientSLO(ttft_s=SLO_TTFT_S, itl_s=SLO_ITL_S),
            seed=seed,
            timeout_s=120,
        )
    )
    assert result.summary.errors == 0
    return result.summary.attainment or 0.0


def _serve(args: list[str], log_path: Path, traces: Path | None = None) -> ServerProcess:
    traced = ["--traces-file", str(traces)] if traces else []
    return ServerProcess(
        ["--preset", PRESET, "--max-batch", str(ServeConfig.max_batch), *traced, *args], log_path=log_path
    )


def _warm(url: str) -> None:
    """A fresh worker's first batches pay for allocations and kernel selection: not measured. The same
    shape as the workload, so that on the traced server they read as a few more of its requests."""
    run_load_sync(LoadConfig(url=url, model=PRESET, requests=6, rate_rps=6.0, prompt=PROMPT, output=OUTPUT, seed=1))


def _predictions(traces: Path) -> dict[str, OptionResult]:
    options = ReportOptions(
        SLO(ttft_s=SLO_TTFT_S, itl_s=SLO_ITL_S),
        kv_bytes_per_token=kv_bytes_per_token(ModelArgs.from_name(PRESET), torch.float32),
        max_batch=ServeConfig.max_batch,
        max_prefill_tokens_per_step=ServeConfig.token_budget,
        sim_requests=MIN_REQUESTS,
        sim_duration_s=HORIZON_S,
        confidence_resamples=0,
    )
    report = build_report([traces], options)
    return {option.label: option for option in report.goodput}


@dataclass(frozen=True)
class Window:
    """Wall-clock nanoseconds during which one load ran (the clock the server's spans are stamped with)."""

    start_ns: int
    end_ns: int


def _timed_attainment(url: str, rate_rps: float, seed: int) -> tuple[float, Window]:
    start_ns = time.time_ns()
    attainment = _attainment(url, rate_rps, seed)
    return attainment, Window(start_ns, time.time_ns())


def step_time_ratio(steps: StepTable, window: Window, reference: Window) -> float | None:
    """How many times longer the server's decode-only steps took in `window` than in `reference`, at equal
    batch sizes: per batch size the ratio of mean step durations, then the median of those ratios weighted
    by the steps compared. Means within a batch size, because time the machine loses to other work (a
    stalled virtual CPU) lengthens some steps without moving the median step, and costs capacity all the
    same; the median across batch sizes, so that one stall does not decide the ratio. Independent of the
    report's model: raw step spans, no fit. None when fewer than MIN_STEPS_COMPARED steps could be paired
    (the two runs' batches did not overlap)."""
    decode_only = steps.prefill_tokens == 0

    def inside(w: Window) -> np.ndarray:
        return decode_only & (steps.start_ns >= w.start_ns) & (steps.start_ns < w.end_ns)

    in_window, in_reference = inside(window), inside(reference)
    ratios, counts = [], []
    for batch in np.unique(steps.decode_requests[in_window]):
        here = in_window & (steps.decode_requests == batch)
        there = in_reference & (steps.decode_requests == batch)
        compared = min(int(here.sum()), int(there.sum()))
        if compared >= MIN_STEPS_PER_BATCH:
            ratios.append(float(np.mean(steps.duration_s[here]) / np.mean(steps.duration_s[there])))
            counts.append(compared)
    if sum(counts) < MIN_STEPS_COMPARED:
        return None
    return float(np.quantile(ratios, 0.5, weights=counts, method="inverted_cdf"))


def _chained_step_time_ratios(steps: StepTable, traced: Window, windows: dict[str, Window]) -> dict[str, float | None]:
    """Each window's step_time_ratio against the traced run, taken through the window before it: runs at
    neighbouring rates share batch sizes, while the traced run's batches (up to about ten requests) and the
    FAIL_AT run's (nearly all full) do not. `windows` in the order they ran."""
    ratios: dict[str, float | None] = {}
    previous: Window = traced
    previous_ratio: float | None = 1.0
    for check, window in windows.items():
        step = step_time_ratio(steps, window, previous)
        ratio = None if step is None or previous_ratio is None else step * previous_ratio
        ratios[check], previous, previous_ratio = ratio, window, ratio
    return ratios


@dataclass
class Try:
    """One traced run, its predictions, and every layout measured at the rates they imply."""

    colocated: OptionResult
    split: OptionResult
    attainment: dict[str, float] = field(default_factory=dict)
    # Per colocated check: its run's step_time_ratio against the traced run (None: not comparable).
    step_time_ratio: dict[str, float | None] = field(default_factory=dict)

    def failures(self) -> list[str]:
        passes = {
            "colocated at PASS_AT": self.attainment["colocated at PASS_AT"] >= TARGET_ATTAINMENT,
            "colocated at FAIL_AT": self.attainment["colocated at FAIL_AT"] < TARGET_ATTAINMENT,
            "split at PASS_AT": self.attainment["split at PASS_AT"] >= TARGET_ATTAINMENT,
        }
        return [check for check, passed in passes.items() if not passed]

    def machine_moved(self, check: str) -> bool:
        """Whether the machine ran `check`'s run at another speed than the traced run (unknown: no)."""
        ratio = self.step_time_ratio.get(check)
        return ratio is not None and max(ratio, 1 / ratio) > MAX_MACHINE_SPEED_CHANGE

    def describe(self) -> str:
        ratios = {check: None if r is None else round(r, 2) for check, r in self.step_time_ratio.items()}
        return (
            f"predicted {self.colocated.goodput_per_gpu:.3f} / {self.split.goodput_per_gpu:.3f} req/s/GPU;"
            f" attainment {self.attainment}; decode step time over the traced run's {ratios}"
        )


def _try(workdir: Path) -> Try:
    workdir.mkdir()
    traces = workdir / "traces.jsonl"
    # Every decode-only step's span kept (the default keeps 1 in 10), for step_time_ratio.
    colocated_args = ["--mode", "colocated", "--workers", str(WORKERS), "--step-sample", "1"]
    with _serve(colocated_args, workdir / "colocated.log", traces) as server:
        _warm(server.url)
        # The premise: a traced run below capacity (about half of it on this machine when quiet). A machine
        # busy enough that the traced rate already misses the objective is traced again, slower, until it
        # meets it: the fit is then taken where the prediction is meant to start from.
        traced_rate_rps = TRACED_RATE_RPS
        traced_attainment, traced = _timed_attainment(server.url, traced_rate_rps, seed=11)
        while traced_attainment < TARGET_ATTAINMENT and traced_rate_rps > MIN_TRACED_RATE_RPS:
            print(f"traced at {traced_rate_rps:g} req/s: attainment {traced_attainment:.2f}, below the objective")
            traced_rate_rps *= TRACED_RATE_BACKOFF
            traced_attainment, traced = _timed_attainment(server.url, traced_rate_rps, seed=11)
        fitted = traces
        if traced_rate_rps != TRACED_RATE_RPS:  # only the last traced run is fitted, not the overloaded ones
            fitted = workdir / "traced.jsonl"
            copy_window(traces, fitted, traced.start_ns, traced.end_ns)  # spans kept by their start
        predicted = _predictions(fitted)
        result = Try(predicted[f"colocated x{WORKERS}"], predicted["split 1:1"], {"traced": traced_attainment})
        assert result.colocated.goodput_per_gpu > result.split.goodput_per_gpu, predicted  # the report's order
        windows = {}
        for check, at, seed in (("colocated at PASS_AT", PASS_AT, 12), ("colocated at FAIL_AT", FAIL_AT, 13)):
            rate_rps = at * result.colocated.goodput_per_gpu * WORKERS
            result.attainment[check], windows[check] = _timed_attainment(server.url, rate_rps, seed)
    result.step_time_ratio = _chained_step_time_ratios(load_traces([traces]).steps, traced, windows)
    split_args = ["--mode", "disaggregated", "--prefill-workers", "1", "--decode-workers", "1"]
    with _serve(split_args, workdir / "split.log") as split_server:
        _warm(split_server.url)
        rate_rps = PASS_AT * result.split.goodput_per_gpu * WORKERS
        result.attainment["split at PASS_AT"] = _attainment(split_server.url, rate_rps, seed=12)
    return result


def test_predicted_goodput_holds_on_the_served_layouts(tmp_path: Path) -> None:
    result = _try(tmp_path / "first")
    failed = result.failures()
    if failed and all(result.machine_moved(check) for check in failed):
        print(f"failed {failed} on a machine whose speed moved ({result.describe()}): trying again")
        result = _try(tmp_path / "second")
    print(result.describe())  # shown by pytest -s, and with any failure
    assert not result.failures(), result.describe()
