"""tracer.alerts.rules: the committed rule file, its contract (architecture.md §6) and the knobs live tests use."""

from __future__ import annotations

import re

import pytest
import yaml

from tracer.alerts.rules import RULES_PATH, le_matcher, render_rules, render_rules_yaml
from tracer.alerts.settings import AlertSettings
from tracer.dashboards.catalogue import recording_rule_names, selector_names

# architecture.md §6, written out here so a renamed or dropped alert fails this test.
DESIGN_ALERTS = {
    "DecodeInterference",
    "SplitRecommended",
    "ChunkedPrefillRecommended",
    "KVTransferDominatesTTFT",
    "PrefillPoolSaturated",
    "DecodePoolSaturated",
    "TTFTSLOBurn",
    "ITLSLOBurn",
    "KVTransferFailures",
    "TracerDroppingRecords",
    "TelemetryAbsent",
    "LayoutChangeAdvised",
}
RUNBOOK_PATH = RULES_PATH.with_name("runbook.md")


def _rules(doc: dict) -> list[dict]:
    return [rule for group in doc["groups"] for rule in group["rules"]]


def _alerts(doc: dict) -> dict[str, dict]:
    return {rule["alert"]: rule for rule in _rules(doc) if "alert" in rule}


def test_committed_rules_are_a_fresh_render() -> None:
    assert RULES_PATH.read_text(encoding="utf-8") == render_rules_yaml(), (
        "alerts/rules.yaml is stale: run `splitscope alerts build`"
    )


def test_every_design_alert_has_for_severity_and_annotations() -> None:
    alerts = _alerts(yaml.safe_load(RULES_PATH.read_text(encoding="utf-8")))
    assert set(alerts) == DESIGN_ALERTS
    for name, rule in alerts.items():
        assert re.fullmatch(r"\d+[smh]", rule["for"]), name
        assert rule["labels"]["severity"] in {"info", "warning", "critical"}, name
        annotations = rule["annotations"]
        assert annotations["summary"].strip() and annotations["description"].strip(), name
        assert annotations["runbook_url"].endswith(f"runbook.md#{name.lower()}"), name


def _github_anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_runbook_has_a_section_per_alert_with_meaning_confirmation_and_action() -> None:
    text = RUNBOOK_PATH.read_text(encoding="utf-8")
    sections = dict(
        (_github_anchor(m.group(1)), m.group(2))
        for m in re.finditer(r"^## ([^\n]+)\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    )
    for name, rule in _alerts(render_rules()).items():
        anchor = rule["annotations"]["runbook_url"].split("#", 1)[1]
        assert anchor in sections, f"runbook.md has no section for {name} (#{anchor})"
        for part in ("**Means.**", "**Confirm.**", "**Do.**"):
            assert part in sections[anchor], f"runbook section {name} lacks {part}"


def test_recording_rules_are_level_metric_operation_and_every_one_used_is_defined() -> None:
    doc = render_rules()
    recorded = recording_rule_names()
    for name in recorded:
        level, metric, operation = name.split(":")
        assert level and metric and operation, name
    used = set().union(*(selector_names(rule["expr"]) for rule in _rules(doc)))
    assert {n for n in used if ":" in n} <= recorded


def test_slo_thresholds_live_in_the_burn_rules_as_bucket_matchers() -> None:
    doc = render_rules()
    exprs = {rule.get("record"): rule["expr"] for rule in _rules(doc)}
    ttft = exprs["model_mode:gen_ai_server_time_to_first_token_seconds:slo_miss_ratio_rate5m"]
    itl = exprs["pool:splitscope_inter_token_latency_seconds:slo_miss_ratio_rate5m"]
    assert le_matcher(2.0) in ttft and le_matcher(0.1) in itl
    assert le_matcher(1.0) in ttft and le_matcher(0.075) in itl  # the engines' fallback edges
    moved = render_rules(settings=AlertSettings(ttft_slo_s=3.0, itl_slo_s=0.05, itl_fallback_edge_s=0.04))
    moved_exprs = {rule.get("record"): rule["expr"] for rule in _rules(moved)}
    assert le_matcher(3.0) in moved_exprs["model_mode:gen_ai_server_time_to_first_token_seconds:slo_miss_ratio_rate5m"]
    assert le_matcher(0.05) in moved_exprs["pool:splitscope_inter_token_latency_seconds:slo_miss_ratio_rate5m"]


@pytest.mark.parametrize(
    "bound, spellings, not_matching",
    [
        (2.0, ["2", "2.0"], ["20", "2.5", "0.2"]),
        (0.1, ["0.1"], ["0.15", "1"]),
        (80.0, ["80", "80.0"], ["8"]),
    ],
)
def test_le_matcher_accepts_both_spellings_of_a_bound(bound, spellings, not_matching) -> None:
    pattern = re.fullmatch(r'le=~"(.*)"', le_matcher(bound)).group(1).replace("\\\\", "\\")
    for text in spellings:
        assert re.fullmatch(pattern, text), (pattern, text)
    for text in not_matching:
        assert not re.fullmatch(pattern, text), (pattern, text)


def test_threshold_off_the_bucket_boundaries_is_refused() -> None:
    with pytest.raises(ValueError, match="ttft_slo_s=1.7 is not a latency bucket boundary"):
        render_rules(settings=AlertSettings(ttft_slo_s=1.7))
    with pytest.raises(ValueError, match="itl_slo_s=0.09 is not an ITL bucket boundary"):
        render_rules(settings=AlertSettings(itl_slo_s=0.09))
    with pytest.raises(ValueError, match="slo_objective_ratio"):
        render_rules(settings=AlertSettings(slo_objective_ratio=1.0))


def test_for_scale_and_range_override_shorten_every_rule() -> None:
    normal = _rules(render_rules())
    fast = _rules(render_rules(for_scale=0.01, range_override="20s"))
    assert [r.get("alert") or r.get("record") for r in normal] == [r.get("alert") or r.get("record") for r in fast]
    for before, after in zip(normal, fast):
        windows = set(re.findall(r"\[(\w+)\]", after["expr"]))
        assert windows <= {"20s"}, after["expr"]
        if "for" in before:
            assert {"10m": "6s", "15m": "9s", "5m": "3s", "2m": "1s200ms", "1m": "600ms"}[before["for"]] == after["for"]


def test_bad_range_override_is_refused_with_a_clear_error() -> None:
    with pytest.raises(ValueError):
        render_rules(range_override="five minutes")
    with pytest.raises(ValueError, match="for_scale"):
        render_rules(for_scale=-1)


_GROUPING = re.compile(r"\b(by|on)\s*\(([^)]*)\)")


@pytest.mark.parametrize("labels", [("namespace",), ("cluster", "namespace")])
def test_every_aggregation_and_join_keeps_the_deployment_labels(labels) -> None:
    """Deployments sharing a Prometheus never mix: every `by (...)` and `on (...)` lists them first."""
    doc = render_rules(settings=AlertSettings(deployment_labels=labels))
    groupings = [m.groups() for rule in _rules(doc) for m in _GROUPING.finditer(rule["expr"])]
    assert len(groupings) > 40
    for keyword, names in groupings:
        assert [n.strip() for n in names.split(",")][: len(labels)] == list(labels), (keyword, names)
    exprs = "\n".join(rule["expr"] for rule in _rules(doc))
    assert not re.search(r"\b(sum|max|min|avg|count)\s*\(", exprs), "an aggregation without `by`"
    assert "on ()" not in exprs


def test_settings_that_cannot_work_are_refused() -> None:
    with pytest.raises(ValueError, match="deployment_labels"):
        render_rules(settings=AlertSettings(deployment_labels=("name space",)))
    with pytest.raises(ValueError, match="ttft_fallback_edge_s"):
        render_rules(settings=AlertSettings(ttft_fallback_edge_s=2.5))
    with pytest.raises(ValueError, match="recommend_min_horizon_share"):
        render_rules(settings=AlertSettings(recommend_min_horizon_share=0))


def test_horizon_override_keeps_the_recommendation_horizon_apart_from_the_windows() -> None:
    fast = _rules(render_rules(for_scale=0.01, range_override="10s", horizon_override="90s"))
    horizon = {r["record"] for r in fast if "[90s]" in r["expr"]}
    assert horizon == {
        "pool:splitscope_interference:ttft_missed_share1h",
        "pool:splitscope_interference:itl_missed_share1h",
        "pool:splitscope_step_duration_seconds:prefill_time_share1h",
    }
    assert all(set(re.findall(r"\[(\w+)\]", r["expr"])) <= {"10s"} for r in fast if r.get("record") not in horizon)
    with pytest.raises(ValueError):
        render_rules(range_override="10s", horizon_override="an hour")
