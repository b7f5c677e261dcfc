"""Option types the `splitscope` subcommands share: durations written as `90`, `500ms`, `1.5s`, `15m`, `2h`, `1d`."""

from __future__ import annotations

import re

import click

_DURATION = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(ms|s|m|h|d)?\s*")
_UNIT_S = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_duration_s(text: str, *, positive: bool = True) -> float:
    """`90`, `90s`, `500ms`, `15m`, `2h`, `1d` -> seconds (a bare number is seconds). Raises ValueError on
    anything else, on a negative number, and on zero when `positive`."""
    match = _DURATION.fullmatch(text)
    if not match or (positive and float(match.group(1)) <= 0):
        wanted = "a positive duration" if positive else "a duration"
        raise ValueError(f"{text!r} is not {wanted} (e.g. 30, 500ms, 2s, 15m, 2h)")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


class Duration(click.ParamType):
    """A click option type for `parse_duration_s`; the value is in seconds (a float). Numbers given as
    defaults pass through as seconds."""

    name = "DURATION"

    def __init__(self, *, positive: bool = True) -> None:
        self.positive = positive

    def convert(self, value, param, ctx):  # type: ignore[no-untyped-def]  # click's signature
        if isinstance(value, (int, float)):
            return float(value)
        try:
            return parse_duration_s(str(value), positive=self.positive)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)
