"""Step spans of a trace file thinned by the exporter's own stratified rule (tracer.step_sampling).

The synthetic traces carry every step; this rewrites a file as a worker at the given rate would have
exported it: the kept step spans with `splitscope.sample.weight`, the others gone, every other span as is.
"""

from __future__ import annotations

import json
from pathlib import Path

from tracer import spans as s
from tracer.step_sampling import StepSampler


def _attribute(raw: dict, key: str):
    for attribute in raw.get("attributes", ()):
        if attribute["key"] == key:
            return next(iter(attribute["value"].values()))
    return None


def sample_step_spans(source: Path, target: Path, **sampler_options) -> tuple[int, int]:
    """Write `source` to `target` with its step spans sampled per worker; returns (steps seen, kept)."""
    samplers: dict[str, StepSampler] = {}
    seen = kept = 0
    with open(source, encoding="utf-8") as lines, open(target, "w", encoding="utf-8") as out:
        for line in lines:
            request = json.loads(line)
            for resource_spans in request["resourceSpans"]:
                for scope_spans in resource_spans["scopeSpans"]:
                    spans = []
                    for raw in scope_spans["spans"]:
                        if raw["name"] != s.SPAN_STEP:
                            spans.append(raw)
                            continue
                        seen += 1
                        worker = _attribute(raw, s.ATTR_WORKER)
                        sampler = samplers.setdefault(worker, StepSampler(**sampler_options))
                        weight = sampler.keep(
                            int(raw["startTimeUnixNano"]), int(_attribute(raw, s.ATTR_STEP_PREFILL_TOKENS))
                        )
                        if weight:
                            kept += 1
                            raw["attributes"].append({"key": s.ATTR_SAMPLE_WEIGHT, "value": {"intValue": str(weight)}})
                            spans.append(raw)
                    scope_spans["spans"] = spans
            out.write(json.dumps(request, separators=(",", ":")) + "\n")
    return seen, kept
