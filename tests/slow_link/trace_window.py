"""Copy the spans of an OTLP/JSON trace file that start inside a wall-clock window into a new file.

Several phases of one run share a traces file (the processes append to one path); the report is asked
about one phase only. Lines keep their resource and scope; spans outside the window are left out.
"""

from __future__ import annotations

import json
from pathlib import Path


def copy_window(source: Path, destination: Path, start_ns: int, end_ns: int) -> int:
    """Write the spans of `source` with start in [start_ns, end_ns] to `destination`; returns how many."""
    kept = 0
    with open(source) as lines, open(destination, "w") as out:
        for line in lines:
            request = json.loads(line)
            for resource_spans in request.get("resourceSpans", []):
                for scope_spans in resource_spans.get("scopeSpans", []):
                    inside = [
                        s for s in scope_spans.get("spans", []) if start_ns <= int(s["startTimeUnixNano"]) <= end_ns
                    ]
                    scope_spans["spans"] = inside
                    kept += len(inside)
            out.write(json.dumps(request) + "\n")
    return kept
