"""Deployment files (Prometheus, Grafana provisioning, an OpenTelemetry Collector, compose), shipped in the
wheel as package data of `tracer.deploy`: `splitscope deploy-files DIR` copies them out. Nothing to import."""
