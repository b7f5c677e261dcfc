"""The contract's names are defined once (tracer/vocabulary.py): no producer or reader types one again."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO_ROOT
from tracer import vocabulary

# Every span name and attribute name of the contract (a rename is a one-line change in the vocabulary).
CONTRACT_NAMES = {
    value
    for name, value in vars(vocabulary).items()
    if name.startswith(("SPAN_", "ATTR_", "EVENT_")) and isinstance(value, str)
}
PACKAGES = ("tracer", "reference_server", "alerts", "dashboards")


def _string_literals(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def test_no_contract_name_is_typed_outside_the_vocabulary():
    strays = []
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            if path == REPO_ROOT / "tracer" / "vocabulary.py" or "generated" in path.parts:
                continue
            for line, value in _string_literals(path):
                if value in CONTRACT_NAMES:
                    strays.append(f"{path.relative_to(REPO_ROOT)}:{line}: {value!r}")
    assert not strays, "import these from tracer.vocabulary instead:\n" + "\n".join(strays)


def test_the_vocabulary_has_no_duplicate_names():
    values = [
        v for n, v in vars(vocabulary).items() if n.startswith(("SPAN_", "ATTR_", "EVENT_")) and isinstance(v, str)
    ]
    assert len(values) == len(set(values))


def test_the_report_is_pure_computation():
    probe = "import sys, tracer.report.cli, tracer.report.build; print(sorted(m for m in ('torch', 'reference_server') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
