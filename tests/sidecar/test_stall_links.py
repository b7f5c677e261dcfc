"""Estimated stall links on the sidecar's decode spans for stock vLLM and SGLang (tracer/sidecar/overlap.py,
export.py).

The independent oracle (tests/oracle) serves requests iteration by iteration and records which prompts
each iteration prefilled (`Iteration.prefills`). Its requests reach the sidecar's own export thread
(`SpanExport`, the real engine adapter, the OTLP/JSON file writer) as stock vLLM's `llm_request` spans, in
the order an engine sends them (when each request finishes), or as SGLang's request slices (in the order
they end; no token counts). The decode spans read back from the file must link exactly the prompts the
oracle ran inside their decode, each with that iteration's time.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from tests.oracle.cases import CASES, traffic
from tests.oracle.engine import Deployment, Run, serve
from tests.oracle.traces import SGLANG_SLICES, VLLM_LIFECYCLE, stage_span_lines, vllm_request_lines
from tracer import spans as s
from tracer.engines import vllm
from tracer.engines.adapter import EngineAdapter
from tracer.engines.sglang import SglangAdapter
from tracer.engines.vllm import VllmAdapter
from tracer.export.local_sink import MetricsRecorder
from tracer.metrics import DECODE_TPOT_HISTOGRAM, OVERLAP_UNCLASSIFIED_COUNTER, Catalogue
from tracer.otlp import Span, iter_spans
from tracer.sidecar.export import SpanExport
from tracer.sidecar.ingest_queue import Batch, IngestQueue
from tracer.sidecar.otlp_decode import decode_json
from tracer.sidecar.overlap import MAX_STALL_LINKS, OverlapClassifier
from tracer.vocabulary import Pool

HOLD_S = 30.0
RESOURCE = (("service.name", "vllm"),)


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def _request_spans(run: Run) -> list[s.SpanData]:
    """Worker 0's `llm_request` spans, in the order they finish (as vLLM exports them)."""
    spans = [span for line in vllm_request_lines(run, 0) for b in decode_json(line.encode()) for span in b.spans]
    return sorted(spans, key=lambda span: span.end_ns)


def _export(
    tmp_path: Path, spans: list[s.SpanData], clock: FakeClock, adapter: EngineAdapter | None = None, **classifier: int
) -> tuple[SpanExport, Path]:
    registry = CollectorRegistry()
    catalogue = Catalogue(registry, worker_gauges=False)
    traces = tmp_path / "traces.jsonl"
    export = SpanExport(
        IngestQueue(len(spans) + 1, lambda reason, n: None),
        MetricsRecorder(catalogue),
        traces_file=str(traces),
        adapters=[(adapter or VllmAdapter(pool=Pool.COLOCATED, worker="vllm-0"), True)],
        overlap=OverlapClassifier(catalogue, hold_s=HOLD_S, clock_s=clock, **classifier),
    )
    export.registry = registry  # type: ignore[attr-defined]
    return export, traces


def _truth(run: Run) -> dict[int, dict[int, tuple[float, int]]]:
    """Request index -> the other prompts the oracle prefilled during its decode: index -> (seconds of the
    iteration that ran it, its tokens there)."""
    by_worker = [it for it in run.iterations or [] if it.worker == 0]
    out: dict[int, dict[int, tuple[float, int]]] = {}
    for r in run.requests:
        if r.output_tokens < 2 or r.prefill_worker != 0:
            continue
        ran: dict[int, tuple[float, int]] = {}
        for it in by_worker[r.first_iteration : r.first_iteration + r.output_tokens - 1]:
            for index, tokens in it.prefills:
                if index != r.index:
                    ran[index] = (it.end_s - it.start_s, tokens)
        out[r.index] = ran
    return out


def _read(traces: Path) -> tuple[dict[int, Span], dict[str, int], dict[str, int]]:
    """(request index -> its decode span, prefill span id -> request index, trace id -> request index)."""
    spans = list(iter_spans([traces]))
    index_of = {
        x.trace_id: int(str(x.attributes[vllm.ATTR_REQUEST_ID]).removeprefix("req-"))
        for x in spans
        if x.name == vllm.SPAN_NAME
    }
    decodes = {index_of[x.trace_id]: x for x in spans if x.name == s.SPAN_DECODE}
    assert len(decodes) == sum(x.name == s.SPAN_DECODE for x in spans)  # each decode exported once
    prefills = {x.span_id: index_of[x.trace_id] for x in spans if x.name == s.SPAN_PREFILL}
    return decodes, prefills, index_of


def _bursty_run(n_requests: int) -> tuple[Run, dict[int, dict[int, tuple[float, int]]]]:
    """The oracle's bursty case served colocated on one worker at 1.5 req/s, and its truth (`_truth`)."""
    case = CASES["bursty"]
    sample = traffic(case, n_requests, seed=5)
    run = serve(
        Deployment("colocated", workers=1), sample.at(1.5), sample.prompt_tokens, sample.output_tokens, case.physics
    )
    return run, _truth(run)


def test_decode_spans_link_the_prompts_the_oracle_ran_inside_them(tmp_path: Path) -> None:
    run, truth = _bursty_run(200)
    assert sum(bool(ran) for ran in truth.values()) > 20 and sum(not ran for ran in truth.values()) > 5

    spans = _request_spans(run)
    clock = FakeClock()
    export, traces = _export(tmp_path, spans, clock)
    for i in range(0, len(spans), 8):
        export.queue.offer(Batch(RESOURCE, spans[i : i + 8]))
        export.drain_once(0.0)
        # Every decode written so far was classified: the ones a later prefill overlapped are still held.
        written, _, _ = _read(traces) if traces.exists() else ({}, {}, {})
        assert all(d.attributes[s.ATTR_DECODE_STALLED_ESTIMATED] is True for d in written.values())
    clock.now_s += 2 * HOLD_S  # the engine goes quiet: every hold passes
    export.drain_once(0.0)

    decodes, prefill_index, index_of = _read(traces)
    assert set(decodes) == set(truth)
    crowded = 0
    for index, ran in truth.items():
        decode = decodes[index]
        linked = [(prefill_index[link.span_id], link) for link in decode.links]
        assert all(index_of[link.trace_id] == p for p, link in linked)  # the link names the prefill's own trace
        stalled_ns = [link.attributes[s.ATTR_LINK_STALLED_NS] for _, link in linked]
        assert stalled_ns == sorted(stalled_ns, reverse=True)  # largest first
        if len(ran) > MAX_STALL_LINKS:
            crowded += 1
            assert len(linked) == MAX_STALL_LINKS
            assert decode.attributes[s.ATTR_DECODE_STALL_LINKS_DROPPED] == len(ran) - MAX_STALL_LINKS
            assert {p for p, _ in linked} <= set(ran)
        else:
            assert {p for p, _ in linked} == set(ran), index
            assert s.ATTR_DECODE_STALL_LINKS_DROPPED not in decode.attributes
        for p, link in linked:
            seconds, tokens = ran[p]
            assert link.attributes[s.ATTR_LINK_ESTIMATED] is True
            assert link.attributes[s.ATTR_LINK_STALLED_NS] == pytest.approx(seconds * 1e9, abs=2_000)
            assert link.attributes[s.ATTR_LINK_PREFILL_TOKENS] == tokens
        # The decode's stalled time: the iterations that carried a prefill, each once.
        iterations_s = {seconds for seconds, _ in ran.values()}
        if len(ran) <= MAX_STALL_LINKS:
            assert decode.attributes[s.ATTR_DECODE_STALLED_NS] == pytest.approx(
                sum(iterations_s) * 1e9, abs=2_000 * len(ran) + 1
            )
        assert decode.attributes[s.ATTR_DECODE_STALLED_ESTIMATED] is True
    assert crowded < len(truth)


@pytest.mark.parametrize("engine", ["sglang", "vllm-lifecycle"])
def test_decode_stages_without_token_counts_link_the_prompts_the_oracle_ran_inside_them(
    tmp_path: Path, engine: str
) -> None:
    """SGLang's slices and vLLM's lifecycle spans carry no token counts: the decode stage is linked all the
    same (overlap times, no prompt size on the links) and, having no time per output token, is counted in
    no TPOT metric."""
    run, truth = _bursty_run(120)
    assert sum(bool(ran) for ran in truth.values()) > 10 and sum(not ran for ran in truth.values()) > 5
    names, adapter = {
        "sglang": (SGLANG_SLICES, SglangAdapter(pool=Pool.COLOCATED, worker="sglang-0")),
        "vllm-lifecycle": (VLLM_LIFECYCLE, VllmAdapter(pool=Pool.COLOCATED, worker="vllm-0")),
    }[engine]
    lines, index_of = stage_span_lines(run, 0, names)
    spans = [span for line in lines for b in decode_json(line.encode()) for span in b.spans]
    clock = FakeClock()
    export, traces = _export(tmp_path, spans, clock, adapter)
    for i in range(0, len(spans), 16):
        export.queue.offer(Batch((("service.name", engine),), spans[i : i + 16]))
        export.drain_once(0.0)
    clock.now_s += 2 * HOLD_S
    export.drain_once(0.0)

    written = list(iter_spans([traces]))
    by_index = {index_of[x.trace_id]: x for x in written if x.name == s.SPAN_DECODE}
    prefill_index = {x.span_id: index_of[x.trace_id] for x in written if x.name == s.SPAN_PREFILL}
    assert set(by_index) >= set(truth)
    for index, ran in truth.items():
        decode = by_index[index]
        assert decode.attributes[s.ATTR_DECODE_STALLED_ESTIMATED] is True
        linked = {prefill_index[link.span_id]: link for link in decode.links}
        assert set(linked) == set(ran), index
        for p, link in linked.items():
            assert link.attributes[s.ATTR_LINK_STALLED_NS] == pytest.approx(ran[p][0] * 1e9, abs=2_000)
            assert s.ATTR_LINK_PREFILL_TOKENS not in link.attributes  # the engine's prefill span did not say
    tpot_count = export.registry.get_sample_value(
        f"{DECODE_TPOT_HISTOGRAM}_count", {"pool": "colocated", "prefill_overlap": "true"}
    )  # type: ignore[attr-defined]
    assert not tpot_count


def test_held_decodes_leave_at_shutdown_and_on_overflow_unlinked_but_never_lost(tmp_path: Path) -> None:
    case = CASES["bursty"]
    sample = traffic(case, 60, seed=7)
    run = serve(
        Deployment("colocated", workers=1), sample.at(1.5), sample.prompt_tokens, sample.output_tokens, case.physics
    )
    spans = _request_spans(run)
    export, traces = _export(tmp_path, spans, FakeClock(), max_held=4)
    export.queue.offer(Batch(RESOURCE, spans))
    export.drain_once(0.0)
    decodes, _, _ = _read(traces)
    # A whole run arrived at once, inside one hold: only the overflow of the hold was written, unlinked.
    unclassified = export.registry.get_sample_value(OVERLAP_UNCLASSIFIED_COUNTER, {"pool": "colocated"})  # type: ignore[attr-defined]
    expected = len(_truth(run))
    assert len(decodes) == unclassified == expected - 4
    assert all(not d.links and s.ATTR_DECODE_STALLED_ESTIMATED not in d.attributes for d in decodes.values())
    export.shutdown(1.0)  # the last 4 leave with what is known: everything has arrived
    decodes, _, _ = _read(traces)
    assert len(decodes) == expected
    linked = [d for d in decodes.values() if s.ATTR_DECODE_STALLED_ESTIMATED in d.attributes]
    assert len(linked) == 4 and any(d.links for d in linked)


def test_links_are_bounded_largest_first_and_never_to_the_own_prefill() -> None:
    from tracer.sidecar.overlap import estimated_stall_links

    own = 7
    overlaps = [(1_000 + i, (100 + i, 200 + i), i) for i in range(MAX_STALL_LINKS + 8)]
    links, dropped = estimated_stall_links(own, [(10**9, (own, 1), 5), *overlaps])
    assert len(links) == MAX_STALL_LINKS and dropped == 8
    assert own not in {trace_id for trace_id, _, _ in links}
    assert [a[s.ATTR_LINK_STALLED_NS] for _, _, a in links] == sorted((o[0] for o in overlaps), reverse=True)[
        :MAX_STALL_LINKS
    ]
    assert all(a[s.ATTR_LINK_ESTIMATED] is True for _, _, a in links)
