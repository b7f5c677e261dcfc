"""Synthetic OTLP/JSON trace files from a known ground-truth cost model, for tests, benches and docs.

The traces come from running the report's own discrete-event engine model (`simulate`) under a chosen
layout and cost model, with lognormal noise on every step and transfer, and writing what a real
deployment would record under architecture.md §4: a root `text_completion {model}` span per request with
queue / prefill / kv_transfer(.send/.recv) / decode children, and one `splitscope.step` span per engine
iteration per worker. The report must recover the costs by fitting these spans; it never sees the model.

Lines are written directly as the collector's JSON shape (what `tracer.export.otel.encode_line` produces for
SDK spans; a test holds the two equal) because the SDK objects are too slow for a million spans.
Blocking file I/O.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from tracer import spans as s
from tracer.otlp import SPAN_KIND_INTERNAL, SPAN_KIND_SERVER
from tracer.report.simulate import (
    Costs,
    EngineParams,
    Layout,
    SimResult,
    StepCosts,
    TransferCosts,
    Workload,
    simulate,
)
from tracer.spans import ATTR_STEP_PREFILL_ATTENTION_TOKENS2
from tracer.vocabulary import Mode, Pool

EPOCH_NS = 1_767_225_600_000_000_000  # 2026-01-01T00:00:00Z: synthetic traces start here
_SPANS_PER_LINE = 512  # the BatchSpanProcessor's default export batch
# The synthetic deployments route round-robin: a placement that does not depend on the noisy step times,
# so a report replaying the traced layout places every request where the traced run did, and its model
# check compares like with like. Reports on them are told so (ReportOptions.router).
SYNTHETIC_ROUTER = "round-robin"
_MAX_STALL_EVENTS = 8  # per decode span, like a real tracer bounding its events
KV_BLOCK_TOKENS = 16


def synthetic_workload(
    n_requests: int,
    rate_per_s: float,
    *,
    prompt_tokens: tuple[int, int],
    output_tokens: tuple[int, int],
    cached_fraction: float = 0.0,
    seed: int = 0,
) -> Workload:
    """Poisson arrivals at `rate_per_s`; prompt and output lengths uniform in the inclusive ranges."""
    if n_requests < 1 or rate_per_s <= 0:
        raise ValueError("need at least one request and a positive rate")
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate_per_s, n_requests))
    prompts = rng.integers(prompt_tokens[0], prompt_tokens[1] + 1, n_requests)
    outputs = rng.integers(output_tokens[0], output_tokens[1] + 1, n_requests)
    cached = (prompts * cached_fraction).astype(np.int64) // KV_BLOCK_TOKENS * KV_BLOCK_TOKENS
    return Workload(arrivals - arrivals[0], prompts, cached, outputs)


@dataclass(frozen=True)
class TraceOptions:
    model: str = "synthetic-8b"
    include_steps: bool = True  # False: like the sidecar's vLLM adapter (no step spans)
    include_itl: bool = True  # False: no ITL attributes on decode/root spans
    spans_per_line: int = _SPANS_PER_LINE


def write_traces(
    path: str | os.PathLike[str],
    layout: Layout,
    workload: Workload,
    costs: Costs,
    *,
    noise_sigma: float = 0.05,
    seed: int = 0,
    params: EngineParams = EngineParams(router=SYNTHETIC_ROUTER),
    options: TraceOptions = TraceOptions(),
) -> SimResult:
    """Simulate `workload` on `layout` with ground-truth `costs` and write the traces to `path` (replacing
    it). Returns the simulation, whose per-request figures are the ground truth for tests."""
    result = simulate(layout, workload, costs, params=params, noise_sigma=noise_sigma, seed=seed, record=True)
    rng = np.random.default_rng(seed + 1)
    with open(path, "w", encoding="utf-8") as handle:
        for line in _lines(result, workload, costs, layout, rng, options):
            handle.write(line)
    return result


# ------------------------------------------------------------------------------------------ JSON shape


def _value(value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, (int, np.integer)):
        return {"intValue": str(int(value))}
    if isinstance(value, (float, np.floating)):
        return {"doubleValue": float(value)}
    return {"stringValue": str(value)}


def _attributes(attributes: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"key": key, "value": _value(value)} for key, value in attributes.items()]


def span_dict(
    *,
    trace_id: str,
    span_id: str,
    parent_span_id: str,
    name: str,
    kind: int,
    start_ns: int,
    end_ns: int,
    attributes: dict[str, Any],
    events: list[tuple[str, int, dict[str, Any]]] = (),  # type: ignore[assignment]
    error_type: str | None = None,
) -> dict[str, Any]:
    """One span in the OTLP/JSON shape `encode_line` writes (ids in hex, int64 as decimal strings)."""
    raw: dict[str, Any] = {"traceId": trace_id, "spanId": span_id}
    if parent_span_id:
        raw["parentSpanId"] = parent_span_id
    raw.update(
        flags=256,
        name=name,
        kind=kind,
        startTimeUnixNano=str(start_ns),
        endTimeUnixNano=str(end_ns),
        attributes=_attributes(attributes),
    )
    if events:
        raw["events"] = [
            {"timeUnixNano": str(time_ns), "name": event_name, "attributes": _attributes(event_attributes)}
            for event_name, time_ns, event_attributes in events
        ]
    raw["status"] = {"code": 2} if error_type else {}
    return raw


def request_line(resource_spans: list[tuple[dict[str, Any], list[dict[str, Any]]]]) -> str:
    """One ExportTraceServiceRequest line from (resource attributes, spans) groups."""
    request = {
        "resourceSpans": [
            {
                "resource": {"attributes": _attributes(resource)},
                "scopeSpans": [{"scope": {"name": "splitscope"}, "spans": spans}],
            }
            for resource, spans in resource_spans
            if spans
        ]
    }
    return json.dumps(request, separators=(",", ":")) + "\n"


# ------------------------------------------------------------------------------------------ spans


def _ns(seconds: float) -> int:
    return EPOCH_NS + int(round(seconds * 1e9))


class _Ids:
    def __init__(self, rng: np.random.Generator) -> None:
        self._rng = rng

    def trace(self) -> str:
        return "%016x%016x" % tuple(int(x) for x in self._rng.integers(1, 2**63, 2))

    def span(self) -> str:
        return "%016x" % int(self._rng.integers(1, 2**63))


def _pool_names(layout: Layout) -> tuple[str, str]:
    if layout.mode == Mode.DISAGGREGATED:
        return (Pool.PREFILL, Pool.DECODE)
    return (Pool.COLOCATED, Pool.COLOCATED)


def _worker_resource(pool: str, worker: int) -> dict[str, Any]:
    return {"service.name": f"splitscope-{pool}", "service.instance.id": f"{pool}-{worker}"}


def _lines(
    result: SimResult, workload: Workload, costs: Costs, layout: Layout, rng: np.random.Generator, options: TraceOptions
) -> Iterator[str]:
    assert result.timeline is not None and result.steps is not None and result.token_gaps is not None
    ids = _Ids(rng)
    prefill_pool, decode_pool = _pool_names(layout)
    router = {"service.name": "splitscope-router", "service.instance.id": "router-0"}
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    roots: list[dict[str, Any]] = []
    in_line = 0
    step_lookup = _step_lookup(result, decode_pool)

    def flush() -> Iterator[str]:
        nonlocal roots, groups, in_line
        if in_line:
            yield request_line([(router, roots)] + [(_worker_resource(*key), spans) for key, spans in groups.items()])
        roots, groups, in_line = [], {}, 0

    for request in range(len(workload)):
        spans = _request_spans(
            request, result, workload, costs, layout, ids, options, prefill_pool, decode_pool, step_lookup
        )
        roots.append(spans[0][1])
        for key, span in spans[1:]:
            groups.setdefault(key, []).append(span)
        in_line += len(spans)
        if in_line >= options.spans_per_line:
            yield from flush()
    yield from flush()
    if options.include_steps:
        for pool, log in result.steps.items():
            trace_ids = {w: ids.trace() for w in set(log.worker)}
            batch: dict[int, list[dict[str, Any]]] = {}
            count = 0
            for i, worker in enumerate(log.worker):
                start = log.start_s[i]
                batch.setdefault(worker, []).append(
                    span_dict(
                        trace_id=trace_ids[worker],
                        span_id=ids.span(),
                        parent_span_id="",
                        name=s.SPAN_STEP,
                        kind=SPAN_KIND_INTERNAL,
                        start_ns=_ns(start),
                        end_ns=_ns(start + log.duration_s[i]),
                        attributes={
                            s.ATTR_POOL: pool,
                            s.ATTR_WORKER: f"{pool}-{worker}",
                            s.ATTR_STEP_DECODE_REQUESTS: log.decode_requests[i],
                            s.ATTR_STEP_PREFILL_TOKENS: log.prefill_tokens[i],
                            s.ATTR_STEP_CONTEXT_TOKENS: log.context_tokens[i],
                            ATTR_STEP_PREFILL_ATTENTION_TOKENS2: log.prefill_attention_tokens2[i],
                            s.ATTR_TIMING_SOURCE: s.SOURCE_HOST,
                        },
                    )
                )
                count += 1
                if count >= options.spans_per_line:
                    yield request_line([(_worker_resource(pool, w), s) for w, s in batch.items()])
                    batch, count = {}, 0
            if count:
                yield request_line([(_worker_resource(pool, w), s) for w, s in batch.items()])


def _step_lookup(result: SimResult, decode_pool: str) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Decode-side worker -> (step end times, prefill tokens per step), sorted by end time."""
    assert result.steps is not None
    log = result.steps[decode_pool]
    worker = np.asarray(log.worker)
    ends = np.asarray(log.start_s) + np.asarray(log.duration_s)
    prefill = np.asarray(log.prefill_tokens)
    lookup = {}
    for w in np.unique(worker):
        mask = worker == w
        order = np.argsort(ends[mask])
        lookup[int(w)] = (ends[mask][order], prefill[mask][order])
    return lookup


def _request_spans(
    r: int,
    result: SimResult,
    workload: Workload,
    costs: Costs,
    layout: Layout,
    ids: _Ids,
    options: TraceOptions,
    prefill_pool: str,
    decode_pool: str,
    step_lookup: dict[int, tuple[np.ndarray, np.ndarray]],
) -> list[tuple[Any, dict[str, Any]]]:
    tl = result.timeline
    assert tl is not None and result.token_gaps is not None
    trace_id, root_id = ids.trace(), ids.span()
    p_worker, d_worker = int(tl["prefill_worker"][r]), int(tl["decode_worker"][r])
    p_key, d_key = (prefill_pool, p_worker), (decode_pool, d_worker)
    p_name, d_name = f"{prefill_pool}-{p_worker}", f"{decode_pool}-{d_worker}"
    prompt, cached, output = (
        int(workload.prompt_tokens[r]),
        int(workload.cached_tokens[r]),
        int(workload.output_tokens[r]),
    )
    gaps = result.token_gaps[r]

    def child(name: str, start_s: float, end_s: float, attributes: dict[str, Any], parent: str = root_id, events=()):
        return span_dict(
            trace_id=trace_id,
            span_id=ids.span(),
            parent_span_id=parent,
            name=name,
            kind=SPAN_KIND_INTERNAL,
            start_ns=_ns(start_s),
            end_ns=_ns(end_s),
            attributes=attributes,
            events=list(events),
        )

    spans: list[tuple[Any, dict[str, Any]]] = []
    spans.append(
        (
            p_key,
            child(
                s.SPAN_QUEUE,
                tl["arrival_s"][r],
                tl["prefill_start_s"][r],
                {s.ATTR_POOL: prefill_pool, s.ATTR_WORKER: p_name},
            ),
        )
    )
    spans.append(
        (
            p_key,
            child(
                s.SPAN_PREFILL,
                tl["prefill_start_s"][r],
                tl["prefill_end_s"][r],
                {
                    s.ATTR_POOL: prefill_pool,
                    s.ATTR_WORKER: p_name,
                    s.ATTR_TIMING_SOURCE: s.SOURCE_HOST,
                    s.ATTR_PREFILL_TOKENS: prompt,
                    s.ATTR_PREFILL_CACHED_TOKENS: cached,
                    s.ATTR_PREFILL_CHUNKS: int(tl["prefill_chunks"][r]),
                },
            ),
        )
    )
    if layout.mode == Mode.DISAGGREGATED:
        kv_bytes = int(prompt * costs.transfer.kv_bytes_per_token)
        kv = {
            s.ATTR_KV_BYTES: kv_bytes,
            s.ATTR_KV_BLOCKS: -(-prompt // KV_BLOCK_TOKENS),
            s.ATTR_KV_BLOCK_TOKENS: KV_BLOCK_TOKENS,
            s.ATTR_KV_STREAMS: 4,
            s.ATTR_KV_SRC: p_name,
            s.ATTR_KV_DST: d_name,
            s.ATTR_CLOCK_OFFSET_NS: 0,
        }
        start, end = float(tl["prefill_end_s"][r]), float(tl["transfer_end_s"][r])
        parent = child(s.SPAN_KV_TRANSFER, start, end, kv)
        spans.append((p_key, parent))
        spans.append((p_key, child(s.SPAN_KV_SEND, float(tl["transfer_start_s"][r]), end, kv, parent["spanId"])))
        spans.append((d_key, child(s.SPAN_KV_RECV, float(tl["transfer_start_s"][r]), end, kv, parent["spanId"])))
    decode_attrs: dict[str, Any] = {
        s.ATTR_POOL: decode_pool,
        s.ATTR_WORKER: d_name,
        s.ATTR_TIMING_SOURCE: s.SOURCE_HOST,
        s.ATTR_OUTPUT_TOKENS: output,
    }
    root_attrs: dict[str, Any] = {
        s.ATTR_OPERATION: "text_completion",
        s.ATTR_MODEL: options.model,
        s.ATTR_INPUT_TOKENS: prompt,
        s.ATTR_OUTPUT_TOKENS: output,
        s.ATTR_REQUEST_ID: f"req-{r}",
        s.ATTR_MODE: layout.mode,
        s.ATTR_TTFT_S: float(result.ttft_s[r]),
    }
    events: list[tuple[str, int, dict[str, Any]]] = []
    if options.include_itl and len(gaps):
        stall_s = 2.0 * float(result.itl_p50_s[r])
        stalls = np.flatnonzero(gaps > stall_s)
        decode_attrs.update(
            {
                s.ATTR_DECODE_ITL_P50_S: float(result.itl_p50_s[r]),
                s.ATTR_DECODE_ITL_P99_S: float(result.itl_p99_s[r]),
                s.ATTR_DECODE_ITL_MAX_S: float(result.itl_max_s[r]),
                s.ATTR_DECODE_STALLS: len(stalls),
            }
        )
        root_attrs.update(
            {
                s.ATTR_ITL_P99_S: float(result.itl_p99_s[r]),
                s.ATTR_ITL_MAX_S: float(result.itl_max_s[r]),
                s.ATTR_ITL_MEAN_S: float(result.itl_mean_s[r]),
            }
        )
        token_times = float(tl["first_token_s"][r]) + np.cumsum(gaps)
        ends, prefill_tokens = step_lookup[d_worker]
        events = []
        for i in stalls[:_MAX_STALL_EVENTS]:
            # The gap ends with the step that produced the token; its prefill tokens caused the stall.
            step = min(int(np.searchsorted(ends, token_times[i] - 1e-9)), len(ends) - 1)
            events.append(
                (
                    s.EVENT_DECODE_STALL,
                    _ns(token_times[i]),
                    {"gap_s": float(gaps[i]), "prefill_tokens": int(prefill_tokens[step])},
                )
            )
    if output > 1:
        spans.append(
            (
                d_key,
                child(
                    s.SPAN_DECODE, float(tl["decode_start_s"][r]), float(tl["end_s"][r]), decode_attrs, events=events
                ),
            )
        )
    root = span_dict(
        trace_id=trace_id,
        span_id=root_id,
        parent_span_id="",
        name=f"text_completion {options.model}",
        kind=SPAN_KIND_SERVER,
        start_ns=_ns(tl["arrival_s"][r]),
        end_ns=_ns(tl["end_s"][r]),
        attributes=root_attrs,
    )
    return [(None, root)] + spans


# ------------------------------------------------------------------------------------------ scenarios


@dataclass(frozen=True)
class Scenario:
    """A ground truth to generate traces from: the deployed layout, the workload, the true costs, the SLO
    the report is asked about, and the link the report is told about (None: measured or default)."""

    layout: Layout
    workload: Workload
    costs: Costs
    slo_ttft_s: float
    slo_itl_s: float
    link_gbps: float | None = None


# A mid-size GPU serving an 8B-class model: 8 ms per step, 0.3 ms per decode request, 0.2 us per context
# token, 120 us per prefill token (DistServe's forms); KV of Llama-3-8B in bf16.
GROUND_TRUTH_STEP = StepCosts(
    base_s=0.008, context_s_per_token=2e-7, decode_s_per_request=3e-4, prefill_s_per_token=1.2e-4
)
_KV = 131072.0


# Long prompts: attention over the prompt adds a quadratic term (20 ns per token^2: +40 ms at 2000 tokens).
LONG_PROMPT_STEP = replace(GROUND_TRUTH_STEP, prefill_s_per_token2=2e-8)


def ground_truth_costs(link_gbps: float = 100.0, step: StepCosts = GROUND_TRUTH_STEP) -> Costs:
    return Costs(step, TransferCosts(_KV, link_gbps * 1e9 / 8, 0.002))


def scenario(name: str, n_requests: int = 400, seed: int = 1) -> Scenario:
    """Named ground truths used by tests, benches and docs (see tests/report/test_verdicts.py)."""
    if name == "chatty":  # short prompts, loose ITL SLO: interference is harmless, a split only wastes GPUs
        work = synthetic_workload(n_requests, 8.0, prompt_tokens=(50, 150), output_tokens=(100, 300), seed=seed)
        return Scenario(Layout(Mode.COLOCATED, workers=4), work, ground_truth_costs(), 1.0, 0.25)
    if name == "long-prompts":  # prompts stall decodes under colocation; chunks of 512 keep ITL in SLO
        work = synthetic_workload(n_requests, 4.0, prompt_tokens=(600, 1200), output_tokens=(100, 250), seed=seed)
        return Scenario(Layout(Mode.COLOCATED, workers=4), work, ground_truth_costs(), 1.0, 0.1)
    if name == "strict-itl":  # any prefill in a decode step breaks a tight ITL SLO: only a split meets it
        work = synthetic_workload(n_requests, 2.0, prompt_tokens=(2000, 4000), output_tokens=(100, 200), seed=seed)
        return Scenario(Layout(Mode.COLOCATED, workers=4), work, ground_truth_costs(step=LONG_PROMPT_STEP), 2.0, 0.035)
    if name == "wrong-split":  # decode-heavy workload deployed prefill-heavy (3:1)
        work = synthetic_workload(n_requests, 4.0, prompt_tokens=(200, 400), output_tokens=(200, 400), seed=seed)
        return Scenario(
            Layout(Mode.DISAGGREGATED, prefill_workers=3, decode_workers=1), work, ground_truth_costs(), 1.0, 0.035
        )
    if name == "slow-link":  # strict-itl's split, but the KV crosses a slow link: the transfer eats the TTFT
        work = synthetic_workload(n_requests, 4.0, prompt_tokens=(1000, 2000), output_tokens=(100, 200), seed=seed)
        return Scenario(
            Layout(Mode.DISAGGREGATED, prefill_workers=2, decode_workers=2),
            work,
            ground_truth_costs(link_gbps=1.0, step=LONG_PROMPT_STEP),
            1.0,
            0.06,
        )
    raise ValueError(f"unknown scenario {name!r}")


SCENARIOS = ("chatty", "long-prompts", "strict-itl", "wrong-split", "slow-link")
