"""Client-side load generator (`splitscope load`): open-loop arrivals, streamed completions, SLO goodput.

Python API: `run_load(LoadConfig(...))` (async) or `run_load_sync(...)` -> `LoadResult`.
"""

from __future__ import annotations

from tracer.load.config import BurstSpec, ClientSLO, ConfigError, LengthSpec, LoadConfig
from tracer.load.results import LoadResult
from tracer.load.runner import RunProgress, run_load, run_load_sync
from tracer.load.workload import ReplayError

__all__ = [
    "ClientSLO",
    "BurstSpec",
    "ConfigError",
    "LengthSpec",
    "LoadConfig",
    "LoadResult",
    "ReplayError",
    "RunProgress",
    "run_load",
    "run_load_sync",
]
