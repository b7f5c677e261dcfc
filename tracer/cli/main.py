"""`splitscope` command line: a click group whose subcommands are imported only when used.

Each subcommand lives beside the code it drives (the map below); importing one never imports torch or
the OpenTelemetry SDK for another, so `splitscope --help` stays fast.
"""

from __future__ import annotations

import importlib

import click

# name -> ("module:attribute" of a click command or group, the extra that installs what it needs).
_SUBCOMMANDS = {
    "demo": ("reference_server.launch.demo:demo_command", "server"),
    "serve": ("reference_server.launch.serve:serve_command", "server"),
    "load": ("tracer.load.cli:load_command", "load"),
    "sidecar": ("tracer.sidecar.main:sidecar_command", "sidecar"),
    "report": ("tracer.report.cli:report_command", "report"),
    "explain": ("tracer.explain.cli:explain_command", "report"),
    "advise": ("tracer.advise.cli:advise_command", "report"),
    "dashboards": ("tracer.dashboards.cli:dashboards_group", "dashboards"),
    "alerts": ("tracer.alerts.cli:alerts_group", "alerts"),
    "deploy-files": ("tracer.deploy_files:deploy_files_command", "all"),
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_SUBCOMMANDS)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The command list of `--help`; a command whose extra is not installed says which one it needs."""
        rows = []
        width = formatter.width - 6 - max(len(name) for name in _SUBCOMMANDS)
        for name in self.list_commands(ctx):
            try:
                command = self.get_command(ctx, name)
                rows.append((name, command.get_short_help_str(width) if command is not None else ""))
            except click.ClickException:
                rows.append((name, f"(not installed: pip install 'splitscope[{_SUBCOMMANDS[name][1]}]')"))
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in _SUBCOMMANDS:
            return None
        target, extra = _SUBCOMMANDS[name]
        module_name, attribute = target.split(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and module_name.startswith(exc.name):
                raise click.ClickException(f"'{name}' is not available in this build") from exc
            # A third-party module is missing: this installation lacks the command's extra.
            raise click.ClickException(
                f"'splitscope {name}' needs the '{extra}' extra (missing module {exc.name!r}): "
                f"pip install 'splitscope[{extra}]'"
            ) from exc
        return getattr(module, attribute)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="splitscope")
def main() -> None:
    """Per-stage tracing and split-decision reports for disaggregated LLM serving."""


if __name__ == "__main__":
    main()
