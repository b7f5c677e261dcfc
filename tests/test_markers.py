"""The inner loop (`-m "not slow and not live"`) starts no reference server: every test module under
tests/reference_server that starts one (`server_harness.Server`) is on a slow path of tests/conftest.py."""

from __future__ import annotations

import ast

from tests.conftest import REPO_ROOT, SLOW_PATHS


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
