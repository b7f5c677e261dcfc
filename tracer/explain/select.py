"""Which requests `explain` explains: the trace ids asked for, or the N worst by TTFT or inter-token p99."""

from __future__ import annotations

import math
from collections.abc import Sequence

from tracer.explain.read import ExplainData, Trace

MEASURES = ("ttft", "itl")


class SelectionError(ValueError):
    """A trace id that is not in the traces, or nothing to choose from; the message says which."""


def choose(data: ExplainData, trace_ids: Sequence[str], worst: int, by: str) -> list[Trace]:
    """The traces named by `trace_ids` (in the order given; ids are matched case-insensitively), else the
    `worst` requests by `by` ("ttft": time to first token, "itl": the request's p99 inter-token gap),
    worst first; requests without that measure come after every measured one. Raises SelectionError."""
    if trace_ids:
        chosen = []
        for trace_id in trace_ids:
            trace = data.traces.get(trace_id.strip().lower())
            if trace is None or trace.root is None:
                raise SelectionError(f"trace id {trace_id} has no request span in the traces read")
            chosen.append(trace)
        return chosen
    if by not in MEASURES:
        raise SelectionError(f"--by must be one of {', '.join(MEASURES)}, got {by!r}")
    requests = data.requests()
    if not requests:
        raise SelectionError("the traces hold no request span (a root text_completion/chat span or llm_request)")

    def badness(trace: Trace) -> tuple[bool, float]:
        value = trace.ttft_s if by == "ttft" else trace.itl_p99_s
        return (math.isnan(value), -value if not math.isnan(value) else 0.0)

    return sorted(requests, key=badness)[:worst]
