"""Each extra the suite does not install alone, installed alone: a fresh venv, the wheel with that extra's
own requirements, and its command run from a folder that is not the repository.

tests/packaging/test_extras_alone.py covers the installs users make most (the base, `report`, `sidecar`)
in the test command; this covers the rest (`export`, `load`, `dashboards`, `alerts`, `server`), which
together take minutes (`server` alone resolves torch). Each case prints its install and command times
and whether the command worked; bench/RESULTS.md ("Extras installed alone") records a run.

The wheel's requirements come from wherever this machine's pip finds them (its index or cache); a torch
requirement can resolve to a multi-GB CUDA build unless pip's index serves the CPU one (the set-up script
installs torch==2.13.0 first for the same reason).

Run: `python bench/extras_alone.py [--only export,load]` from the repository root (several minutes).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# extra -> (the command a user of it runs first, text its output must hold)
CASES: dict[str, tuple[list[str], str]] = {
    "export": (
        [
            "python",
            "-c",
            "from tracer import TraceContext, start_tracing; from tracer import spans as s; "
            "x = start_tracing('colocated', 'w0', traces_file='traces.jsonl'); "
            "x.tracer.stage('prefill', TraceContext.new_root().child(s.new_span_id()), 0, 10**6); "
            "x.shutdown(5.0); print(open('traces.jsonl').read().count('splitscope.prefill'))",
        ],
        "1",
    ),
    "load": (["splitscope", "load", "--help"], "--replay"),
    "dashboards": (["splitscope", "dashboards", "build", "--check"], "up to date"),
    "alerts": (["splitscope", "alerts", "check"], "SUCCESS"),
    "server": (["splitscope", "serve", "--help"], "--mode"),
}


def build_wheel(out: Path) -> Path:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(REPO_ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = out.glob("splitscope-*.whl")
    return wheel


def _environ() -> dict[str, str]:
    """This environment minus what would point a child at it (its venv, its path)."""
    return {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}


def try_extra(wheel: Path, extra: str, where: Path) -> tuple[float, float, bool, str]:
    """(install seconds, command seconds, whether the command worked, the tail of what went wrong)."""
    env = where / "venv"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True, capture_output=True, timeout=300)
    pip = [str(env / "bin" / "python"), "-m", "pip", "install", "-q", "--only-binary", ":all:", "--no-compile"]
    installed = subprocess.run(
        [*pip, f"{wheel}[{extra}]"], capture_output=True, text=True, timeout=1800, env=_environ(), cwd=where
    )
    install_s = time.perf_counter() - start
    if installed.returncode != 0:
        return install_s, 0.0, False, (installed.stdout + installed.stderr)[-1500:]
    command, expected = CASES[extra]
    start = time.perf_counter()
    ran = subprocess.run(
        [str(env / "bin" / command[0]), *command[1:]],
        capture_output=True,
        text=True,
        timeout=600,
        env=_environ(),
        cwd=where,
    )
    command_s = time.perf_counter() - start
    output = ran.stdout + ran.stderr
    worked = ran.returncode == 0 and expected in output
    return install_s, command_s, worked, "" if worked else output[-1500:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(CASES), help="comma-separated extras (default: all of them)")
    args = parser.parse_args()
    extras = [e for e in args.only.split(",") if e]
    unknown = sorted(set(extras) - set(CASES))
    if unknown:
        parser.error(f"unknown extras {unknown}; known: {sorted(CASES)}")
    failed = 0
    with tempfile.TemporaryDirectory(prefix="extras-alone-") as tmp:
        wheel = build_wheel(Path(tmp) / "dist")
        print(f"{'extra':<12}{'install s':>10}{'command s':>11}  result")
        for extra in extras:
            where = Path(tmp) / extra
            where.mkdir()
            install_s, command_s, worked, detail = try_extra(wheel, extra, where)
            failed += not worked
            print(f"{extra:<12}{install_s:>10.1f}{command_s:>11.1f}  {'ok' if worked else 'FAILED'}", flush=True)
            if detail:
                print("    " + detail.replace("\n", "\n    "))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
