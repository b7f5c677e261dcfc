"""Applications stand side by side (architecture.md section 1, "Layers"): none imports another's modules.

Read with the ast module, so it holds for imports inside functions too. An application may import the shared
layers (the tracer core, tracer.vocabulary, tracer.metrics, tracer.otlp, tracer.engines,
tracer.export, tracer.cli) and, where `ALLOWED` says so and why, a named module of another application.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO_ROOT

# Source folder -> the import name of its package (alerts/ and dashboards/ install as tracer.*).
PACKAGES = {
    "tracer": "tracer",
    "alerts": "tracer.alerts",
    "dashboards": "tracer.dashboards",
    "reference_server": "reference_server",
}
APPLICATIONS = (
    "tracer.report",
    "tracer.sidecar",
    "tracer.load",
    "tracer.explain",
    "tracer.advise",
    "tracer.alerts",
    "tracer.dashboards",
    "reference_server",
)
# (importing application, imported module or package): why it may. Keep this short; architecture.md lists it.
ALLOWED = {
    ("tracer.explain", "tracer.report"): "explain is built on the report's trace model (its reader and tables)",
    ("tracer.advise", "tracer.report"): "advise runs the report's decision per time window",
    ("tracer.report", "tracer.explain"): "the why-missed section runs explain's stall attribution and TTFT "
    "parts (report/why.py); the one way back, until the attribution moves to a shared layer",
    ("tracer.dashboards", "tracer.alerts.settings"): "panels draw the rules' thresholds: one place for each",
    ("tracer.dashboards", "tracer.alerts.rules"): "panels count at the rules' bucket edges (le_matcher) and "
    "the catalogue check reads the rendered rules",
    ("reference_server.launch.metrics_exporter", "tracer.sidecar.main"): "`serve --exporter-port` runs the "
    "sidecar as its exporter",
    ("reference_server.launch.demo", "tracer.load"): "`splitscope demo` composes serve, load and report",
    ("reference_server.launch.demo", "tracer.report"): "`splitscope demo` composes serve, load and report",
    ("reference_server.launch.advice_check", "tracer.load"): "the demo's advice check: measured by a load run, "
    "predicted by the report",
    ("reference_server.launch.advice_check", "tracer.report"): "the demo's advice check: measured by a load "
    "run, predicted by the report",
}
# Shared layers that name an application: the engine-facing client of the sidecar's socket is part of the
# base distribution (start_tracing(sidecar_socket=...)), and the command line dispatches to every command.
SHARED_ALLOWED = {
    ("tracer.session", "tracer.sidecar.client"): "start_tracing's sidecar path ships to the sidecar's socket",
}


def _application(module: str) -> str | None:
    for application in sorted(APPLICATIONS, key=len, reverse=True):
        if module == application or module.startswith(application + "."):
            return application
    return None


def _modules() -> list[tuple[str, Path]]:
    out = []
    for folder, package in PACKAGES.items():
        root = REPO_ROOT / folder
        for path in sorted(root.rglob("*.py")):
            if path.is_relative_to(root / "tests"):  # alerts/tests: promtool fixtures, not the application
                continue
            parts = path.relative_to(root).with_suffix("").parts
            module = ".".join((package, *parts)).removesuffix(".__init__")
            out.append((module, path))
    return out


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from tracer.sidecar import vllm` imports tracer.sidecar.vllm: judge the full names
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def _allowed(rules: dict[tuple[str, str], str], importer: str, imported: str) -> bool:
    return any(
        (importer == owner or importer.startswith(owner + "."))
        and (imported == target or imported.startswith(target + "."))
        for owner, target in rules
    )


def test_modules_are_found():
    modules = dict(_modules())
    # the walk reaches every application (a renamed folder must not make the test pass by finding nothing)
    assert {_application(module) for module in modules} >= set(APPLICATIONS)
    assert "tracer.engines.vllm" in modules and "tracer.alerts.rules" in modules


def test_no_application_imports_another():
    crossings = []
    for module, path in _modules():
        own = _application(module)
        for line, imported in _imports(path):
            other = _application(imported)
            if other is None or other == own:
                continue
            if own is not None and _allowed(ALLOWED, module, imported):
                continue
            if own is None and (module.startswith("tracer.cli") or _allowed(SHARED_ALLOWED, module, imported)):
                continue
            crossings.append(f"{path.relative_to(REPO_ROOT)}:{line}: {module} imports {imported}")
    assert crossings == [], "\n".join(crossings)


def test_the_checker_sees_a_crossing(tmp_path):
    # the sidecar importing the report, written both ways an import can be
    path = tmp_path / "probe.py"
    path.write_text("from tracer.report import tables\n\ndef f():\n    import tracer.report.read\n", encoding="utf-8")
    imported = [name for _, name in _imports(path)]
    assert imported == ["tracer.report.tables", "tracer.report.read"]
    assert all(_application(name) == "tracer.report" for name in imported)
    assert not _allowed(ALLOWED, "tracer.sidecar.export", "tracer.report.tables")
    assert _allowed(ALLOWED, "tracer.explain.read", "tracer.report.tables")


def _package_of(module: str) -> str:
    return module.rsplit(".", 1)[0]


def test_no_module_imports_a_private_name_from_another_package():
    # `from tracer.report.tables import _take` in tracer/explain is a contract nobody wrote down: a private
    # name is its own package's to change. Within one package (a module and its siblings) it is allowed.
    private = []
    for module, path in _modules():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.level == 0):
                continue
            names = [
                alias.name for alias in node.names if alias.name.startswith("_") and not alias.name.startswith("__")
            ]
            if names and _package_of(node.module) != _package_of(module) and node.module != _package_of(module):
                private.append(
                    f"{path.relative_to(REPO_ROOT)}:{node.lineno}: {module} imports {names} from {node.module}"
                )
    assert private == [], "\n".join(private)
