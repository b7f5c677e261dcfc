"""Whether the held advice asks for another layout than the one deployed (the `LayoutChangeAdvised` rule).

The deployed layout is what the traces say, as the report reads it (tracer.report.build.current_layout):
the pools and workers the spans name, and the serving mode (`splitscope.mode`) most requests carry. Both
sides are compared as a `Shape`: the serving mode, and the prefill:decode ratio when disaggregated. The
chunk budget is left out on purpose: the deployed budget is inferred from step sizes, not declared, so
comparing it would raise the alert on an estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

from tracer.report.build import current_layout
from tracer.report.tables import TraceData
from tracer.vocabulary import Mode, Verdict


@dataclass(frozen=True)
class Shape:
    mode: str  # a tracer.vocabulary.Mode value
    ratio: str | None = None  # "P:D" when disaggregated

    @property
    def label(self) -> str:
        """The `deployed` label of splitscope_advice_info: "colocated", "chunked", "disaggregated 1:3"."""
        return f"{self.mode} {self.ratio}" if self.ratio else self.mode


def deployed_shape(data: TraceData) -> Shape | None:
    """The deployed layout seen in `data`; None when no worker span names a pool (unknown)."""
    layout = current_layout(data)
    if layout is None:
        return None
    return Shape(layout.mode, layout.ratio)


def advised_shape(verdict: str, ratio: str | None, chunk_budget_tokens: int | None) -> Shape | None:
    """The layout an advice asks for; None for insufficient data."""
    if verdict == Verdict.STAY_COLOCATED:
        return Shape(Mode.COLOCATED)
    if verdict == Verdict.ENABLE_CHUNKED_PREFILL:
        return Shape(Mode.CHUNKED)
    if verdict in (Verdict.SPLIT, Verdict.REBALANCE):
        return Shape(Mode.DISAGGREGATED, ratio)
    if verdict == Verdict.MERGE:
        return Shape(Mode.CHUNKED if chunk_budget_tokens else Mode.COLOCATED)
    return None


def differs(advised: Shape | None, deployed: Shape | None) -> bool:
    """True only when both are known and they differ (unknown never raises the alert)."""
    return advised is not None and deployed is not None and advised != deployed
