"""OTLP trace export requests -> the ingest queue's `Batch`es, one per resource.

The decoding itself is the codec's (tracer.otlp.requests); this only keys each resource for the queue.
Raises `OtlpDecodeError` (a reason fit for a 400 answer) for a malformed request.
"""

from __future__ import annotations

from typing import Any

from tracer.otlp import requests
from tracer.otlp.requests import OtlpDecodeError
from tracer.sidecar.ingest_queue import Batch, resource_key

__all__ = ["OtlpDecodeError", "batches_from_request", "decode_json", "decode_protobuf"]


def _batches(decoded: list[requests.ResourceSpans]) -> list[Batch]:
    return [Batch(resource_key(resource), spans) for resource, spans in decoded]


def decode_protobuf(body: bytes) -> list[Batch]:
    return _batches(requests.decode_protobuf(body))


def decode_json(body: bytes) -> list[Batch]:
    return _batches(requests.decode_json(body))


def batches_from_request(request: Any) -> list[Batch]:
    """A decoded request message of either family (the gRPC servicer receives one already parsed)."""
    return _batches(requests.spans_from_request(request))
