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
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from reference_server.kv_cache import kv_bytes_per_token
from reference_server.launch import ServeConfig
from reference_server.model import ModelArgs
from reference_server.process import ServerProcess
from tracer.load import ClientSLO, LengthSpec, LoadConfig, run_load_sync
from tracer.report.build import OptionResult, ReportOptions, build_report
from tracer.report.simulate import SLO

PRESET = "small"
WORKERS = 2
SLO_TTFT_S, SLO_ITL_S = 2.0, 0.15
PROMPT, OUTPUT = LengthSpec(64), LengthSpec(128)
TRACED_RATE_RPS = 3.0  # total; batches of several requests per worker, so the fit sees the batches it prices
HORIZON_S = 20.0
MIN_REQUESTS = 40
PASS_AT, FAIL_AT = 0.75, 1.5


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


@pytest.fixture(scope="module")
def colocated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    workdir = tmp_path_factory.mktemp("verdict")
    traces = workdir / "traces.jsonl"
    with _serve(["--mode", "colocated", "--workers", str(WORKERS)], workdir / "colocated.log", traces) as server:
        _warm(server.url)
        yield server, traces


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


def test_predicted_goodput_holds_on_the_served_layouts(colocated: tuple[ServerProcess, Path], tmp_path: Path) -> None:
    server, traces = colocated
    traced_attainment = _attainment(server.url, TRACED_RATE_RPS, seed=11)
    predicted = _predictions(traces)
    best, split = predicted[f"colocated x{WORKERS}"], predicted["split 1:1"]
    assert best.goodput_per_gpu > split.goodput_per_gpu, predicted  # the report's order on short prompts
    measured = {
        "traced": traced_attainment,
        "colocated at PASS_AT": _attainment(server.url, PASS_AT * best.goodput_per_gpu * WORKERS, seed=12),
        "colocated at FAIL_AT": _attainment(server.url, FAIL_AT * best.goodput_per_gpu * WORKERS, seed=13),
    }
    split_args = ["--mode", "disaggregated", "--prefill-workers", "1", "--decode-workers", "1"]
    with _serve(split_args, tmp_path / "split.log") as split_server:
        _warm(split_server.url)
        measured["split at PASS_AT"] = _attainment(split_server.url, PASS_AT * split.goodput_per_gpu * WORKERS, seed=12)
    context = f"predicted {best.goodput_per_gpu:.3f} / {split.goodput_per_gpu:.3f} req/s/GPU; attainment {measured}"
    print(context)  # shown by pytest -s, and with any failure
    assert measured["colocated at PASS_AT"] >= 0.9, context
    assert measured["colocated at FAIL_AT"] < 0.9, context
    assert measured["split at PASS_AT"] >= 0.9, context
