"""The contract's names are defined once (tracer/vocabulary.py): no producer or reader types one again."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import msgspec

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
    return [(line, value) for line, value, _ in _string_constants(tree)]


def _string_constants(tree: ast.Module) -> list[tuple[int, str, int]]:
    """(line, value, node id) of every string constant that is not a docstring."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.lineno, node.value, id(node))
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


# The closed vocabularies are StrEnums: code names a member (`Mode.CHUNKED`), never its value in quotes, so
# the type checker finds a typo. Outside tracer/vocabulary.py, a string equal to a member's value is a stray,
# except in docstrings and in `__all__`/`__slots__` (identifiers that happen to read the same, e.g. the
# model's `prefill` function) and in the places below, each with why.
CLOSED_VOCABULARIES = (
    vocabulary.Mode,
    vocabulary.Pool,
    vocabulary.Role,
    vocabulary.SchedulerPolicy,
    vocabulary.Verdict,
)
CLOSED_VALUES = {member.value for enum in CLOSED_VOCABULARIES for member in enum}
CLOSED_PACKAGES = ("tracer", "reference_server")
ALLOWED_STRAYS: dict[str, set[str]] = {}  # path -> the values it may quote


def _identifier_lists(tree: ast.Module) -> set[int]:
    """ids of the string constants in `__all__ = (...)` and `__slots__ = (...)` assignments."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id in ("__all__", "__slots__") for t in node.targets
        ):
            out |= {id(c) for c in ast.walk(node.value) if isinstance(c, ast.Constant)}
    return out


def closed_vocabulary_strays(root: Path, packages: tuple[str, ...] = CLOSED_PACKAGES) -> list[str]:
    """`path:line: 'value'` of every quoted member value outside the vocabulary and the allowed places."""
    strays = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            if relative == "tracer/vocabulary.py":
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            skipped = _identifier_lists(tree)
            allowed = ALLOWED_STRAYS.get(relative, set())
            for line, value, node_id in _string_constants(tree):
                if value in CLOSED_VALUES and node_id not in skipped and value not in allowed:
                    strays.append(f"{relative}:{line}: {value!r}")
    return strays


def test_no_mode_pool_role_policy_or_verdict_is_quoted_outside_the_vocabulary():
    strays = closed_vocabulary_strays(REPO_ROOT)
    assert not strays, "name the tracer.vocabulary member instead:\n" + "\n".join(strays)


def test_the_closed_vocabulary_guard_finds_a_quoted_member(tmp_path):
    package = tmp_path / "tracer"
    package.mkdir()
    (package / "layout.py").write_text(
        '"""Docstrings may say "chunked"."""\n'
        '__all__ = ("prefill",)\n'
        "def prefill(mode):\n"
        '    """Or \'split\'."""\n'
        '    return mode == "chunked" or mode in ("merge", "any")\n'
    )
    assert closed_vocabulary_strays(tmp_path, ("tracer",)) == [
        "tracer/layout.py:5: 'chunked'",
        "tracer/layout.py:5: 'merge'",
    ]


def test_the_vocabularies_map_onto_one_another():
    # Every role runs a policy and serves a pool; every mode's roles exist; each pool is some role's.
    assert set(vocabulary.POLICY_OF_ROLE) == set(vocabulary.Role) == set(vocabulary.POOL_OF_ROLE)
    assert set(vocabulary.POLICY_OF_ROLE.values()) == set(vocabulary.SchedulerPolicy)
    assert set(vocabulary.ROLES_OF_MODE) == set(vocabulary.Mode)
    assert sorted(r for roles in vocabulary.ROLES_OF_MODE.values() for r in roles) == sorted(vocabulary.Role)
    assert set(vocabulary.POOL_OF_ROLE.values()) == set(vocabulary.Pool)
    assert vocabulary.POOLS_OF_MODE == {
        vocabulary.Mode.COLOCATED: (vocabulary.Pool.COLOCATED,),
        vocabulary.Mode.CHUNKED: (vocabulary.Pool.COLOCATED,),
        vocabulary.Mode.DISAGGREGATED: (vocabulary.Pool.PREFILL, vocabulary.Pool.DECODE),
    }


def test_a_member_is_its_value_in_text_json_and_msgspec():
    # The report's JSON and Markdown stay the same whether a field holds a member or its value.
    member = vocabulary.Mode.COLOCATED
    assert f"{member}" == str(member) == "colocated" and "%s" % member == "colocated"
    assert json.dumps({member: [member]}) == '{"colocated": ["colocated"]}'
    assert msgspec.json.encode({member: [member]}) == b'{"colocated":["colocated"]}'


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
