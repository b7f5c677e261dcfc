"""`splitscope report --metrics-file`: an engine's /metrics capture read with prometheus_client's parser.

Checked against what the report did not write: a real vLLM 0.32 capture (tests/sidecar/fixtures; its
own `_count` and `_bucket` lines, read here line by line) and captures written by prometheus_client
itself from samples whose quantiles numpy computes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from tests.vllm_layouts import VLLM_ITL_BUCKETS_S
from tracer.report.cli import report_command
from tracer.report.metrics_file import (
    VLLM_GAP_FAMILIES,
    VLLM_STEP_TOKENS_FAMILY,
    MetricsFileError,
    read_metrics_file,
)

FIXTURES = Path(__file__).parents[1] / "sidecar" / "fixtures"
VLLM_CAPTURE = FIXTURES / "vllm-worker-metrics.txt"


def _sample_total(text: str, sample: str, le: str | None = None) -> float:
    """Sum of a sample's values over its label sets, read line by line from the exposition."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(sample + "{") and (le is None or f'le="{le}"' in line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_real_vllm_capture_reads_as_vllms_own_counts():
    text = VLLM_CAPTURE.read_text()
    metrics = read_metrics_file(VLLM_CAPTURE)
    gaps, steps = metrics.gaps, metrics.step_tokens
    assert gaps is not None and steps is not None
    assert gaps.family == VLLM_GAP_FAMILIES[0]
    assert gaps.count == _sample_total(text, f"{gaps.family}_count") > 0
    assert gaps.sum == pytest.approx(_sample_total(text, f"{gaps.family}_sum"))
    assert steps.count == _sample_total(text, f"{VLLM_STEP_TOKENS_FAMILY}_count") > 0
    assert steps.mean == pytest.approx(_sample_total(text, f"{VLLM_STEP_TOKENS_FAMILY}_sum") / steps.count)
    # The share over an edge is exact: the observations above that bucket's cumulative count.
    within = _sample_total(text, f"{gaps.family}_bucket", le="0.025")
    assert gaps.share_above(0.025) == pytest.approx(1 - within / gaps.count)
    # The median lies in the bucket holding the middle observation.
    assert 0 <= gaps.quantile(0.5) <= 0.01 if within / gaps.count > 0.5 else gaps.quantile(0.5) > 0.01


def test_the_older_gap_family_is_read_when_the_newer_is_absent(tmp_path):
    older = tmp_path / "older.txt"
    older.write_text(VLLM_CAPTURE.read_text().replace(VLLM_GAP_FAMILIES[0], VLLM_GAP_FAMILIES[1]))
    metrics = read_metrics_file(older)
    assert metrics.gaps is not None and metrics.gaps.family == VLLM_GAP_FAMILIES[1]


def test_label_sets_are_summed_and_quantiles_fall_in_numpys_bucket(tmp_path):
    registry = CollectorRegistry()
    family = Histogram(VLLM_GAP_FAMILIES[0], "gaps", ["engine"], registry=registry, buckets=VLLM_ITL_BUCKETS_S)
    rng = np.random.default_rng(3)
    samples = {engine: rng.lognormal(np.log(0.03), 0.8, 4000) for engine in ("0", "1")}
    for engine, values in samples.items():
        for value in values:
            family.labels(engine=engine).observe(float(value))
    path = tmp_path / "two-engines.txt"
    path.write_bytes(generate_latest(registry))
    gaps = read_metrics_file(path).gaps
    assert gaps is not None
    everything = np.concatenate(list(samples.values()))
    assert gaps.count == len(everything) and gaps.sum == pytest.approx(everything.sum())
    edges = np.array((0.0, *VLLM_ITL_BUCKETS_S, np.inf))
    for q in (0.5, 0.9, 0.99):
        truth = np.quantile(everything, q)
        bucket = np.searchsorted(edges, truth)
        assert edges[bucket - 1] <= gaps.quantile(q) <= edges[bucket], q
    for edge in (0.025, 0.1):
        assert gaps.share_above(edge) == pytest.approx(np.mean(everything > edge))


@pytest.mark.parametrize(
    "content, says",
    [
        ("", "no vllm:"),
        ("this is not\n the text format {{{\n", "not a Prometheus text exposition"),
        ((FIXTURES / "dynamo-frontend-metrics.txt").read_text(), "no vllm:"),
    ],
)
def test_a_bad_metrics_file_is_one_clear_error(tmp_path, content, says):
    bad = tmp_path / "bad.txt"
    bad.write_text(content)
    with pytest.raises(MetricsFileError, match=says):
        read_metrics_file(bad)
    traces = tmp_path / "traces.jsonl"
    traces.write_text("")
    args = [str(traces), "--slo-ttft", "1", "--slo-itl", "0.1", "--metrics-file", str(bad)]
    result = CliRunner().invoke(report_command, args)
    assert result.exit_code != 0
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: metrics file") and says in lines[0], result.output


def test_the_report_command_takes_a_real_capture_and_says_what_it_took(scenario_traces, tmp_path):
    sc, traces, _ = scenario_traces("wrong-split")
    out = tmp_path / "report.json"
    args = [
        str(traces),
        "--slo-ttft",
        str(sc.slo_ttft_s),
        "--slo-itl",
        str(sc.slo_itl_s),
        "--sim-requests",
        "100",
        "--confidence-resamples",
        "0",
        "--metrics-file",
        str(VLLM_CAPTURE),
        "--format",
        "json",
        "-o",
        str(out),
    ]
    result = CliRunner().invoke(report_command, args)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    text = VLLM_CAPTURE.read_text()
    gaps = _sample_total(text, f"{VLLM_GAP_FAMILIES[0]}_count")
    steps = _sample_total(text, f"{VLLM_STEP_TOKENS_FAMILY}_count")
    assert any(f"({VLLM_GAP_FAMILIES[0]}, {gaps:.0f} gaps)" in line for line in report["evidence"]), report["evidence"]
    assert any(f"({VLLM_STEP_TOKENS_FAMILY}, {steps:.0f} steps)" in line for line in report["evidence"])
    assert any(line.startswith(f"from the metrics file {VLLM_CAPTURE}") for line in report["assumptions"])
