"""tracer.cli.options: the duration grammar `splitscope load` and `splitscope report` share."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from tracer.cli.options import Duration, parse_duration_s


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("90", 90.0),
        ("1.5s", 1.5),
        ("500ms", 0.5),
        ("15m", 900.0),
        ("2h", 7200.0),
        ("1d", 86400.0),
        (" 2 s ", 2.0),
        ("1e3", 1000.0),
    ],
)
def test_durations_in_every_unit(text, seconds):
    assert parse_duration_s(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["soon", "-5s", "5 minutes", "", "m"])
def test_what_is_no_duration_is_refused(text):
    with pytest.raises(ValueError, match="is not a positive duration"):
        parse_duration_s(text)


def test_zero_only_where_allowed():
    with pytest.raises(ValueError):
        parse_duration_s("0s")
    assert parse_duration_s("0s", positive=False) == 0.0


def test_as_an_option_a_bad_value_is_a_usage_error_naming_it():
    @click.command()
    @click.option("--window", type=Duration(), default=60.0)
    def show(window):
        click.echo(repr(window))

    assert CliRunner().invoke(show, []).output == "60.0\n"
    assert CliRunner().invoke(show, ["--window", "5m"]).output == "300.0\n"
    result = CliRunner().invoke(show, ["--window", "soon"])
    assert result.exit_code == 2 and "'soon' is not a positive duration" in result.output
