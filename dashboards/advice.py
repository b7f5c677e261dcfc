"""The advice row of the overview dashboard: what `splitscope advise --metrics-port` holds per deployment.

A state timeline of the held advice (one lane per advice; it is there while held), one of whether it asks
for another layout than the one deployed (what `LayoutChangeAdvised` fires on), the last window's gain and
confidence, and the windows' requests and decisions by reason. Metric names: tracer.metrics (ADVICE_*).
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard, statetimeline
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import ValueMap, ValueMappingResult

from tracer.dashboards.common import DEPLOYMENT, NAMESPACE, PROMETHEUS, RATE, default_timeseries, prom_query
from tracer.metrics import (
    ADVICE_CONFIDENCE,
    ADVICE_DECISIONS_COUNTER,
    ADVICE_DIFFERS,
    ADVICE_GAIN,
    ADVICE_INFO,
    ADVICE_WINDOW_REQUESTS,
)

ROW_TITLE = "Layout advice (splitscope advise)"
PANELS = ("Held advice", "Advice against the deployed layout", "Advice gain and confidence", "Advice windows")


def _state_timeline(title: str, description: str, mapping: dict[str, ValueMappingResult]) -> statetimeline.Panel:
    return (
        statetimeline.Panel()
        .title(title)
        .description(description)
        .datasource(PROMETHEUS)
        .height(6)
        .span(12)
        .show_value(common.VisibilityMode.NEVER)
        .merge_values(True)
        .mappings([ValueMap(mapping)])
    )


def with_advice_row(board: dashboard.Dashboard) -> dashboard.Dashboard:
    """`board` with the advice row and its panels appended."""
    held = _state_timeline(
        PANELS[0],
        "The advice `splitscope advise` holds, per deployment: a lane per advice (verdict and target: ratio "
        "P:D or chunk budget), filled while it is held. It changes only when a different advice wins --hold "
        "windows in a row.",
        {"1": ValueMappingResult(text="held", color="blue")},
    ).with_target(
        prom_query(
            f"max by ({DEPLOYMENT}, verdict, target) ({ADVICE_INFO}{{{NAMESPACE}}})",
            "{{verdict}} {{target}}",
        )
    )
    against = _state_timeline(
        PANELS[1],
        "Whether the held advice asks for another layout than the traces show deployed (mode, and ratio "
        "when split). LayoutChangeAdvised fires after 15 minutes of 'differs'.",
        {
            "0": ValueMappingResult(text="matches deployed", color="green"),
            "1": ValueMappingResult(text="differs", color="orange"),
        },
    ).with_target(prom_query(f"max by ({DEPLOYMENT}) ({ADVICE_DIFFERS}{{{NAMESPACE}}})", "advice vs deployed"))
    figures = (
        default_timeseries(
            PANELS[2],
            "percentunit",
            "Last decided window: gain is the winner's goodput over the option it had to beat, minus one (the "
            "report's margin); confidence is the share of bootstrap re-runs reaching the same verdict (only "
            "with --confidence-resamples).",
        )
        .with_target(prom_query(f"max by ({DEPLOYMENT}) ({ADVICE_GAIN}{{{NAMESPACE}}})", "gain"))
        .with_target(prom_query(f"max by ({DEPLOYMENT}) ({ADVICE_CONFIDENCE}{{{NAMESPACE}}})", "confidence"))
    )
    windows = (
        default_timeseries(
            PANELS[3],
            "short",
            "Requests that arrived in the last closed window, and closed windows by what they did to the held "
            "advice (first, agreed, held, changed, insufficient_data).",
        )
        .with_target(prom_query(f"max by ({DEPLOYMENT}) ({ADVICE_WINDOW_REQUESTS}{{{NAMESPACE}}})", "requests"))
        .with_target(
            prom_query(
                f"sum by ({DEPLOYMENT}, reason) (increase({ADVICE_DECISIONS_COUNTER}{{{NAMESPACE}}}[{RATE}]))",
                "windows {{reason}}",
            )
        )
    )
    return (
        board.with_row(dashboard.Row(ROW_TITLE))
        .with_panel(held)
        .with_panel(against)
        .with_panel(figures)
        .with_panel(windows)
    )
