"""`splitscope alerts build|check`: regenerate alerts/rules.yaml, run promtool on it."""

from __future__ import annotations

import sys
import urllib.request
from pathlib import Path

import click
from prometheus_client.parser import text_string_to_metric_families

from tracer.alerts import promtool
from tracer.alerts.buckets import missing_slo_edges
from tracer.alerts.rules import RULES_PATH, render_rules_yaml

_FETCH_TIMEOUT_S = 10.0


@click.group("alerts")
def alerts_group() -> None:
    """Prometheus recording and alerting rules (alerts/rules.yaml)."""


@alerts_group.command("build")
@click.option("--check", "check_only", is_flag=True, help="Write nothing; exit 1 if rules.yaml is stale.")
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=RULES_PATH,
    show_default=True,
    help="Where to write the rule file.",
)
def build_command(check_only: bool, out: Path) -> None:
    """Render the rule file from alerts/rules.py and alerts/settings.py."""
    text = render_rules_yaml()
    current = out.read_text(encoding="utf-8") if out.exists() else None
    if check_only:
        if current != text:
            raise click.ClickException(f"{out} is stale: run `splitscope alerts build`")
        click.echo(f"{out} is up to date")
        return
    if current != text:
        out.write_text(text, encoding="utf-8")
        click.echo(f"wrote {out}")
    else:
        click.echo(f"{out} unchanged")


@alerts_group.command("check")
@click.option(
    "--rules",
    "rules_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=RULES_PATH,
    show_default=True,
    help="Rule file to check.",
)
@click.option("--skip-tests", is_flag=True, help="Only `promtool check rules`, not the unit tests.")
@click.option(
    "--metrics-url",
    "metrics_urls",
    multiple=True,
    metavar="URL",
    help="Also read this /metrics (an engine's, the sidecar's, the router's) and warn about latency "
    "histograms whose buckets lack the SLO edge. Repeatable.",
)
def check_command(rules_path: Path, skip_tests: bool, metrics_urls: tuple[str, ...]) -> None:
    """Run `promtool check rules` and `promtool test rules` (alerts/tests/*.yaml)."""
    for url in metrics_urls:
        try:
            with urllib.request.urlopen(url, timeout=_FETCH_TIMEOUT_S) as response:
                families = list(text_string_to_metric_families(response.read().decode("utf-8", errors="replace")))
        except (OSError, ValueError) as exc:
            raise click.ClickException(f"cannot read metrics from {url}: {exc}") from exc
        for warning in missing_slo_edges(families):
            click.echo(f"warning: {url}: {warning}", err=True)
    try:
        results = [promtool.check_rules(rules_path)]
        if not skip_tests:
            results.append(promtool.run_unit_tests())
    except promtool.PromtoolMissing as exc:
        raise click.ClickException(str(exc)) from exc
    failed = False
    for result in results:
        click.echo(result.output.rstrip())
        failed = failed or not result.ok
    if failed:
        click.echo("promtool reported errors", err=True)
        sys.exit(1)
