"""The interface every engine adapter implements (tracer.engines); imports only tracer.spans."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from tracer.spans import SpanData


@dataclass(slots=True)
class Adaptation:
    """What an adapter made from one engine span: `stages`, our stage spans (exported beside it, metered,
    classified for interference), and `metrics_only`, spans that only feed the metrics (never exported)."""

    stages: list[SpanData] = field(default_factory=list)
    metrics_only: list[SpanData] = field(default_factory=list)


class EngineAdapter(Protocol):
    """One engine's spans -> ours. Called on the sidecar's export thread only (adapters remember recent
    traces to make each stage once); never blocks."""

    engine: str

    def adapt(self, span: SpanData, resource: Mapping[str, Any]) -> Adaptation | None:
        """Our spans for `span`, or None when it is not one of this engine's spans (it is then exported
        as it is). `resource`: the attributes of the resource that sent it."""
        ...
