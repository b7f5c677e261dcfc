"""`splitscope` command line: a click group whose subcommands are imported only when used.

Each subcommand lives beside the code it drives (the map below); importing one never imports torch or
the OpenTelemetry SDK for another, so `splitscope --help` stays fast.
"""

from __future__ import annotations

import importlib

import click

# name -> "module:attribute" of a click command or group.
_SUBCOMMANDS = {
    "demo": "tracer.report.demo:demo_command",
    "serve": "reference_server.launch:serve_command",
    "load": "tracer.load.cli:load_command",
    "sidecar": "tracer.sidecar.main:sidecar_command",
    "report": "tracer.report.cli:report_command",
    "dashboards": "dashboards.cli:dashboards_group",
    "alerts": "alerts.cli:alerts_group",
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_SUBCOMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = _SUBCOMMANDS.get(name)
        if target is None:
            return None
        module_name, attribute = target.split(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and module_name.startswith(exc.name):
                raise click.ClickException(f"'{name}' is not available in this build") from exc
            raise
        return getattr(module, attribute)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="splitscope")
def main() -> None:
    """Per-stage tracing and split-decision reports for disaggregated LLM serving."""


if __name__ == "__main__":
    main()
