"""`splitscope dashboards build [--check]`: regenerate the committed dashboard JSON."""

from __future__ import annotations

from pathlib import Path

import click

from tracer.dashboards.build import GENERATED_DIR, stale_files, write_all


@click.group("dashboards")
def dashboards_group() -> None:
    """Grafana dashboards as code (dashboards/*.py -> dashboards/generated/*.json)."""


@dashboards_group.command("build")
@click.option(
    "--check", "check_only", is_flag=True, help="Write nothing; exit 1 if the JSON in the output folder is stale."
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=GENERATED_DIR,
    show_default=True,
    help="Folder for the generated JSON.",
)
def build_command(check_only: bool, out_dir: Path) -> None:
    """Render every dashboard to JSON."""
    if check_only:
        stale = stale_files(out_dir)
        if stale:
            raise click.ClickException(
                f"stale dashboard JSON in {out_dir}: {', '.join(stale)}; run `splitscope dashboards build`"
            )
        click.echo(f"dashboards in {out_dir} are up to date")
        return
    written = write_all(out_dir)
    click.echo(f"wrote {', '.join(written)}" if written else f"dashboards in {out_dir} unchanged")
