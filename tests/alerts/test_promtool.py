"""promtool on the committed rules and their unit tests, so both are part of the suite."""

from __future__ import annotations

from pathlib import Path

import yaml
from click.testing import CliRunner

from tracer.alerts import promtool
from tracer.alerts.cli import alerts_group
from tracer.alerts.rules import render_rules


def test_promtool_check_rules_passes() -> None:
    result = promtool.check_rules()
    assert result.ok, result.output


def test_promtool_unit_tests_pass() -> None:
    result = promtool.run_unit_tests()
    assert result.ok, result.output


def _duration_min(text: str) -> int:
    assert text.endswith("m"), f"promtool tests here use whole minutes, got {text}"
    return int(text[:-1])


def test_every_alert_is_tested_on_both_sides_of_its_for_with_full_annotations() -> None:
    """For each alert: one test group expects it firing at T and silent at T - 1m (the evaluation interval)."""
    both_sides: set[str] = set()
    annotated: set[str] = set()
    for path in promtool.unit_test_files():
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        assert doc["evaluation_interval"] == "1m", path
        for group in doc["tests"]:
            silent, firing = set(), set()
            for case in group.get("alert_rule_test", []):
                at = (case["alertname"], _duration_min(case["eval_time"]))
                if case.get("exp_alerts"):
                    firing.add(at)
                    for alert in case["exp_alerts"]:
                        if set(alert["exp_annotations"]) >= {"summary", "description", "runbook_url"}:
                            annotated.add(case["alertname"])
                else:
                    silent.add(at)
            both_sides |= {name for name, minute in firing if (name, minute - 1) in silent}
    alerts = {r["alert"] for g in render_rules()["groups"] for r in g["rules"] if "alert" in r}
    assert alerts - both_sides == set(), "alerts without a test on both sides of `for`"
    assert alerts - annotated == set(), "alerts whose firing test does not assert every annotation"


def test_a_broken_rule_fails_the_check_with_promtools_message(tmp_path: Path) -> None:
    bad = tmp_path / "rules.yaml"
    bad.write_text(
        "groups:\n- name: broken\n  rules:\n  - alert: Broken\n    expr: sum(rate(foo[5m])\n",
        encoding="utf-8",
    )
    result = promtool.check_rules(bad)
    assert not result.ok
    assert "Broken" in result.output or "parse error" in result.output, result.output


def test_cli_check_exits_zero_on_the_committed_rules() -> None:
    result = CliRunner().invoke(alerts_group, ["check"])
    assert result.exit_code == 0, result.output
    assert "SUCCESS" in result.output


def test_cli_build_check_detects_a_stale_file(tmp_path: Path) -> None:
    out = tmp_path / "rules.yaml"
    runner = CliRunner()
    assert runner.invoke(alerts_group, ["build", "--out", str(out)]).exit_code == 0
    assert runner.invoke(alerts_group, ["build", "--check", "--out", str(out)]).exit_code == 0
    out.write_text(out.read_text(encoding="utf-8").replace("for: 10m", "for: 1m", 1), encoding="utf-8")
    stale = runner.invoke(alerts_group, ["build", "--check", "--out", str(out)])
    assert stale.exit_code != 0
    assert "stale" in stale.output
