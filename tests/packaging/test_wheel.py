"""The wheel a user installs: built from this tree, installed (not editable) into a fresh environment,
run from a folder that is not the repository. Its data ships with it and every command finds it."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO_ROOT
from tracer.vocabulary import Verdict

SHIPPED_DATA = (
    "tracer/alerts/rules.yaml",
    "tracer/alerts/runbook.md",
    "tracer/alerts/tests/slo.yaml",
    "tracer/dashboards/generated/overview.json",
    "tracer/dashboards/generated/interference.json",
    "tracer/deploy/prometheus.yml",
    "tracer/deploy/otel-collector.yaml",
)


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A fresh virtual environment holding the wheel. Its dependencies come from this test's environment
    through a path file (the same versions, nothing downloaded); that environment's editable install of
    the repository is not activated there, so `tracer` can only come from the wheel. Whether each extra's
    own requirements are enough is test_extras_alone.py's question."""
    env = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=False).create(env)
    site_packages = Path(sysconfig.get_path("purelib", vars={"base": str(env), "platbase": str(env)}))
    (site_packages / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(env / "bin" / "python"),
            "install",
            "--no-deps",
            "-q",
            str(wheel),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return env


def _run(env: Path, *args: str, cwd: Path, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(env / "bin" / args[0]), *args[1:]],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        stdin=subprocess.DEVNULL,
    )


def test_the_wheel_ships_its_data_under_the_toolkit_and_no_generic_top_level_names(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    missing = [name for name in SHIPPED_DATA if name not in names]
    assert not missing, f"not in the wheel: {missing}"
    top_level = {name.split("/")[0] for name in names if not name.startswith("splitscope-")}
    assert top_level == {"tracer", "reference_server"}  # no bare `alerts` or `dashboards` in site-packages


def test_every_command_runs_from_the_installed_wheel(installed, tmp_path):
    where = _run(
        installed,
        "python",
        "-c",
        "import tracer, tracer.alerts; print(tracer.__file__, tracer.alerts.__file__)",
        cwd=tmp_path,
    )
    assert where.returncode == 0, where.stderr
    assert all(str(installed) in path for path in where.stdout.split()), where.stdout  # not the repository
    assert _run(installed, "python", "-c", "import alerts", cwd=tmp_path).returncode != 0

    help_text = _run(installed, "splitscope", "--help", cwd=tmp_path)
    assert help_text.returncode == 0 and "report" in help_text.stdout, help_text.stderr

    alerts = _run(installed, "splitscope", "alerts", "check", cwd=tmp_path)
    assert alerts.returncode == 0, alerts.stdout + alerts.stderr
    assert "SUCCESS" in alerts.stdout  # promtool ran the packaged rules and their unit tests

    dashboards = _run(installed, "splitscope", "dashboards", "build", "--check", cwd=tmp_path)
    assert dashboards.returncode == 0, dashboards.stdout + dashboards.stderr
    assert "up to date" in dashboards.stdout

    copied = _run(installed, "splitscope", "deploy-files", "stack", cwd=tmp_path)
    assert copied.returncode == 0, copied.stderr
    prometheus_yml = yaml.safe_load((tmp_path / "stack/deploy/prometheus.yml").read_text())
    for rule_file in prometheus_yml["rule_files"]:  # relative to the config file, as Prometheus reads it
        assert (tmp_path / "stack/deploy" / rule_file).is_file(), rule_file
    assert (tmp_path / "stack/dashboards/generated/overview.json").is_file()
    shipped = {p.name for p in (tmp_path / "stack/deploy").iterdir()}
    in_repository = {p.name for p in (REPO_ROOT / "deploy").iterdir() if p.suffix != ".py" and p.name != "__pycache__"}
    assert shipped == in_repository  # every collector config, the advisors' routing included
    assert _run(installed, "splitscope", "deploy-files", "stack", cwd=tmp_path).returncode != 0  # no silent overwrite


def test_the_installed_tracer_writes_traces_the_installed_report_reads(installed, tmp_path):
    traces = tmp_path / "traces.jsonl"
    record = textwrap.dedent(f"""
        from tracer import TraceContext, start_tracing
        from tracer import spans as s
        session = start_tracing("colocated", "w0", traces_file={str(traces)!r})
        router = start_tracing(None, None, traces_file={str(traces)!r})
        tracer, ms = session.tracer, 1_000_000
        for i in range(40):
            t0 = i * 50 * ms
            ctx = TraceContext.new_root()
            root = s.new_span_id()
            child = ctx.child(root)
            tracer.stage("queue", child, t0, t0 + ms)
            tracer.stage("prefill", child, t0 + ms, t0 + 11 * ms, {{s.ATTR_PREFILL_TOKENS: 200 + 10 * i}})
            tracer.step(t0 + ms, t0 + 11 * ms, 1, 200 + 10 * i, 300)
            router.tracer.request(ctx, root, t0, t0 + 30 * ms, t0 + 11 * ms, model="tiny", mode="colocated",
                                  request_id=f"r{{i}}", input_tokens=200 + 10 * i, output_tokens=8)
        session.shutdown(5.0)
        router.shutdown(5.0)
    """)
    recorded = _run(installed, "python", "-c", record, cwd=tmp_path)
    assert recorded.returncode == 0, recorded.stderr
    report = _run(
        installed,
        "splitscope",
        "report",
        str(traces),
        "--slo-ttft",
        "0.5",
        "--slo-itl",
        "0.1",
        "--format",
        "json",
        cwd=tmp_path,
        timeout_s=300,
    )
    assert report.returncode == 0, report.stdout[-2000:] + report.stderr[-2000:]
    result = json.loads(report.stdout)
    assert result["read"]["requests"] == 40 and result["read"]["steps"] == 40  # what the wheel's tracer wrote
    assert result["verdict"] in set(Verdict)  # 40 requests: a verdict or a reasoned insufficient-data
