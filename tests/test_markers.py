"""The inner loop (`-m "not slow and not live"`) starts no reference server: every test module under
tests/reference_server that starts one (`server_harness.Server`) is on a slow path of tests/conftest.py, and
every conftest.py whose fixtures start one names them in SERVER_FIXTURES (which marks the tests asking
for them slow)."""

from __future__ import annotations

import ast

from tests.conftest import REPO_ROOT, SERVER_FIXTURES, SLOW_PATHS


def _starts_a_server(tree: ast.Module) -> bool:
    return any(
        isinstance(node, ast.ImportFrom)
        and (node.module or "").endswith("server_harness")
        and any(alias.name == "Server" for alias in node.names)
        for node in ast.walk(tree)
    )


def test_every_reference_server_module_that_starts_a_server_is_marked_slow():
    folder = REPO_ROOT / "tests" / "reference_server"
    starting = [
        path.relative_to(REPO_ROOT).as_posix()
        for path in sorted(folder.glob("test_*.py"))
        if _starts_a_server(ast.parse(path.read_text(encoding="utf-8")))
    ]
    assert len(starting) >= 7, starting  # the guard sees the modules it guards
    unmarked = [path for path in starting if not path.startswith(SLOW_PATHS)]
    assert not unmarked, "add these to SLOW_PATHS in tests/conftest.py:\n" + "\n".join(unmarked)


def _fixtures_that_start_a_server(tree: ast.Module) -> set[str]:
    """Names of the module's functions that call `Server(...)` (in a conftest.py: its fixtures)."""
    return {
        function.name
        for function in ast.walk(tree)
        if isinstance(function, ast.FunctionDef)
        and any(
            isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "Server"
            for call in ast.walk(function)
        )
    }


def test_every_fixture_that_starts_a_server_is_named_in_server_fixtures():
    unnamed = []
    for conftest in sorted((REPO_ROOT / "tests").rglob("conftest.py")):
        tree = ast.parse(conftest.read_text(encoding="utf-8"))
        if not _starts_a_server(tree):
            continue
        folder = conftest.parent.relative_to(REPO_ROOT).as_posix() + "/"
        if folder.startswith(SLOW_PATHS):
            continue
        named = set(SERVER_FIXTURES.get(folder, ()))
        unnamed += [f"{folder}conftest.py::{name}" for name in _fixtures_that_start_a_server(tree) - named]
    assert "tests/security/" in SERVER_FIXTURES  # the guard sees the package it was written for
    assert not unnamed, "add these to SERVER_FIXTURES in tests/conftest.py:\n" + "\n".join(unnamed)
