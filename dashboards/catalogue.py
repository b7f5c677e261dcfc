"""Which metrics do the dashboards and the rules read? Parsed from their PromQL, for the catalogue check.

`referenced_metrics()` is what a catalogue test compares with the real /metrics exposition of the server and
sidecar: every name it returns must be exposed by one of our components (one catalogue, checked). Histogram series
(`_bucket`, `_sum`, `_count`) are reported as their family, named as architecture.md §5 names it (counters keep
`_total`).
Recording-rule outputs (`level:metric:operation`) and Prometheus's own `up` are not ours to expose and are
left out.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from typing import Any

import promql_parser

from tracer.alerts.rules import render_rules
from tracer.dashboards.build import render_all

HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
# Series Prometheus makes itself, not any exporter.
PROMETHEUS_SYNTHETIC = frozenset({"up"})

# Grafana's built-in interval variables, replaced by a plain duration to get PromQL Prometheus accepts.
_GRAFANA_DURATIONS = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h"}
_GRAFANA_VARIABLE = re.compile(r"\$\{\w+\}|\$\w+")
_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(.+?)\s*,\s*\w+\s*\)\s*$")


def grafana_to_promql(expr: str) -> str:
    """A panel expression with Grafana's variables replaced: intervals by durations, `$pool` etc. by `.*`.

    Every dashboard variable is used inside a regex matcher (`pool=~"$pool"`), so `.*` is the "All" value.
    """
    for variable, duration in _GRAFANA_DURATIONS.items():
        expr = expr.replace(variable, duration)
    return _GRAFANA_VARIABLE.sub(".*", expr)


def dashboard_queries(dashboards: dict[str, str] | None = None) -> list[tuple[str, str, str]]:
    """(dashboard uid, panel title, Grafana expression) for every panel query of every dashboard.

    `dashboards` maps file name -> JSON text; default: a fresh render of dashboards/.
    """
    rendered = render_all() if dashboards is None else dashboards
    queries = []
    for text in rendered.values():
        model = json.loads(text)
        for panel in _panels(model.get("panels", [])):
            for target in panel.get("targets", []):
                if target.get("expr"):
                    queries.append((model["uid"], panel.get("title", ""), target["expr"]))
    return queries


def _panels(panels: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # collapsed rows keep their panels inside


def variable_metrics(dashboards: dict[str, str] | None = None) -> set[str]:
    """Metric names named by `label_values(metric, label)` variable queries."""
    rendered = render_all() if dashboards is None else dashboards
    names = set()
    for text in rendered.values():
        for variable in json.loads(text).get("templating", {}).get("list", []):
            query = variable.get("query")
            if isinstance(query, dict):
                query = query.get("query", "")
            match = _LABEL_VALUES.match(query or "") if variable.get("type") == "query" else None
            if match:
                names |= selector_names(match.group(1))
    return names


def rule_queries() -> list[tuple[str, str]]:
    """(rule name, expression) for every recording and alerting rule, as committed."""
    return [
        (rule.get("alert") or rule["record"], rule["expr"])
        for group in render_rules()["groups"]
        for rule in group["rules"]
    ]


def recording_rule_names() -> set[str]:
    return {rule["record"] for group in render_rules()["groups"] for rule in group["rules"] if "record" in rule}


def selector_names(expr: str) -> set[str]:
    """Every metric name a PromQL expression selects (as written: `foo_bucket`, `pool:bar:rate5m`).

    Raises ValueError (promql-parser's message) when the expression does not parse.
    """
    names: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            names.add(node.name)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def family_name(series_name: str) -> str:
    """`foo_seconds_bucket` -> `foo_seconds`; other names unchanged."""
    for suffix in HISTOGRAM_SUFFIXES:
        if series_name.endswith(suffix):
            return series_name[: -len(suffix)]
    return series_name


def referenced_metrics() -> set[str]:
    """Metric families that some dashboard panel, dashboard variable or rule reads and a component must expose."""
    selected: set[str] = set(variable_metrics())
    for _, _, expr in dashboard_queries():
        selected |= selector_names(grafana_to_promql(expr))
    for _, expr in rule_queries():
        selected |= selector_names(expr)
    return {family_name(name) for name in selected if ":" not in name and name not in PROMETHEUS_SYNTHETIC}
