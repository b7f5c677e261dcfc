"""Run `promtool check rules` and `promtool test rules` on the committed rules and their unit tests.

Blocking: each call runs promtool as a subprocess and waits for it (seconds, not minutes).
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tracer.alerts.rules import RULES_PATH

TESTS_DIR = RULES_PATH.parent / "tests"
_TIMEOUT_S = 120


class PromtoolMissing(RuntimeError):
    """promtool is not on PATH (Debian/Ubuntu: `apt-get install prometheus`)."""


@dataclass(frozen=True)
class PromtoolResult:
    command: list[str]
    returncode: int
    output: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def promtool_path() -> str:
    path = shutil.which("promtool")
    if path is None:
        raise PromtoolMissing("promtool not found on PATH; install Prometheus (Debian: apt-get install prometheus)")
    return path


def _run(args: list[str], cwd: Path) -> PromtoolResult:
    command = [promtool_path(), *args]
    completed = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=_TIMEOUT_S, check=False)
    return PromtoolResult(command, completed.returncode, completed.stdout + completed.stderr)


def check_rules(rules_path: Path = RULES_PATH) -> PromtoolResult:
    """`promtool check rules`: syntax, PromQL, templates of every rule."""
    return _run(["check", "rules", str(rules_path)], cwd=rules_path.parent)


def unit_test_files(tests_dir: Path = TESTS_DIR) -> list[Path]:
    return sorted(tests_dir.glob("*.yaml"))


def run_unit_tests(tests_dir: Path = TESTS_DIR) -> PromtoolResult:
    """`promtool test rules` on every alerts/tests/*.yaml (they name ../rules.yaml themselves)."""
    files = unit_test_files(tests_dir)
    if not files:
        raise FileNotFoundError(f"no promtool unit tests (*.yaml) in {tests_dir}")
    return _run(["test", "rules", *(f.name for f in files)], cwd=tests_dir)
