"""Trace spans -> per-request, per-step and per-transfer columns (numpy), and the current layout.

One pass over the trace files (`tracer.report.read`: OTLP/JSON lines or OTLP protobuf, decoding only what
the report reads; step spans go straight into compact columns). Only the attributes the report uses are
kept, turned into arrays at the end, so a million spans fit in a few hundred MB. Blocking file I/O.

A span that lacks an attribute the report needs (or carries one of the wrong type) is a bad record:
`TraceDataError` names the file, the record's line, the span and the attribute; with `skip_bad` it is
skipped and counted instead, like a bad line.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tracer import spans as s
from tracer.engines import vllm
from tracer.otlp import (
    SPAN_KIND_SERVER,
    STATUS_ERROR,
    ReadStats,
    Span,
    TraceFileError,
)
from tracer.report.read import StepColumns, iter_report_spans
from tracer.vocabulary import Mode, Pool

VLLM_REQUEST_SPAN = vllm.SPAN_NAME


@dataclass(frozen=True)
class _RequestKeys:
    """Attribute names of a request span. vLLM uses the older token-count names, puts TTFT in its latency
    attributes and has no inter-token statistics ("" = absent)."""

    input_tokens: str
    output_tokens: str
    ttft_s: str
    itl_p99_max_mean_s: tuple[str, str, str]
    itl_joined_tokens: str
    default_mode: str


_OUR_REQUEST_KEYS = _RequestKeys(
    s.ATTR_INPUT_TOKENS,
    s.ATTR_OUTPUT_TOKENS,
    s.ATTR_TTFT_S,
    (s.ATTR_ITL_P99_S, s.ATTR_ITL_MAX_S, s.ATTR_ITL_MEAN_S),
    s.ATTR_ITL_JOINED_TOKENS,
    "",
)
# vLLM's span names no mode: the sidecar's stage spans carry its `--mode` (else colocated, `request_table`).
_VLLM_REQUEST_KEYS = _RequestKeys(
    vllm.ATTR_PROMPT_TOKENS,
    vllm.ATTR_COMPLETION_TOKENS,
    vllm.ATTR_TTFT,
    ("", "", ""),
    "",
    "",
)
POOLS = tuple(Pool)


class TraceDataError(ValueError):
    """A span without an attribute the report needs; the message names file, line, span and attribute."""


@dataclass
class RequestTable:
    """One row per request trace that has a root span. Times in Unix ns or seconds as named; NaN = absent."""

    arrival_ns: np.ndarray
    end_ns: np.ndarray
    input_tokens: np.ndarray
    cached_tokens: np.ndarray
    output_tokens: np.ndarray
    failed: np.ndarray  # bool
    ttft_s: np.ndarray
    itl_p50_s: np.ndarray
    itl_p99_s: np.ndarray
    itl_max_s: np.ndarray
    itl_mean_s: np.ndarray
    # Tokens the client got in one event with the token before (`splitscope.itl_joined_tokens`); NaN: unknown.
    itl_joined_tokens: np.ndarray
    queue_s: np.ndarray
    prefill_s: np.ndarray
    transfer_s: np.ndarray
    decode_s: np.ndarray
    decode_start_ns: np.ndarray
    decode_end_ns: np.ndarray
    prefill_start_ns: np.ndarray
    prefill_end_ns: np.ndarray
    prefill_worker: np.ndarray  # object: worker name or ""
    decode_worker: np.ndarray  # object: worker name or ""
    mode: np.ndarray  # object: splitscope.mode

    def __len__(self) -> int:
        return len(self.arrival_ns)

    def select(self, mask: np.ndarray) -> RequestTable:
        return RequestTable(**{name: getattr(self, name)[mask] for name in self.__dataclass_fields__})

    @property
    def e2e_s(self) -> np.ndarray:
        return (self.end_ns - self.arrival_ns) / 1e9

    @property
    def tpot_s(self) -> np.ndarray:
        """Time per output token after the first (NaN for one-token requests)."""
        tokens = self.output_tokens - 1
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(tokens > 0, (self.e2e_s - self.ttft_s) / np.maximum(tokens, 1), np.nan)

    def itl(self, stat: str) -> np.ndarray:
        return {"p99": self.itl_p99_s, "max": self.itl_max_s, "mean": self.itl_mean_s}[stat]


@dataclass
class StepTable:
    start_ns: np.ndarray
    duration_s: np.ndarray
    pool: np.ndarray  # object
    worker: np.ndarray  # object
    decode_requests: np.ndarray
    prefill_tokens: np.ndarray
    context_tokens: np.ndarray
    # Attention work of the step's prefill chunks (tokens^2; see tracer.spans); NaN where not recorded.
    prefill_attention_tokens2: np.ndarray
    # How many engine steps each span stands for (`splitscope.sample.weight`; 1 where absent): sums and
    # means over steps weigh each row by it (tracer.step_sampling).
    weight: np.ndarray

    def __len__(self) -> int:
        return len(self.start_ns)

    @property
    def sampled(self) -> bool:
        """Whether some spans stand for more than one step (the exporter kept a sample)."""
        return bool(len(self.weight) and np.any(self.weight != 1))

    def select(self, mask: np.ndarray) -> StepTable:
        return StepTable(**{name: getattr(self, name)[mask] for name in self.__dataclass_fields__})


@dataclass
class TransferTable:
    """Observed KV transfers: the whole stage (`exposed_s`, prefill end to KV ready) and its wire part."""

    kv_bytes: np.ndarray
    exposed_s: np.ndarray
    wire_s: np.ndarray  # the .send span's duration where present, else the stage's
    prompt_tokens: np.ndarray

    def __len__(self) -> int:
        return len(self.kv_bytes)


@dataclass
class TraceData:
    requests: RequestTable
    steps: StepTable
    transfers: TransferTable
    workers: dict[str, list[str]]  # pool -> distinct worker names seen
    models: list[str]
    read: ReadStats
    skipped_spans: int = 0
    first_skip: str | None = None
    files: list[str] = field(default_factory=list)
    # Whether any prefill span was timed by an accelerator's events (`splitscope.timing.source` = cuda): the
    # engine ran on a GPU, and `--step-model auto` prices its steps as one.
    device_timed: bool = False

    @property
    def start_ns(self) -> int:
        return int(self.requests.arrival_ns.min()) if len(self.requests) else 0

    @property
    def end_ns(self) -> int:
        return int(self.requests.end_ns.max()) if len(self.requests) else 0


_NAN = float("nan")


def _step_weight(span: Span, where: str) -> float:
    """`splitscope.sample.weight`, 1 where absent (traces written before step sampling); a kept span
    stands for at least itself, so a weight below 1 is malformed."""
    weight = _number(span, s.ATTR_SAMPLE_WEIGHT, where, False)
    if math.isnan(weight):  # not recorded
        return 1.0
    if weight < 1:
        raise TraceDataError(f"{where}: {s.ATTR_SAMPLE_WEIGHT} must be >= 1, got {weight}")
    return weight


def _number(span: Span, key: str, where: str, required: bool = True) -> float:
    value = span.attributes.get(key)
    if value is None:
        if required:
            raise TraceDataError(f"{where}: span {span.name!r} lacks attribute {key!r}")
        return _NAN
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TraceDataError(f"{where}: span {span.name!r} attribute {key!r} is not a number: {value!r}")
    return value


def _text(span: Span, key: str, where: str) -> str:
    value = span.attributes.get(key)
    if not isinstance(value, str) or not value:
        raise TraceDataError(f"{where}: span {span.name!r} lacks attribute {key!r}")
    return value


class RequestSpans:
    """What the spans of one request trace (one trace id) have said so far, gathered while the files are
    read: the request span's fields (`root`) and each stage span's. `request_table` makes it one row
    (when it has a request span), `transfer_table` one transfer (when it has a sized KV transfer)."""

    __slots__ = (
        "root",
        "queue",
        "prefill",
        "transfer",
        "send",
        "decode",
        "stage_mode",
        "engine_request",
        "device_timed",
    )

    def __init__(self) -> None:
        self.root: tuple | None = None
        self.queue: float = _NAN
        self.prefill: tuple | None = None
        self.transfer: tuple | None = None
        self.send: float = _NAN
        self.decode: tuple | None = None
        self.stage_mode: str = ""  # `splitscope.mode` on a stage span (a sidecar's --mode)
        self.device_timed = False  # a prefill or decode span timed by the accelerator's events (CUDA)
        self.engine_request = False  # the request span is an engine's own (vLLM's llm_request)


def load_traces(paths: Sequence[str | os.PathLike[str]], *, skip_bad: bool = False) -> TraceData:
    """Read every span of `paths` into tables. Raises TraceFileError (bad line) or TraceDataError (a span
    missing what the report needs) unless `skip_bad`, which skips and counts them."""
    total = ReadStats()
    requests: dict[str, RequestSpans] = {}
    steps = StepColumns()
    workers: dict[str, set[str]] = {}
    models: set[str] = set()
    skipped = 0
    first_skip: str | None = None
    for path in paths:
        stats = ReadStats()
        try:
            for span in iter_report_spans([path], skip_bad=skip_bad, stats=stats, steps=steps):
                try:
                    take_span(span, requests, steps, workers, models, f"{path}:{stats.record}")
                except TraceDataError as exc:
                    if not skip_bad:
                        raise
                    skipped += 1
                    first_skip = first_skip or str(exc)
        except FileNotFoundError:
            raise TraceFileError(str(path), 0, "no such file") from None
        total.lines += stats.lines
        total.spans += stats.spans
        total.skipped_lines += stats.skipped_lines
        total.first_error = total.first_error or stats.first_error
    for pool, worker in steps.pool_workers:  # the layout the steps read straight into columns saw
        workers.setdefault(pool, set()).add(worker)
    return TraceData(
        requests=request_table(requests),
        steps=step_table(steps),
        transfers=transfer_table(requests),
        workers={pool: sorted(names) for pool, names in workers.items()},
        models=sorted(models),
        read=total,
        skipped_spans=skipped,
        first_skip=first_skip,
        files=[str(p) for p in paths],
        device_timed=any(r.device_timed for r in requests.values()),
    )


def take_span(
    span: Span,
    requests: dict[str, RequestSpans],
    steps: StepColumns,
    workers: dict[str, set[str]],
    models: set[str],
    where: str,
) -> None:
    """Take one span into the tables being built: a step span into `steps`, a request's or stage's span into
    its `requests` entry (by trace id); `workers` and `models` collect what was seen. `where` names the span
    in errors (`file:record`). Raises TraceDataError on a span our vocabulary names but whose attributes are
    missing or wrong. The one interpretation of a span: load_traces, explain and the live advisor share it."""
    name = span.name
    if name == s.SPAN_STEP:  # a step the reader did not put into the columns itself: checked here
        pool, worker = _pool_worker(span, where, workers)
        steps.append(
            span.start_ns,
            span.end_ns,
            pool,
            worker,
            int(_number(span, s.ATTR_STEP_DECODE_REQUESTS, where)),
            int(_number(span, s.ATTR_STEP_PREFILL_TOKENS, where)),
            int(_number(span, s.ATTR_STEP_CONTEXT_TOKENS, where)),
            float(_number(span, s.ATTR_STEP_PREFILL_ATTENTION_TOKENS2, where, False)),
            _step_weight(span, where),
        )
        return
    # The request span: the router's SERVER span (its parent, when present, is the client's span), or
    # vLLM's own `llm_request` span passed through by the sidecar's adapter with our stage spans under it.
    keys = None
    if name.startswith(s.ROOT_SPAN_PREFIXES) and (span.kind == SPAN_KIND_SERVER or not span.parent_span_id):
        keys = _OUR_REQUEST_KEYS
    elif name == VLLM_REQUEST_SPAN:
        keys = _VLLM_REQUEST_KEYS
    if keys is not None:
        _take_request_span(span, keys, requests, models, where)
        return
    if not name.startswith("splitscope."):
        return
    mode = span.attributes.get(s.ATTR_MODE)
    if isinstance(mode, str) and mode:
        _request(requests, span).stage_mode = mode
    if name == s.SPAN_QUEUE:
        _request(requests, span).queue = span.duration_s
    elif name == s.SPAN_PREFILL:
        _, worker = _pool_worker(span, where, workers)
        if span.attributes.get(s.ATTR_TIMING_SOURCE) == s.SOURCE_CUDA:
            _request(requests, span).device_timed = True
        _request(requests, span).prefill = (
            span.start_ns,
            span.end_ns,
            int(_number(span, s.ATTR_PREFILL_TOKENS, where)),
            int(span.attributes.get(s.ATTR_PREFILL_CACHED_TOKENS) or 0),  # absent: no prefix cache
            worker,
        )
    elif name == s.SPAN_KV_TRANSFER:
        # Bytes are optional: transfers an engine adapter derives (vLLM P/D, SGLang) carry only their time.
        _request(requests, span).transfer = (span.duration_s, _number(span, s.ATTR_KV_BYTES, where, False))
    elif name == s.SPAN_KV_SEND:
        _request(requests, span).send = span.duration_s
    elif name == s.SPAN_DECODE:
        _, worker = _pool_worker(span, where, workers)
        _request(requests, span).decode = (
            span.start_ns,
            span.end_ns,
            worker,
            _number(span, s.ATTR_DECODE_ITL_P50_S, where, False),
            _number(span, s.ATTR_DECODE_ITL_P99_S, where, False),
            _number(span, s.ATTR_DECODE_ITL_MAX_S, where, False),
        )


def step_table(steps: StepColumns) -> StepTable:
    """The gathered step columns as a StepTable (numpy arrays, in the order taken)."""
    start_ns = np.array(steps.start_ns, dtype=np.int64)
    pairs = list(steps.pool_workers)  # in index order
    pools = np.array([pool for pool, _ in pairs] or [""], dtype=object)
    workers = np.array([worker for _, worker in pairs] or [""], dtype=object)
    codes = np.array(steps.pool_worker, dtype=np.intp)
    return StepTable(
        start_ns=start_ns,
        duration_s=(np.array(steps.end_ns, dtype=np.int64) - start_ns) / 1e9,
        pool=pools[codes],
        worker=workers[codes],
        decode_requests=np.array(steps.decode_requests, dtype=np.int64),
        prefill_tokens=np.array(steps.prefill_tokens, dtype=np.int64),
        context_tokens=np.array(steps.context_tokens, dtype=np.int64),
        prefill_attention_tokens2=np.array(steps.prefill_attention_tokens2, dtype=float),
        weight=np.array(steps.weight, dtype=float),
    )


def _take_request_span(
    span: Span, keys: _RequestKeys, requests: dict[str, RequestSpans], models: set[str], where: str
) -> None:
    attrs = span.attributes
    model = attrs.get(s.ATTR_MODEL) or attrs.get(vllm.ATTR_RESPONSE_MODEL)
    if isinstance(model, str):
        models.add(model)
    request = _request(requests, span)
    root = (
        span.start_ns,
        span.end_ns,
        int(_number(span, keys.input_tokens, where)),
        int(_number(span, keys.output_tokens, where)),
        span.status_code == STATUS_ERROR or s.ATTR_ERROR_TYPE in attrs,
        _number(span, keys.ttft_s, where, False),
        *(_number(span, key, where, False) if key else _NAN for key in keys.itl_p99_max_mean_s),
        _number(span, keys.itl_joined_tokens, where, False) if keys.itl_joined_tokens else _NAN,
        str(attrs.get(s.ATTR_MODE, keys.default_mode)),
    )
    if keys is _VLLM_REQUEST_KEYS:
        request.engine_request = True
        if request.root is not None:
            root = _join_disaggregated_halves(request.root, root)
    request.root = root


def _join_disaggregated_halves(one: tuple, other: tuple) -> tuple:
    """vLLM behind a P/D proxy: each instance emits its own `llm_request` in the request's trace, the
    prefill instance's with one output token. The request the client saw arrived with the prefill half,
    got its first streamed token from the decode half (its arrival + its TTFT) and ended with it."""
    prefill, decode = sorted((one, other), key=lambda root: root[0])
    start_ns = prefill[0]
    decode_ttft_s = decode[5]
    ttft_s = (decode[0] - start_ns) / 1e9 + decode_ttft_s if not np.isnan(decode_ttft_s) else prefill[5]
    return (
        start_ns,
        max(prefill[1], decode[1]),
        max(prefill[2], decode[2]),
        decode[3],
        prefill[4] or decode[4],
        ttft_s,
        *decode[6:10],
        Mode.DISAGGREGATED,
    )


def _pool_worker(span: Span, where: str, workers: dict[str, set[str]]) -> tuple[str, str]:
    """The span's (pool, worker), recorded as part of the observed layout."""
    pool, worker = _text(span, s.ATTR_POOL, where), _text(span, s.ATTR_WORKER, where)
    workers.setdefault(pool, set()).add(worker)
    return pool, worker


def _request(requests: dict[str, RequestSpans], span: Span) -> RequestSpans:
    request = requests.get(span.trace_id)
    if request is None:
        request = requests[span.trace_id] = RequestSpans()
    return request


def request_table(requests: dict[str, RequestSpans]) -> RequestTable:
    """One row per request whose request span was seen, by its start; stages it lacks are NaN."""
    rows = [r for r in requests.values() if r.root is not None]
    rows.sort(key=lambda r: r.root[0])  # type: ignore[index]
    n = len(rows)
    col: dict[str, Any] = {
        name: np.full(n, np.nan)
        for name in (
            "ttft_s",
            "itl_p50_s",
            "itl_p99_s",
            "itl_max_s",
            "itl_mean_s",
            "itl_joined_tokens",
            "queue_s",
            "prefill_s",
            "transfer_s",
            "decode_s",
        )
    }
    ints = {
        name: np.zeros(n, dtype=np.int64)
        for name in (
            "arrival_ns",
            "end_ns",
            "input_tokens",
            "cached_tokens",
            "output_tokens",
            "decode_start_ns",
            "decode_end_ns",
            "prefill_start_ns",
            "prefill_end_ns",
        )
    }
    failed = np.zeros(n, dtype=bool)
    prefill_worker = np.full(n, "", dtype=object)
    decode_worker = np.full(n, "", dtype=object)
    mode = np.full(n, "", dtype=object)
    for i, r in enumerate(rows):
        start, end, inp, out, err, ttft, p99, mx, mean, joined, m = r.root  # type: ignore[misc]
        ints["arrival_ns"][i], ints["end_ns"][i] = start, end
        ints["input_tokens"][i], ints["output_tokens"][i] = inp, out
        # An engine's request span names no mode: its sidecar's stage spans do (else colocated).
        failed[i], mode[i] = err, m or r.stage_mode or (Mode.COLOCATED if r.engine_request else "")
        col["itl_p99_s"][i], col["itl_max_s"][i], col["itl_mean_s"][i] = p99, mx, mean
        col["itl_joined_tokens"][i] = joined
        col["queue_s"][i] = r.queue
        first_token_ns = None
        if r.prefill is not None:
            p_start, p_end, _tokens, cached, worker = r.prefill
            ints["prefill_start_ns"][i], ints["prefill_end_ns"][i] = p_start, p_end
            ints["cached_tokens"][i] = cached
            col["prefill_s"][i] = (p_end - p_start) / 1e9
            prefill_worker[i] = worker
            first_token_ns = p_end
        if r.transfer is not None:
            col["transfer_s"][i] = r.transfer[0]
            if first_token_ns is not None:
                first_token_ns += int(r.transfer[0] * 1e9)
        if r.decode is not None:
            d_start, d_end, worker, p50, d_p99, d_max = r.decode
            ints["decode_start_ns"][i], ints["decode_end_ns"][i] = d_start, d_end
            col["decode_s"][i] = (d_end - d_start) / 1e9
            decode_worker[i] = worker
            col["itl_p50_s"][i] = p50
            # The router's figures win; the decode span's stand in when the root lacks them.
            if np.isnan(col["itl_p99_s"][i]):
                col["itl_p99_s"][i] = d_p99
            if np.isnan(col["itl_max_s"][i]):
                col["itl_max_s"][i] = d_max
        if not np.isnan(ttft):
            col["ttft_s"][i] = ttft
        elif first_token_ns is not None:
            col["ttft_s"][i] = (first_token_ns - start) / 1e9
        if out <= 1:  # no second token, no gap: nothing to miss
            for name in ("itl_p99_s", "itl_max_s", "itl_mean_s"):
                if np.isnan(col[name][i]):
                    col[name][i] = 0.0
    return RequestTable(
        failed=failed, prefill_worker=prefill_worker, decode_worker=decode_worker, mode=mode, **ints, **col
    )


def transfer_table(requests: dict[str, RequestSpans]) -> TransferTable:
    """One row per KV transfer whose size is known (the ones that measure the link)."""
    # Only transfers with their size measure the link; the others still count in their request's TTFT.
    rows = [(r, r.transfer) for r in requests.values() if r.transfer is not None and not np.isnan(r.transfer[1])]
    kv_bytes = np.array([transfer[1] for _, transfer in rows], dtype=float)
    exposed = np.array([transfer[0] for _, transfer in rows], dtype=float)
    wire = np.array([r.send if not np.isnan(r.send) else transfer[0] for r, transfer in rows], dtype=float)
    prompts = np.array([r.root[2] if r.root else (r.prefill[2] if r.prefill else 0) for r, _ in rows], dtype=float)
    return TransferTable(kv_bytes, exposed, wire, prompts)
