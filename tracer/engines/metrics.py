"""Which engine metric families mean the same as ours, and how they map (read by scrape.py).

Source names are family names as `prometheus_client.parser.text_string_to_metric_families` reports them
(counters without `_total`). Targets are the catalogue's families (tracer/metrics.py, architecture.md §5);
labels come from the sidecar's configuration (`pool`, `worker`, `mode`), from the source series (the
model name), or are fixed per mapping (`stage`, `phase`, `reason`). Families with no counterpart here
are not re-exported (docs/engines.md lists what each engine cannot supply).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tracer.metrics import PREEMPTIONS, REQUESTS_FINISHED, STEP_TOKENS
from tracer.vocabulary import Pool, Stage

GAUGE = "gauge"
COUNTER = "counter"
HISTOGRAM = "histogram"


@dataclass(frozen=True, slots=True)
class FamilyMap:
    """`source` series (those whose labels include `match`) re-yielded as `target`.

    `kind` is the target's type. `from_sample="sum"` turns a source histogram's `_sum` into a counter
    (e.g. bytes per transfer -> bytes total). Several source series that land on one target series are
    summed (`aggregate="sum"`) or the largest is kept (`"max"`, for ratios). `labels` are the target's
    label names, filled from: `pool`, `worker`, `mode` (configuration), `gen_ai_request_model` (the
    source's model label), `fixed`, or `copy` (target label -> the source label it takes its value from).
    `unless` names a source family that, when the exposition has it, replaces this mapping (an engine
    version with a better-fitting family). `scale` converts units: it multiplies gauge and counter values
    (MiB -> bytes) and a histogram's bucket bounds and sum (ms -> s).
    """

    source: str
    target: str
    kind: str
    labels: tuple[str, ...]
    fixed: dict[str, str] = field(default_factory=dict)
    match: dict[str, str] = field(default_factory=dict)
    from_sample: str = ""
    aggregate: str = "sum"
    copy: dict[str, str] = field(default_factory=dict)
    unless: str = ""
    scale: float = 1.0


_W = ("pool", "worker")
_REQ = ("gen_ai_request_model", "mode")
_KV = ("src_pool", "dst_pool")
_TRANSFER: dict[str, str] = {"src_pool": Pool.PREFILL, "dst_pool": Pool.DECODE}

VLLM = (
    FamilyMap("vllm:num_requests_waiting", "splitscope_requests_waiting", GAUGE, _W),
    FamilyMap("vllm:num_requests_running", "splitscope_requests_running", GAUGE, _W),
    FamilyMap("vllm:kv_cache_usage_perc", "splitscope_kv_cache_usage_ratio", GAUGE, _W, aggregate="max"),
    FamilyMap(
        "vllm:gpu_cache_usage_perc", "splitscope_kv_cache_usage_ratio", GAUGE, _W, aggregate="max"
    ),  # vLLM < 0.10
    FamilyMap("vllm:prefix_cache_queries", "splitscope_prefix_cache_queried_tokens", COUNTER, ("pool",)),
    FamilyMap("vllm:prefix_cache_hits", "splitscope_prefix_cache_hit_tokens", COUNTER, ("pool",)),
    # Prefill tokens computed, cache hits and pulled KV excluded, counted per step as our workers count them
    # (vLLM >= 0.2x: prompt_tokens_by_source{source="local_compute"}); older vLLM: every prompt token.
    FamilyMap(
        "vllm:prompt_tokens_by_source",
        "splitscope_tokens",
        COUNTER,
        ("pool", "phase"),
        {"phase": Stage.PREFILL},
        {"source": "local_compute"},
    ),
    FamilyMap(
        "vllm:prompt_tokens",
        "splitscope_tokens",
        COUNTER,
        ("pool", "phase"),
        {"phase": Stage.PREFILL},
        unless="vllm:prompt_tokens_by_source",
    ),
    FamilyMap("vllm:generation_tokens", "splitscope_tokens", COUNTER, ("pool", "phase"), {"phase": Stage.DECODE}),
    FamilyMap("vllm:iteration_tokens_total", STEP_TOKENS, HISTOGRAM, ("pool",)),
    FamilyMap("vllm:num_preemptions", PREEMPTIONS, COUNTER, ("pool",)),
    FamilyMap(
        "vllm:request_success", REQUESTS_FINISHED, COUNTER, ("pool", "reason"), copy={"reason": "finished_reason"}
    ),
    FamilyMap(
        "vllm:request_queue_time_seconds",
        "splitscope_stage_duration_seconds",
        HISTOGRAM,
        ("stage", "pool"),
        {"stage": "queue"},
    ),
    FamilyMap(
        "vllm:request_prefill_time_seconds",
        "splitscope_stage_duration_seconds",
        HISTOGRAM,
        ("stage", "pool"),
        {"stage": Stage.PREFILL},
    ),
    FamilyMap(
        "vllm:request_decode_time_seconds",
        "splitscope_stage_duration_seconds",
        HISTOGRAM,
        ("stage", "pool"),
        {"stage": Stage.DECODE},
    ),
    FamilyMap("vllm:inter_token_latency_seconds", "splitscope_inter_token_latency_seconds", HISTOGRAM, ("pool",)),
    FamilyMap("vllm:time_to_first_token_seconds", "gen_ai_server_time_to_first_token_seconds", HISTOGRAM, _REQ),
    FamilyMap(
        "vllm:request_time_per_output_token_seconds", "gen_ai_server_time_per_output_token_seconds", HISTOGRAM, _REQ
    ),
    FamilyMap("vllm:e2e_request_latency_seconds", "gen_ai_server_request_duration_seconds", HISTOGRAM, _REQ),
    # NIXL KV connector (disaggregated vLLM): per transfer, pooled per instance, not per request.
    FamilyMap(
        "vllm:nixl_xfer_time_seconds",
        "splitscope_stage_duration_seconds",
        HISTOGRAM,
        ("stage", "pool"),
        {"stage": "kv_transfer"},
    ),
    FamilyMap(
        "vllm:nixl_bytes_transferred", "splitscope_kv_transfer_bytes", COUNTER, _KV, _TRANSFER, from_sample="sum"
    ),
    FamilyMap(
        "vllm:nixl_num_failed_transfers",
        "splitscope_kv_transfer_failures",
        COUNTER,
        ("reason",),
        {"reason": "nixl_transfer_failed"},
    ),
    FamilyMap(
        "vllm:nixl_num_failed_notifications",
        "splitscope_kv_transfer_failures",
        COUNTER,
        ("reason",),
        {"reason": "nixl_notification_failed"},
    ),
    FamilyMap(
        "vllm:nixl_num_kv_expired_reqs",
        "splitscope_kv_transfer_failures",
        COUNTER,
        ("reason",),
        {"reason": "nixl_kv_expired"},
    ),
)

_STAGE = ("stage", "pool")
SGLANG = (
    FamilyMap("sglang:num_queue_reqs", "splitscope_requests_waiting", GAUGE, _W),
    FamilyMap("sglang:num_running_reqs", "splitscope_requests_running", GAUGE, _W),
    FamilyMap("sglang:token_usage", "splitscope_kv_cache_usage_ratio", GAUGE, _W, aggregate="max"),
    FamilyMap("sglang:prompt_tokens", "splitscope_tokens", COUNTER, ("pool", "phase"), {"phase": Stage.PREFILL}),
    FamilyMap("sglang:generation_tokens", "splitscope_tokens", COUNTER, ("pool", "phase"), {"phase": Stage.DECODE}),
    FamilyMap("sglang:prompt_tokens", "splitscope_prefix_cache_queried_tokens", COUNTER, ("pool",)),
    FamilyMap("sglang:cached_tokens", "splitscope_prefix_cache_hit_tokens", COUNTER, ("pool",)),
    # Per-stage request latency: SGLang's stage marks -> our stages (prefill side and decode side).
    FamilyMap(
        "sglang:per_stage_req_latency_seconds",
        "splitscope_stage_duration_seconds",
        HISTOGRAM,
        _STAGE,
        {"stage": "queue"},
        {"stage": "prefill_waiting"},
    ),
    FamilyMap(
        "sglang:per_stage_req_latency_seconds",
        "splitscope_stage_duration_seconds",
        HISTOGRAM,
        _STAGE,
        {"stage": "queue"},
        {"stage": "decode_waiting"},
    ),
    FamilyMap(
        "sglang:per_stage_req_latency_seconds",
        "splitscope_stage_duration_seconds",
        HISTOGRAM,
        _STAGE,
        {"stage": Stage.PREFILL},
        {"stage": "prefill_forward"},
    ),
    FamilyMap(
        "sglang:per_stage_req_latency_seconds",
        "splitscope_stage_duration_seconds",
        HISTOGRAM,
        _STAGE,
        {"stage": "kv_transfer"},
        {"stage": "prefill_transfer_kv_cache"},
    ),
    FamilyMap(
        "sglang:per_stage_req_latency_seconds",
        "splitscope_stage_duration_seconds",
        HISTOGRAM,
        _STAGE,
        {"stage": "kv_transfer"},
        {"stage": "decode_transferred"},
    ),
    FamilyMap(
        "sglang:per_stage_req_latency_seconds",
        "splitscope_stage_duration_seconds",
        HISTOGRAM,
        _STAGE,
        {"stage": Stage.DECODE},
        {"stage": "decode_loop"},
    ),
    FamilyMap("sglang:inter_token_latency_seconds", "splitscope_inter_token_latency_seconds", HISTOGRAM, ("pool",)),
    FamilyMap("sglang:time_to_first_token_seconds", "gen_ai_server_time_to_first_token_seconds", HISTOGRAM, _REQ),
    FamilyMap("sglang:time_per_output_token_seconds", "gen_ai_server_time_per_output_token_seconds", HISTOGRAM, _REQ),
    FamilyMap("sglang:e2e_request_latency_seconds", "gen_ai_server_request_duration_seconds", HISTOGRAM, _REQ),
    # PD disaggregation queues: requests waiting for the bootstrap handshake (prefill), for KV memory
    # (decode prealloc) or for their KV to arrive (decode transfer) are not running yet: they wait. The
    # prefill inflight queue holds requests already computed whose KV is being sent: not waiting for us.
    FamilyMap("sglang:num_prefill_prealloc_queue_reqs", "splitscope_requests_waiting", GAUGE, _W),
    FamilyMap("sglang:num_decode_prealloc_queue_reqs", "splitscope_requests_waiting", GAUGE, _W),
    FamilyMap("sglang:num_decode_transfer_queue_reqs", "splitscope_requests_waiting", GAUGE, _W),
    # Per-transfer KV size histogram (SGLang 2026; the older last-value gauge has no sum to count): MiB.
    FamilyMap(
        "sglang:kv_transfer_total_mb",
        "splitscope_kv_transfer_bytes",
        COUNTER,
        _KV,
        _TRANSFER,
        from_sample="sum",
        scale=2.0**20,
    ),
    FamilyMap(
        "sglang:num_transfer_failed_reqs",
        "splitscope_kv_transfer_failures",
        COUNTER,
        ("reason",),
        {"reason": "sglang_transfer_failed"},
    ),
    FamilyMap(
        "sglang:num_bootstrap_failed_reqs",
        "splitscope_kv_transfer_failures",
        COUNTER,
        ("reason",),
        {"reason": "sglang_bootstrap_failed"},
    ),
)

DYNAMO = (
    FamilyMap("dynamo_frontend_queued_requests", "splitscope_requests_waiting", GAUGE, _W),
    FamilyMap(
        "dynamo_frontend_time_to_first_token_seconds", "gen_ai_server_time_to_first_token_seconds", HISTOGRAM, _REQ
    ),
    FamilyMap("dynamo_frontend_request_duration_seconds", "gen_ai_server_request_duration_seconds", HISTOGRAM, _REQ),
    FamilyMap(
        "dynamo_frontend_inter_token_latency_seconds", "splitscope_inter_token_latency_seconds", HISTOGRAM, ("pool",)
    ),
    FamilyMap(
        "dynamo_frontend_input_sequence_tokens",
        "splitscope_tokens",
        COUNTER,
        ("pool", "phase"),
        {"phase": Stage.PREFILL},
        from_sample="sum",
    ),
    FamilyMap(
        "dynamo_frontend_output_tokens", "splitscope_tokens", COUNTER, ("pool", "phase"), {"phase": Stage.DECODE}
    ),
    # Disaggregated: prefill result at the router until the decode worker's first token, an upper bound on
    # the transfer (dispatch, network, transfer, one decode pass). Router's name, and the frontend's.
    FamilyMap(
        "dynamo_component_router_kv_transfer_estimated_latency_seconds",
        "splitscope_stage_duration_seconds",
        HISTOGRAM,
        ("stage", "pool"),
        {"stage": "kv_transfer"},
    ),
    FamilyMap(
        "dynamo_frontend_kv_transfer_estimated_latency_seconds",
        "splitscope_stage_duration_seconds",
        HISTOGRAM,
        ("stage", "pool"),
        {"stage": "kv_transfer"},
        unless="dynamo_component_router_kv_transfer_estimated_latency_seconds",
    ),
)

ENGINES: dict[str, tuple[FamilyMap, ...]] = {"vllm": VLLM, "sglang": SGLANG, "dynamo": DYNAMO}
# The label that names the model, per engine; the label that tells engine cores apart inside one scrape.
MODEL_LABELS = ("model_name", "model")
ENGINE_INDEX_LABELS = ("engine", "dp_rank")
