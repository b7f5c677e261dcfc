"""Engine adapters: what splitscope knows about engines other than its own, for every application.

An engine (vLLM, SGLang) traces in its own span names; `EngineAdapter.adapt` turns one of its spans into
our stage spans (architecture.md section 4). The sidecar adapts spans as they arrive; the report and explain
read the same engines' spans back from trace files through the same modules' names. Engine metric families
and how they map onto our catalogue are in `metrics.py` (the sidecar's scrape reads them).

    adapter.py   the interface: EngineAdapter (a Protocol) and the Adaptation it returns
    vllm.py      vLLM's `llm_request` (and proposed lifecycle) spans -> our stage spans
    sglang.py    SGLang's request trace slices -> our stage spans
    metrics.py   mapping tables: vLLM / SGLang / Dynamo metric families -> our catalogue

Imports only the tracer core (tracer.spans, tracer.metrics): any application may import this package, and
it imports none of them.
"""

from __future__ import annotations

from collections.abc import Callable

from tracer.engines.adapter import Adaptation, EngineAdapter
from tracer.engines.sglang import SglangAdapter
from tracer.engines.vllm import ModelNames, VllmAdapter


def _vllm(pool: str, worker: str, mode: str, model: str) -> EngineAdapter:
    return VllmAdapter(pool=pool, worker=worker, mode=mode, models=ModelNames(model))


def _sglang(pool: str, worker: str, mode: str, model: str) -> EngineAdapter:
    return SglangAdapter(pool=pool, worker=worker)


# engine name (as `--scrape ENGINE=URL` spells it) -> the adapter for its spans, given the role the
# sidecar's configuration names (`--pool`, `--worker`, `--mode`, `--model`).
SPAN_ADAPTERS: dict[str, Callable[[str, str, str, str], EngineAdapter]] = {"vllm": _vllm, "sglang": _sglang}


def span_adapters(*, pool: str, worker: str, mode: str, model: str = "") -> list[EngineAdapter]:
    """One adapter per engine that traces in spans of its own, in `SPAN_ADAPTERS` order."""
    return [make(pool, worker, mode, model) for make in SPAN_ADAPTERS.values()]


__all__ = ["SPAN_ADAPTERS", "Adaptation", "EngineAdapter", "span_adapters"]
