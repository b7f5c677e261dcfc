"""The catalogue is its table (tracer/metrics.py METRICS): one family per row, as the row says."""

from __future__ import annotations

import typing

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tracer import metrics
from tracer.metrics import ADVICE_METRICS, COUNTER, METRICS, TOTAL, AdviceMetrics, Catalogue

TABLES = pytest.mark.parametrize(("table", "owner"), [(METRICS, Catalogue), (ADVICE_METRICS, AdviceMetrics)])


@TABLES
def test_every_row_is_one_typed_attribute_and_every_attribute_a_row(table, owner):
    hints = typing.get_type_hints(owner)
    rows = {spec.attribute: spec for spec in table}
    assert len(rows) == len(table), "two rows name one attribute"
    assert set(hints) == set(rows)
    catalogue = owner(CollectorRegistry())
    for attribute, hint in hints.items():
        assert isinstance(getattr(catalogue, attribute), hint), attribute


def test_names_follow_one_convention():
    names = [spec.name for spec in METRICS + ADVICE_METRICS]
    assert len(set(names)) == len(names)
    for spec in METRICS + ADVICE_METRICS:
        assert spec.name.endswith(TOTAL) == (spec.kind == COUNTER), spec.name
        assert bool(spec.buckets) == spec.kind.endswith("histogram"), spec.name


@TABLES
def test_the_exposition_has_each_row_with_its_help_and_labels(table, owner):
    registry = CollectorRegistry()
    catalogue = owner(registry)
    for spec in table:  # one child each, so every family shows its label names
        family = getattr(catalogue, spec.attribute)
        child = family.labels(**{label: "x" for label in spec.labels}) if spec.labels else family
        if spec.kind == COUNTER:
            child.inc()
        elif spec.kind == metrics.GAUGE:
            child.set(1)
        else:
            child.observe(0.5)
    exposed = {family.name: family for family in text_string_to_metric_families(generate_latest(registry).decode())}
    for spec in table:
        family = exposed[spec.name.removesuffix(TOTAL)]  # the parser names a counter's family without it
        assert family.type == spec.kind.removeprefix("bulk_"), spec.name
        assert family.documentation == spec.help
        samples = [s for s in family.samples if s.labels.get("le") is None or s.name.endswith("_bucket")]
        assert {k for s in samples for k in s.labels if k != "le"} == set(spec.labels), spec.name
        if spec.buckets:
            bounds = {float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")}
            assert bounds == {*spec.buckets, float("inf")}, spec.name
    # nothing else (the text format writes a counter's and a histogram's `_created` as families of their own)
    assert {name for name in exposed if not name.endswith("_created")} == {
        spec.name.removesuffix(TOTAL) for spec in table
    }
