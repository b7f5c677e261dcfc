"""A request's outcome against the deployment's latency objectives, for its root span.

`splitscope.slo.violated` and `splitscope.slo.missed` let a tail sampler (the sidecar's, or a collector's
`tail_sampling` processor) keep every violating request whole. The inter-token objective applies to the
request's p99 gap, as the report's default (`--itl-stat p99`). Dependency-free; pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from tracer.vocabulary import SloObjective


@dataclass(frozen=True)
class RequestSlo:
    """Latency objectives in seconds; None: that objective is not set."""

    ttft_s: float | None = None
    itl_s: float | None = None

    def __post_init__(self) -> None:
        for name, value in (("ttft_s", self.ttft_s), ("itl_s", self.itl_s)):
            if value is not None and not value > 0:
                raise ValueError(f"SLO {name} must be > 0 seconds, got {value}")

    @property
    def configured(self) -> bool:
        return self.ttft_s is not None or self.itl_s is not None

    def missed(self, ttft_s: float | None, duration_s: float, itl_p99_s: float | None) -> list[str]:
        """The objectives one request missed, in `SloObjective` order. A request that never produced a
        first token misses the TTFT objective once it has lasted longer than it."""
        out: list[str] = []
        if self.ttft_s is not None and (ttft_s if ttft_s is not None else duration_s) > self.ttft_s:
            out.append(SloObjective.TTFT)
        if self.itl_s is not None and itl_p99_s is not None and itl_p99_s > self.itl_s:
            out.append(SloObjective.ITL)
        return out
