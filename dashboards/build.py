"""Render every dashboard to JSON (dashboards/generated/*.json, committed) and tell when that JSON is stale.

Rendering is deterministic: keys sorted, panel ids and query refIds assigned in order, so the same code
gives the same bytes and a test can compare the committed files with a fresh render.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from types import ModuleType
from typing import Any

from grafana_foundation_sdk.cog.encoder import JSONEncoder

from tracer.dashboards import gpu, interference, kv_transfer, overview, stages, tracer_health

GENERATED_DIR = Path(__file__).with_name("generated")

# file name (in GENERATED_DIR) -> module with UID and build()
DASHBOARDS: dict[str, ModuleType] = {
    "overview.json": overview,
    "stages.json": stages,
    "kv_transfer.json": kv_transfer,
    "interference.json": interference,
    "gpu.json": gpu,
    "tracer_health.json": tracer_health,
}


def _number_panels(model: Any) -> None:
    """Give panels ids 1.. and each panel's queries refIds A, B, ... where the builders left none."""
    for panel_id, panel in enumerate(model.panels or [], start=1):
        panel.id_val = panel_id
        for letter, target in zip(string.ascii_uppercase, getattr(panel, "targets", None) or []):
            if not getattr(target, "ref_id", None):
                target.ref_id = letter


def render(module: ModuleType) -> str:
    """One dashboard's JSON text, as committed (2-space indent, sorted keys, trailing newline)."""
    model = module.build().build()
    _number_panels(model)
    return json.dumps(model, cls=JSONEncoder, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def render_all() -> dict[str, str]:
    """file name -> JSON text for every dashboard."""
    return {name: render(module) for name, module in DASHBOARDS.items()}


def stale_files(out_dir: Path = GENERATED_DIR) -> list[str]:
    """Names whose file in `out_dir` is missing or differs from a fresh render, plus stray *.json files."""
    rendered = render_all()
    stale = [
        name
        for name, text in rendered.items()
        if not (out_dir / name).is_file() or (out_dir / name).read_text(encoding="utf-8") != text
    ]
    strays = sorted(p.name for p in out_dir.glob("*.json") if p.name not in rendered) if out_dir.is_dir() else []
    return stale + strays


def write_all(out_dir: Path = GENERATED_DIR) -> list[str]:
    """Write every dashboard whose file changed; return the names written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render_all().items():
        path = out_dir / name
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            written.append(name)
    return written


def load_generated(out_dir: Path = GENERATED_DIR) -> dict[str, dict[str, Any]]:
    """file name -> parsed committed JSON."""
    return {name: json.loads((out_dir / name).read_text(encoding="utf-8")) for name in DASHBOARDS}
