"""`LoadResult`: a finished run (config, per-request records, summary) and its JSON form.

JSON layout (`--out`): {"config": {...}, "started_unix_s": float, "stopped_early": bool,
"summary": {...}, "requests": [...]}, one entry per scheduled request (up to a stop) in schedule order,
each with its measurements plus the derived `itl_p99_s` and `meets_slo`. Offsets (`scheduled_s`, `sent_s`) are seconds after `started_unix_s`.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from tracer.load.client import RequestMeasurement
from tracer.load.config import LoadConfig
from tracer.load.stats import Summary, itl_p99_s, meets_slo


@dataclass(frozen=True)
class LoadResult:
    config: LoadConfig
    started_unix_s: float  # wall clock at the run's time zero
    records: list[RequestMeasurement]
    summary: Summary
    stopped_early: bool = False  # stopped before the schedule's end; records cover arrivals up to the stop

    def to_json_dict(self) -> dict:
        return {
            "config": self.config.to_json_dict(),
            "started_unix_s": self.started_unix_s,
            "stopped_early": self.stopped_early,
            "summary": self.summary.to_json_dict(),
            "requests": [
                {**asdict(r), "itl_p99_s": itl_p99_s(r), "meets_slo": meets_slo(r, self.config.slo)}
                for r in self.records
            ],
        }

    def write_json(self, path: str | Path) -> None:
        """Write the JSON document atomically (a reader never sees half a file). Blocking file I/O."""
        target = Path(path)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent or Path("."))
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as tmp:
                json.dump(self.to_json_dict(), tmp, indent=1)
                tmp.write("\n")
            os.replace(tmp_name, target)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise
