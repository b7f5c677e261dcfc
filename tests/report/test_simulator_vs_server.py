"""The simulator, fitted on a real reference-server run, predicts that run's latencies.

One configuration: the `small` preset, one colocated worker, a steady stream of short requests with a
long prompt every 2 s. Each short request decodes for longer than that, so nearly every one of them sees
a long prefill stall its decode: the per-request inter-token p99 is that interference, not scheduler
noise, and its median is a stable quantity to predict. The report fits
step and prefill costs from the run's traces, replays the observed arrivals through the discrete-event
model on the observed layout, and the predicted medians must match the measured ones.
"""

from __future__ import annotations

import numpy as np

from reference_server.process import ServerProcess
from tracer.load import SLO as LoadSLO
from tracer.load import BurstSpec, LengthSpec, LoadConfig, run_load_sync
from tracer.report.build import ReportOptions, report_from_data
from tracer.report.load import load_traces
from tracer.report.simulate import SLO

# Stated errors: TTFT median within 35%, median per-request ITL p99 within 35%. The model is a fit over a
# few hundred steps on a machine shared with other work; tighter bounds would test the noise.
TTFT_REL_ERROR = 0.35
ITL_REL_ERROR = 0.35


def test_simulated_ttft_and_itl_p99_match_a_measured_reference_server_run(tmp_path):
    traces = tmp_path / "traces.jsonl"
    with ServerProcess(["--preset", "small", "--mode", "colocated", "--workers", "1", "--traces-file", str(traces)]) as server:
        result = run_load_sync(LoadConfig(
            url=server.url, model="small", rate_rps=2.0, duration_s=15.0, prompt=LengthSpec(64),
            output=LengthSpec(64), burst=BurstSpec(every_s=2.0, count=1, prompt_tokens=768),
            slo=LoadSLO(ttft_s=2.0, itl_s=0.2), seed=5,
        ))  # fmt: skip
    assert result.summary.errors == 0

    slo = SLO(ttft_s=2.0, itl_s=0.2)
    data = load_traces([traces])
    assert len(data.requests) == result.summary.ok
    report = report_from_data(data, ReportOptions(slo))
    check = report.model_check
    predicted_ttft, measured_ttft = check["predicted_ttft_p50_s"], check["measured_ttft_p50_s"]
    predicted_itl, measured_itl = check["predicted_itl_p50_s"], check["measured_itl_p50_s"]
    detail = (f"TTFT p50 predicted {predicted_ttft * 1e3:.1f} ms vs measured {measured_ttft * 1e3:.1f} ms; "
              f"ITL p99 (median request) predicted {predicted_itl * 1e3:.1f} ms vs measured {measured_itl * 1e3:.1f} ms")  # fmt: skip
    assert abs(predicted_ttft - measured_ttft) <= TTFT_REL_ERROR * measured_ttft, detail
    assert abs(predicted_itl - measured_itl) <= ITL_REL_ERROR * measured_itl, detail
    assert np.isfinite(predicted_ttft) and np.isfinite(predicted_itl)
    print(detail)
