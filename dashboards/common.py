"""Shared builders for every splitscope dashboard: panels, queries, variables, the dashboard frame.

Each function returns a NEW builder (the SDK's builders are mutable), so callers chain freely. Method names
are those of grafana-foundation-sdk 1769699379!11.6.0, the pinned version.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard, prometheus, stat, timeseries
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DashboardLinkType,
    DataSourceRef,
    Threshold,
    ThresholdsMode,
    VariableRefresh,
    VariableSort,
)

from tracer.alerts.rules import le_matcher  # noqa: F401  (re-exported: one spelling of bucket bounds)
from tracer.alerts.settings import DEFAULT_SETTINGS

# Every query goes through the dashboard's datasource variable, so one JSON works in any Grafana.
PROMETHEUS = DataSourceRef(type_val="prometheus", uid="${datasource}")
# The traces datasource provisioned in deploy/grafana; the Prometheus datasource links exemplars to it.
TRACES_DATASOURCE_UID = "splitscope-traces"

DASHBOARD_TAG = "splitscope"
# Deployments sharing one Prometheus are told apart by these labels (as in the alert rules): every
# aggregation keeps them, every selector is limited to the deployments picked in the `namespace` variable.
DEPLOYMENT = ", ".join(DEFAULT_SETTINGS.deployment_labels)
NAMESPACE = 'namespace=~"$namespace"'
MODEL = f'{NAMESPACE}, gen_ai_request_model=~"$model"'
POOL = f'{NAMESPACE}, pool=~"$pool"'
RATE = "$__rate_interval"

TTFT_SLO_S = DEFAULT_SETTINGS.ttft_slo_s
ITL_SLO_S = DEFAULT_SETTINGS.itl_slo_s


def prom_query(expr: str, legend: str = "", exemplar: bool = False) -> prometheus.Dataquery:
    """A range query against the dashboard's Prometheus; `exemplar` shows trace-id exemplars on it."""
    query = prometheus.Dataquery().expr(expr).range().datasource(PROMETHEUS)
    if legend:
        query = query.legend_format(f"{{{{namespace}}}} {legend}")
    return query.exemplar(exemplar)


def quantile_query(
    quantile: float, histogram: str, by: str, matchers: str, legend: str, exemplar: bool = True
) -> prometheus.Dataquery:
    """`histogram_quantile` of a classic histogram over `$__rate_interval`, grouped by the deployment labels,
    `by` and `le`."""
    grouping = ", ".join(part for part in (DEPLOYMENT, by, "le") if part)
    return prom_query(
        f"histogram_quantile({quantile}, sum by ({grouping}) (rate({histogram}_bucket{{{matchers}}}[{RATE}])))",
        legend,
        exemplar,
    )


def mean_query(histogram: str, by: str, matchers: str, legend: str) -> prometheus.Dataquery:
    """Mean of a histogram's observations over `$__rate_interval`: rate of `_sum` over rate of `_count`,
    per deployment and `by`."""
    return prom_query(
        f"sum by ({DEPLOYMENT}, {by}) (rate({histogram}_sum{{{matchers}}}[{RATE}]))"
        f" / sum by ({DEPLOYMENT}, {by}) (rate({histogram}_count{{{matchers}}}[{RATE}]))",
        legend,
    )


def default_timeseries(title: str, unit: str, description: str) -> timeseries.Panel:
    """A half-width time series: lines, no points, a table legend with mean and max, shared tooltip."""
    return (
        timeseries.Panel()
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(PROMETHEUS)
        .height(8)
        .span(12)
        .line_width(1)
        .fill_opacity(10)
        .show_points(common.VisibilityMode.NEVER)
        .legend(
            common_builders.VizLegendOptions()
            .display_mode(common.LegendDisplayMode.TABLE)
            .placement(common.LegendPlacement.BOTTOM)
            .show_legend(True)
            .calcs(["mean", "max"])
        )
        .tooltip(
            common_builders.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI).sort(common.SortOrder.DESCENDING)
        )
    )


def with_slo_line(panel: timeseries.Panel, slo_value: float) -> timeseries.Panel:
    """Draw the SLO as a dashed red line (thresholds come from alerts.settings, the one place they live)."""
    return panel.thresholds(
        dashboard.ThresholdsConfig()
        .mode(ThresholdsMode.ABSOLUTE)
        .steps([Threshold(value=None, color="green"), Threshold(value=slo_value, color="red")])
    ).thresholds_style(common_builders.GraphThresholdsStyleConfig().mode(common.GraphThresholdsStyleMode.DASHED))


def stacked(panel: timeseries.Panel) -> timeseries.Panel:
    return panel.stacking(common_builders.StackingConfig().mode(common.StackingMode.NORMAL)).fill_opacity(40)


def default_stat(title: str, unit: str, description: str) -> stat.Panel:
    """A small single-value panel (last value, sparkline)."""
    return (
        stat.Panel()
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(PROMETHEUS)
        .height(4)
        .span(6)
        .graph_mode(common.BigValueGraphMode.AREA)
        .color_mode(common.BigValueColorMode.VALUE)
        .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    )


def datasource_variable() -> dashboard.DatasourceVariable:
    return dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus")


def label_variable(name: str, label: str, metric: str, title: str) -> dashboard.QueryVariable:
    """A multi-select variable over `label_values(metric, label)`; "All" matches everything (`.*`)."""
    return (
        dashboard.QueryVariable(name)
        .label(title)
        .query(f"label_values({metric}, {label})")
        .datasource(PROMETHEUS)
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
    )


def new_dashboard(uid: str, title: str, description: str) -> dashboard.Dashboard:
    """The frame every splitscope dashboard shares: variables, time range, refresh, links to the others."""
    return (
        dashboard.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags([DASHBOARD_TAG])
        .editable()
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .time("now-1h", "now")
        .refresh("30s")
        .timezone("browser")
        .with_variable(datasource_variable())
        .with_variable(label_variable("namespace", "namespace", "splitscope_worker_busy_seconds_total", "Deployment"))
        .with_variable(
            label_variable("model", "gen_ai_request_model", "gen_ai_server_request_duration_seconds_count", "Model")
        )
        .with_variable(label_variable("pool", "pool", "splitscope_worker_busy_seconds_total", "Pool"))
        .link(
            dashboard.DashboardLink("splitscope")
            .type(DashboardLinkType.DASHBOARDS)
            .tags([DASHBOARD_TAG])
            .as_dropdown(True)
            .include_vars(True)
            .keep_time(True)
        )
    )
