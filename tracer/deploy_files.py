"""`splitscope deploy-files DIR`: the files a user's own stack needs, copied out of the installation.

The wheel carries them as package data (`tracer.deploy`, `tracer.alerts`, `tracer.dashboards`); this
writes them in the repository's layout, so `docker compose -f DIR/deploy/compose.yaml up` finds the rule
file and the dashboards where the compose file and prometheus.yml expect them (`../alerts`, `../dashboards`).
"""

from __future__ import annotations

from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path

import click

# (package, files or folders inside it, destination folder under DIR); None: every file of the package but
# its Python modules, so a deploy file added later ships without a change here.
_SHIPPED: tuple[tuple[str, tuple[str, ...] | None, str], ...] = (
    ("tracer.deploy", None, "deploy"),
    ("tracer.alerts", ("rules.yaml", "runbook.md"), "alerts"),
    ("tracer.dashboards", ("generated",), "dashboards"),
)


def _data_names(root: Traversable) -> tuple[str, ...]:
    return tuple(
        sorted(child.name for child in root.iterdir() if not child.name.endswith(".py") and child.name != "__pycache__")
    )


def _copy(source: Traversable, destination: Path, overwrite: bool) -> list[Path]:
    if source.is_dir():
        return [p for child in source.iterdir() for p in _copy(child, destination / child.name, overwrite)]
    if destination.exists() and not overwrite:
        raise click.ClickException(f"{destination} exists; pass --force to overwrite")
    destination.parent.mkdir(parents=True, exist_ok=True)
    destination.write_bytes(source.read_bytes())
    return [destination]


@click.command("deploy-files")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--force", is_flag=True, help="Overwrite files that exist.")
def deploy_files_command(directory: Path, force: bool) -> None:
    """Write the deploy files, alert rules and dashboards into DIRECTORY (deploy/, alerts/, dashboards/)."""
    written: list[Path] = []
    for package, names, folder in _SHIPPED:
        root = files(package)
        for name in names if names is not None else _data_names(root):
            written += _copy(root / name, directory / folder / name, force)
    click.echo(f"wrote {len(written)} files under {directory}")
