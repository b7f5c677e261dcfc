"""deploy/otel-collector-fleet-*.yaml: the fleet's two collector tiers, checked as far as this machine can.

No collector binary is installable here (no Go toolchain, no network to its release artifacts), so the
test cannot run `otelcol-contrib validate`. It checks instead: each file parses; every component it names
exists in the contrib distribution (the list below, written from the release's manifest); every pipeline
refers only to components the file defines; the edge tier routes by trace id; the sampler tier's policies
are types the tail sampling processor knows and keep errors, SLO violators and step spans whole.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tracer import spans as s
from tracer.step_sampling import DEFAULT_DECODE_SAMPLE_EVERY

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
EDGE, SAMPLER = "otel-collector-fleet-edge.yaml", "otel-collector-fleet-sampler.yaml"
ADVICE_ROUTER, ADVISOR = "otel-collector-advice-router.yaml", "otel-collector-advisor.yaml"

# Component type names of otelcol-contrib, from open-telemetry/opentelemetry-collector-releases,
# distributions/otelcol-contrib/manifest.yaml (modules v0.136.0). A module's type is its name without the
# kind suffix, except where the component registers another (memorylimiterprocessor -> memory_limiter,
# tailsamplingprocessor -> tail_sampling, probabilisticsamplerprocessor -> probabilistic_sampler,
# healthcheckextension -> health_check, filestorage -> file_storage, otlphttpexporter -> otlphttp).
# Receivers: the trace-capable ones only (the manifest lists about ninety, mostly for metrics and logs).
CONTRIB = {
    "receivers": {
        "otlp",
        "nop",
        "jaeger",
        "zipkin",
        "kafka",
        "otelarrow",
        "otlpjsonfile",
        "skywalking",
        "pulsar",
        "solace",
        "datadog",
        "libhoney",
        "awsxray",
        "googlecloudpubsub",
        "stef",
        "receiver_creator",
    },
    "processors": {
        "batch",
        "memory_limiter",
        "attributes",
        "cumulativetodelta",
        "coralogix",
        "deltatocumulative",
        "deltatorate",
        "filter",
        "geoip",
        "groupbyattrs",
        "groupbytrace",
        "interval",
        "isolationforest",
        "k8sattributes",
        "logdedup",
        "metricsgeneration",
        "metricstarttime",
        "metricstransform",
        "probabilistic_sampler",
        "redaction",
        "remotetap",
        "resourcedetection",
        "resource",
        "schema",
        "span",
        "sumologic",
        "tail_sampling",
        "transform",
    },
    "exporters": {
        "debug",
        "nop",
        "otlp",
        "otlphttp",
        "alibabacloud_logservice",
        "awscloudwatchlogs",
        "awsemf",
        "awskinesis",
        "awsxray",
        "awss3",
        "azureblob",
        "azuredataexplorer",
        "azuremonitor",
        "bmchelix",
        "carbon",
        "cassandra",
        "clickhouse",
        "coralogix",
        "datadog",
        "dataset",
        "doris",
        "elasticsearch",
        "faro",
        "file",
        "googlecloud",
        "googlecloudpubsub",
        "googlemanagedprometheus",
        "honeycombmarker",
        "influxdb",
        "kafka",
        "loadbalancing",
        "logicmonitor",
        "logzio",
        "mezmo",
        "opensearch",
        "otelarrow",
        "prometheus",
        "prometheusremotewrite",
        "pulsar",
        "rabbitmq",
        "sapm",
        "sentry",
        "signalfx",
        "splunk_hec",
        "stef",
        "sumologic",
        "syslog",
        "tencentcloud_logservice",
        "tinybird",
        "zipkin",
    },
    "extensions": {
        "zpages",
        "ack",
        "asapclient",
        "awsproxy",
        "azureauth",
        "basicauth",
        "bearertokenauth",
        "cgroupruntime",
        "datadog",
        "headers_setter",
        "health_check",
        "http_forwarder",
        "jaegerremotesampling",
        "oauth2client",
        "docker_observer",
        "ecs_observer",
        "ecs_task_observer",
        "host_observer",
        "k8s_observer",
        "kafkatopics_observer",
        "oidc",
        "opamp",
        "pprof",
        "sigv4auth",
        "file_storage",
        "db_storage",
        "redis_storage",
        "sumologic",
        "k8s_leader_elector",
    },
    "connectors": {
        "forward",
        "count",
        "datadog",
        "exceptions",
        "failover",
        "grafanacloud",
        "otlpjson",
        "roundrobin",
        "routing",
        "servicegraph",
        "spanmetrics",
        "sum",
        "signaltometrics",
    },
}
# Policy types of the tail sampling processor (processor/tailsamplingprocessor/README.md).
TAIL_POLICIES = {
    "always_sample",
    "latency",
    "numeric_attribute",
    "probabilistic",
    "status_code",
    "string_attribute",
    "rate_limiting",
    "span_count",
    "trace_state",
    "boolean_attribute",
    "ottl_condition",
    "and",
    "composite",
    "not",
    "drop",
}
LOADBALANCING_ROUTING_KEYS = {"traceID", "service", "resource", "metric", "streamID", "attributes"}


def _config(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text(encoding="utf-8"))


def _component_type(component_id: str) -> str:
    return component_id.split("/", 1)[0]  # "type/name": the type names the component


@pytest.mark.parametrize("name", [EDGE, SAMPLER, ADVICE_ROUTER, ADVISOR])
def test_every_component_is_in_the_contrib_distribution_and_every_pipeline_uses_defined_ones(name):
    config = _config(name)
    for kind in ("receivers", "processors", "exporters", "extensions", "connectors"):
        for component_id in config.get(kind) or {}:
            assert _component_type(component_id) in CONTRIB[kind], (
                f"{name}: {kind} {component_id!r} is not in otelcol-contrib"
            )
    pipelines = config["service"]["pipelines"]
    assert pipelines
    for pipeline_id, pipeline in pipelines.items():
        assert _component_type(pipeline_id) in ("traces", "metrics", "logs")
        for kind in ("receivers", "processors", "exporters"):
            for component_id in pipeline.get(kind, []):
                assert component_id in (config.get(kind) or {}), (
                    f"{name}: pipeline {pipeline_id} uses undefined {component_id!r}"
                )
        assert pipeline["receivers"] and pipeline["exporters"]
        # The memory limiter first (the collector's documented order), so it refuses before anything buffers.
        assert pipeline.get("processors", ["memory_limiter"])[0] == "memory_limiter"


def test_the_edge_tier_routes_whole_traces_to_one_sampler():
    config = _config(EDGE)
    loadbalancing = config["exporters"]["loadbalancing"]
    assert loadbalancing["routing_key"] == "traceID" and loadbalancing["routing_key"] in LOADBALANCING_ROUTING_KEYS
    assert set(loadbalancing["protocol"]) <= {"otlp"} and set(loadbalancing["resolver"]) <= {
        "static",
        "dns",
        "k8s",
        "aws_cloud_map",
    }
    assert config["service"]["pipelines"]["traces"]["exporters"] == ["loadbalancing"]
    # Beside the sidecar, which owns the standard OTLP ports on the node.
    ports = {int(p["endpoint"].rsplit(":", 1)[1]) for p in config["receivers"]["otlp"]["protocols"].values()}
    assert ports.isdisjoint({4317, 4318})


def test_the_sampler_keeps_errors_violators_and_step_spans_and_a_share_of_the_rest():
    config = _config(SAMPLER)
    tail = config["processors"]["tail_sampling"]
    policies = {policy["name"]: policy for policy in tail["policies"]}
    for policy in policies.values():
        assert policy["type"] in TAIL_POLICIES and policy["type"] in policy  # its settings under its type
    by_type = {policy["type"]: policy[policy["type"]] for policy in policies.values()}
    assert by_type["status_code"]["status_codes"] == ["ERROR"]
    assert by_type["boolean_attribute"] == {"key": s.ATTR_SLO_VIOLATED, "value": True}
    steps = by_type["numeric_attribute"]
    assert (
        steps["key"] == s.ATTR_SAMPLE_WEIGHT
        and steps["min_value"] <= 1
        and steps["max_value"] >= DEFAULT_DECODE_SAMPLE_EVERY
    )
    assert 0 < by_type["probabilistic"]["sampling_percentage"] < 100
    assert tail["num_traces"] > 0  # bounded
    processors = config["service"]["pipelines"]["traces"]["processors"]
    assert processors.index("tail_sampling") < processors.index("batch")


def test_the_advice_router_sends_each_namespace_to_one_advisor_host():
    config = _config(ADVICE_ROUTER)
    loadbalancing = config["exporters"]["loadbalancing"]
    # Keyed on the deployment's resource attribute (the `namespace` label of every series), nothing else.
    assert loadbalancing["routing_key"] == "attributes" and loadbalancing["routing_key"] in LOADBALANCING_ROUTING_KEYS
    assert loadbalancing["routing_attributes"] == [s.RESOURCE_SERVICE_NAMESPACE]
    assert set(loadbalancing["protocol"]) == {"otlp"} and "endpoint" not in loadbalancing["protocol"]["otlp"]
    hosts = loadbalancing["resolver"]["static"]["hostnames"]
    assert hosts and all(h.rsplit(":", 1)[1] == "4317" for h in hosts)  # the advisor hosts' OTLP/gRPC port
    assert config["service"]["pipelines"]["traces"]["exporters"] == ["loadbalancing"]
    ports = {int(p["endpoint"].rsplit(":", 1)[1]) for p in config["receivers"]["otlp"]["protocols"].values()}
    assert ports.isdisjoint({4317, 4318})


def test_the_advisor_host_writes_one_json_lines_file_per_namespace():
    config = _config(ADVISOR)
    file_exporter = config["exporters"]["file"]
    # OTLP/JSON lines (what `advise --follow` tails), split by the routing attribute: one file per deployment.
    assert file_exporter["format"] == "json" and "compression" not in file_exporter
    assert file_exporter["group_by"] == {"enabled": True, "resource_attribute": s.RESOURCE_SERVICE_NAMESPACE}
    assert file_exporter["path"].count("*") == 1 and file_exporter["path"].endswith(".jsonl")
    assert config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(":4317")
    router_hosts = _config(ADVICE_ROUTER)["exporters"]["loadbalancing"]["resolver"]["static"]["hostnames"]
    assert {h.rsplit(":", 1)[1] for h in router_hosts} == {"4317"}
