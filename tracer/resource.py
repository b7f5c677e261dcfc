"""The resource that identifies a process's telemetry (OpenTelemetry resource attributes), without the SDK.

Both export paths use it: the in-process SDK (`tracer.export.otel.make_resource`) and the sidecar client, which
sends these attributes in its handshake so the sidecar exports the worker's spans under them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote

from tracer.vocabulary import RESOURCE_HOST_NAME, RESOURCE_SERVICE_INSTANCE, RESOURCE_SERVICE_NAME


def env_resource_attributes(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """OTEL_RESOURCE_ATTRIBUTES (`k=v,k2=v2`, values percent-decoded) and OTEL_SERVICE_NAME, which wins
    over a `service.name` in the former (the OpenTelemetry SDK's rules). Malformed pairs are skipped."""
    env = os.environ if environ is None else environ
    attributes: dict[str, str] = {}
    for pair in env.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","):
        key, sep, value = pair.partition("=")
        if sep and key.strip():
            attributes[key.strip()] = unquote(value.strip())
    service_name = env.get("OTEL_SERVICE_NAME", "").strip()
    if service_name:
        attributes[RESOURCE_SERVICE_NAME] = service_name
    return attributes


def resource_attributes(
    service_name: str | None = None,
    attributes: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Our defaults (`service_name` or "splitscope", an instance id, the host), then `attributes`, then
    the OTEL_* environment, each overriding the one before."""
    host = os.uname().nodename  # socket.gethostname() without importing socket
    return {
        RESOURCE_SERVICE_NAME: service_name or "splitscope",
        RESOURCE_SERVICE_INSTANCE: f"{host}-{os.getpid()}-{os.urandom(4).hex()}",
        RESOURCE_HOST_NAME: host,
        **(attributes or {}),
        **env_resource_attributes(environ),
    }


def default_service_name(pool: str | None) -> str:
    """`splitscope-{pool}` for a worker, `splitscope-router` for the router (pool None)."""
    return f"splitscope-{pool}" if pool else "splitscope-router"
