"""The public contract's names, defined once (docs/architecture.md sections 4-7).

Span names, span attributes, stages, pools, modes, worker roles, scheduler policies and verdicts (with
the one mapping between modes, roles, policies and pools): every producer (the tracer, the reference
server, the sidecar's engine adapters) and every reader (the report, the tests) imports them from here, so a
rename is a one-line change here. Metric names live with their definitions in `tracer.metrics`.

Dependency-free on purpose: engine code imports it on the hot path's import chain.
"""

from __future__ import annotations

from enum import StrEnum


class Stage(StrEnum):
    """A request's stages, as recorded by `Tracer.stage` and as the `stage` label of stage metrics."""

    QUEUE = "queue"
    PREFILL = "prefill"
    KV_TRANSFER = "kv_transfer"
    KV_SEND = "kv_transfer.send"
    KV_RECV = "kv_transfer.recv"
    DECODE = "decode"


# The stages that carry a `stage` label value on `splitscope_stage_duration_seconds` (the transfer's two
# halves are children of the transfer span and are not metered apart).
METERED_STAGES = (Stage.QUEUE, Stage.PREFILL, Stage.KV_TRANSFER, Stage.DECODE)


class Pool(StrEnum):
    """`splitscope.pool`: which pool a worker serves."""

    COLOCATED = "colocated"
    PREFILL = "prefill"
    DECODE = "decode"


class Mode(StrEnum):
    """`splitscope.mode`: how a deployment serves (the router's layout)."""

    COLOCATED = "colocated"
    CHUNKED = "chunked"
    DISAGGREGATED = "disaggregated"


class Role(StrEnum):
    """A reference-server worker's role (`--role`): which scheduler policy it runs and which pool it serves."""

    COLOCATED = "colocated"
    CHUNKED = "chunked"
    PREFILL = "prefill"
    DECODE = "decode"


class SchedulerPolicy(StrEnum):
    """How a reference-server scheduler fills a step (reference_server/scheduler.py)."""

    COLOCATED = "colocated"  # running decodes plus whole waiting prompts in one step (they wait for it)
    CHUNKED = "chunked"  # running decodes first, then prefill chunks within the token budget
    PREFILL_ONLY = "prefill-only"  # whole prompts, no decodes; a prefilled sequence is handed off
    DECODE_ONLY = "decode-only"  # decodes only, of sequences whose KV arrived already computed


# The one mapping between the four: a deployment mode runs workers of these roles; a role runs a policy
# and serves a pool (`splitscope.pool` on its spans, the `pool` label on its metrics).
ROLES_OF_MODE: dict[Mode, tuple[Role, ...]] = {
    Mode.COLOCATED: (Role.COLOCATED,),
    Mode.CHUNKED: (Role.CHUNKED,),
    Mode.DISAGGREGATED: (Role.PREFILL, Role.DECODE),
}
POLICY_OF_ROLE: dict[Role, SchedulerPolicy] = {
    Role.COLOCATED: SchedulerPolicy.COLOCATED,
    Role.CHUNKED: SchedulerPolicy.CHUNKED,
    Role.PREFILL: SchedulerPolicy.PREFILL_ONLY,
    Role.DECODE: SchedulerPolicy.DECODE_ONLY,
}
POOL_OF_ROLE: dict[Role, Pool] = {
    Role.COLOCATED: Pool.COLOCATED,
    Role.CHUNKED: Pool.COLOCATED,
    Role.PREFILL: Pool.PREFILL,
    Role.DECODE: Pool.DECODE,
}
# The pools a deployment of each mode has (a chunked deployment's workers serve the colocated pool).
POOLS_OF_MODE: dict[Mode, tuple[Pool, ...]] = {
    mode: tuple(dict.fromkeys(POOL_OF_ROLE[role] for role in roles)) for mode, roles in ROLES_OF_MODE.items()
}


class Verdict(StrEnum):
    """What `splitscope report` recommends."""

    STAY_COLOCATED = "stay-colocated"
    ENABLE_CHUNKED_PREFILL = "enable-chunked-prefill"
    SPLIT = "split"
    REBALANCE = "rebalance"
    MERGE = "merge"
    INSUFFICIENT_DATA = "insufficient-data"


class AdviceReason(StrEnum):
    """The `reason` label of `splitscope_advice_decisions_total`: what one closed window did to the held
    advice of `splitscope advise` (tracer.advise.hold.window_reason)."""

    INSUFFICIENT_DATA = "insufficient_data"  # the window decided nothing; the held advice stays
    FIRST = "first"  # the first window that decided something set the advice
    AGREED = "agreed"  # the window's advice is the held one
    HELD = "held"  # the window disagreed; the held advice stays (its challenger has not won --hold in a row)
    CHANGED = "changed"  # the window's advice won --hold windows in a row and replaced the held one


class SloObjective(StrEnum):
    """The objectives `splitscope.slo.missed` names."""

    TTFT = "ttft"  # time to first token
    ITL = "itl"  # inter-token latency (the request's worst gap)


class DropReason(StrEnum):
    """The `reason` label of `splitscope_tracer_dropped_records_total`: where the tracer lost records."""

    RING_FULL = "ring_full"  # the engine outran the pipeline; the ring dropped its oldest records
    PENDING_FULL = "pending_full"  # too many records waited for their CUDA events
    BAD_RECORD = "bad_record"  # a record the pipeline could not turn into a span
    SINK_ERROR = "sink_error"  # the sink (exporter, sidecar client) raised on a batch
    SIDECAR_UNREACHABLE = "sidecar_unreachable"  # the sidecar client's buffer overflowed or a send failed
    EXPORT_QUEUE_FULL = "export_queue_full"  # an OpenTelemetry batch processor's queue was full
    EXPORT_FAILED = "export_failed"  # an exporter gave up on a batch (collector down past its retries)


# ---------------------------------------------------------------------------------------- span names

ROOT_SPAN_PREFIX = "text_completion"  # the router's root span: "text_completion {model}"
CHAT_SPAN_PREFIX = "chat"  # the router's root span for chat completions: "chat {model}"
# `gen_ai.operation.name` of the root span, which is also its name's prefix ("{operation} {model}").
OPERATION_TEXT_COMPLETION = ROOT_SPAN_PREFIX
OPERATION_CHAT = CHAT_SPAN_PREFIX
ROOT_SPAN_PREFIXES = (ROOT_SPAN_PREFIX, CHAT_SPAN_PREFIX)
SPAN_QUEUE = "splitscope.queue"
SPAN_PREFILL = "splitscope.prefill"
SPAN_KV_TRANSFER = "splitscope.kv_transfer"
SPAN_KV_SEND = "splitscope.kv_transfer.send"
SPAN_KV_RECV = "splitscope.kv_transfer.recv"
SPAN_DECODE = "splitscope.decode"
SPAN_STEP = "splitscope.step"
EVENT_DECODE_STALL = "splitscope.decode.stall"

STAGE_SPAN_NAMES: dict[str, str] = {
    Stage.QUEUE: SPAN_QUEUE,
    Stage.PREFILL: SPAN_PREFILL,
    Stage.KV_TRANSFER: SPAN_KV_TRANSFER,
    Stage.KV_SEND: SPAN_KV_SEND,
    Stage.KV_RECV: SPAN_KV_RECV,
    Stage.DECODE: SPAN_DECODE,
}

# ---------------------------------------------------------------------------------------- attributes

ATTR_OPERATION = "gen_ai.operation.name"
ATTR_MODEL = "gen_ai.request.model"
ATTR_INPUT_TOKENS = "gen_ai.usage.input_tokens"
ATTR_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
ATTR_REQUEST_ID = "splitscope.request.id"
ATTR_MODE = "splitscope.mode"
ATTR_TTFT_S = "splitscope.ttft_s"
ATTR_ITL_P99_S = "splitscope.itl_p99_s"
ATTR_ITL_MAX_S = "splitscope.itl_max_s"
ATTR_ITL_MEAN_S = "splitscope.itl_mean_s"
# Tokens that reached the client in the same stream event as the token before them (a gap of zero): text
# held back for an incomplete UTF-8 character or a possible stop string, or several tokens from one step.
# The gap before such an event spans two or more engine steps; the report replays that share.
ATTR_ITL_JOINED_TOKENS = "splitscope.itl_joined_tokens"
ATTR_POOL = "splitscope.pool"
ATTR_WORKER = "splitscope.worker"
ATTR_TIMING_SOURCE = "splitscope.timing.source"
# On the first stage span the sidecar adapts from an engine's request span: seconds from the request's
# arrival at the engine's front end until its scheduler queued it (tokenisation, IPC), outside every stage.
ATTR_FRONTEND_S = "splitscope.frontend_s"
ATTR_PREFILL_TOKENS = "splitscope.prefill.tokens"
ATTR_PREFILL_CACHED_TOKENS = "splitscope.prefill.cached_tokens"
ATTR_PREFILL_CHUNKS = "splitscope.prefill.chunks"
ATTR_KV_BYTES = "splitscope.kv.bytes"
ATTR_KV_BLOCKS = "splitscope.kv.blocks"
ATTR_KV_BLOCK_TOKENS = "splitscope.kv.block_tokens"
ATTR_KV_STREAMS = "splitscope.kv.streams"
ATTR_KV_SRC = "splitscope.kv.src"
ATTR_KV_DST = "splitscope.kv.dst"
ATTR_CLOCK_OFFSET_NS = "splitscope.clock.offset_ns"
ATTR_DECODE_ITL_P50_S = "splitscope.decode.itl_p50_s"
ATTR_DECODE_ITL_P99_S = "splitscope.decode.itl_p99_s"
ATTR_DECODE_ITL_MAX_S = "splitscope.decode.itl_max_s"
ATTR_DECODE_STALLS = "splitscope.decode.stalls"
# On the decode span, built off the hot path from the worker's step records (tracer/pipeline.py): the
# time of its stall gaps, summed (ns), and span links to the prefill spans that ran in the steps that
# ended them, at most MAX_STALL_LINKS (tracer.pipeline), the largest first; the rest are counted.
ATTR_DECODE_STALLED_NS = "splitscope.decode.stalled_ns"
ATTR_DECODE_STALL_LINKS_DROPPED = "splitscope.decode.stall_links_dropped"
# On each such link: the stall time that prefill's tokens took (its share of each stalled step by
# prompt tokens in that step, ns), and its prompt tokens in those steps.
ATTR_LINK_STALLED_NS = "splitscope.link.stalled_ns"
ATTR_LINK_PREFILL_TOKENS = "splitscope.link.prefill_tokens"
# The sidecar's decode spans for engines without step records (tracer/sidecar/overlap.py): the links are
# the prefills whose windows overlapped the decode on the same worker, stalled_ns each overlap, marked
# estimated; the decode's stalled_ns is their union, marked estimated too.
ATTR_LINK_ESTIMATED = "splitscope.link.estimated"
ATTR_DECODE_STALLED_ESTIMATED = "splitscope.decode.stalled_estimated"
ATTR_STEP_DECODE_REQUESTS = "splitscope.step.decode_requests"
ATTR_STEP_PREFILL_TOKENS = "splitscope.step.prefill_tokens"
ATTR_STEP_CONTEXT_TOKENS = "splitscope.step.context_tokens"
# Attention work of the step's prefill chunks, tokens^2: each chunk of n tokens at offset c in its prompt
# counts (c + n)^2 - c^2 (a whole prompt of L tokens counts L^2), so a prompt's chunks add up to its
# whole prefill's quadratic term. Optional: without it the report takes prefill_tokens^2.
ATTR_STEP_PREFILL_ATTENTION_TOKENS2 = "splitscope.step.prefill_attention_tokens2"
# On a step span: how many engine steps this exported span stands for (1, or N of a 1-in-N rule;
# tracer.step_sampling). Readers weigh each step span by it; absent means 1.
ATTR_SAMPLE_WEIGHT = "splitscope.sample.weight"
# On the root span, when the deployment has latency objectives: whether the request missed one (bool),
# and which (`SloObjective` values joined by ","; absent when none was missed).
ATTR_SLO_VIOLATED = "splitscope.slo.violated"
ATTR_SLO_MISSED = "splitscope.slo.missed"
ATTR_ERROR_TYPE = "error.type"

# Resource attributes (OpenTelemetry semantic conventions).
RESOURCE_SERVICE_NAME = "service.name"
RESOURCE_SERVICE_NAMESPACE = "service.namespace"  # the deployment; the `namespace` label on metrics
RESOURCE_SERVICE_INSTANCE = "service.instance.id"
RESOURCE_HOST_NAME = "host.name"

# Timing sources (`splitscope.timing.source`).
SOURCE_HOST = "host"
SOURCE_CUDA = "cuda"

# OTLP span kinds (trace.proto Span.SpanKind); ours are INTERNAL and SERVER, others pass through.
KIND_INTERNAL = 1
KIND_SERVER = 2
KIND_CLIENT = 3
KIND_PRODUCER = 4
KIND_CONSUMER = 5
