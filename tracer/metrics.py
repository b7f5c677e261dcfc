"""The metric catalogue (architecture.md §5): every name, label and bucket is defined here once.

`Catalogue(registry)` builds every family; `catalogue.bind(pool, worker)` returns `WorkerMetrics`, the
label children one worker writes, bound once at start so recording is only `inc`/`set`/`observe`.
Latency histograms take the request's trace id as an OpenMetrics exemplar.

Buckets (seconds) are chosen for LLM serving, and SLO thresholds used by alerts/ must be bucket
boundaries so burn-rate rules can count "good" requests exactly:
- LATENCY_BUCKETS_S (TTFT, request duration, stages, steps): 1 ms .. 80 s, dense between 10 ms and 1 s
  where prefill steps and TTFT SLOs live.
- TOKEN_BUCKETS_S (inter-token latency, time per output token): 1 ms .. 2.5 s, dense between 10 and
  100 ms where decode steps and ITL SLOs live.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import start_http_server
from prometheus_client.metrics_core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.samples import Exemplar
from prometheus_client.utils import floatToGoString

from tracer.resource import env_resource_attributes
from tracer.vocabulary import METERED_STAGES, RESOURCE_SERVICE_NAMESPACE, DropReason, Mode, Pool, Stage

LATENCY_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
TOKEN_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
)

# Names the alert rules and dashboards read, as Prometheus stores them (histograms: the family, without
# `_bucket`/`_sum`/`_count`; counters: with `_total`).
TTFT_HISTOGRAM = "gen_ai_server_time_to_first_token_seconds"
ITL_HISTOGRAM = "splitscope_inter_token_latency_seconds"
STEP_HISTOGRAM = "splitscope_step_duration_seconds"
STAGE_HISTOGRAM = "splitscope_stage_duration_seconds"
KV_TRANSFER_FAILURES_COUNTER = "splitscope_kv_transfer_failures_total"
TRACER_DROPPED_COUNTER = "splitscope_tracer_dropped_records_total"
WORKER_BUSY_COUNTER = "splitscope_worker_busy_seconds_total"
POOL_WORKERS_GAUGE = "splitscope_pool_workers"
REQUESTS_WAITING_GAUGE = "splitscope_requests_waiting"
# The request-level interference signal (tracer/sidecar/overlap.py), for engines without step timing:
# each finished request's decode, classified by whether another request's prefill ran on its worker meanwhile.
DECODE_TPOT_HISTOGRAM = "splitscope_decode_tpot_seconds"
DECODE_STEPS_COUNTER = "splitscope_decode_overlap_classified_steps_total"
DECODE_SECONDS_COUNTER = "splitscope_decode_overlap_classified_seconds_total"
OVERLAP_PREFILL_STEPS_COUNTER = "splitscope_decode_overlap_prefill_steps_total"
OVERLAP_PREFILL_SECONDS_COUNTER = "splitscope_decode_overlap_prefill_seconds_total"
OVERLAP_PREFILL_TOKENS_COUNTER = "splitscope_decode_overlap_prefill_tokens_total"
OVERLAP_LATE_PREFILLS_COUNTER = "splitscope_decode_overlap_late_prefills_total"
OVERLAP_UNCLASSIFIED_COUNTER = "splitscope_decode_overlap_unclassified_requests_total"
PREFILL_OVERLAP_LABEL = "prefill_overlap"
WORKER_PREFILL_BUSY_COUNTER = "splitscope_worker_prefill_busy_seconds_total"

# Labels of the process, not of the catalogue: every series a process exports carries them.
NAMESPACE_LABEL = "namespace"
WORKER_LABEL = "worker"

POOLS = tuple(Pool)
# splitscope_kv_transfer_failures_total{reason}
KV_FAILURE_REFUSED = "refused"
KV_TRANSFER_FAILURE_REASONS = (
    "checksum",  # bytes arrived but do not match the sender's checksum
    "connection",  # a connection could not be made, or dropped mid-transfer
    "timeout",  # a socket operation or the whole transfer ran past its deadline
    KV_FAILURE_REFUSED,  # the receiver is out of blocks, connections or transfer slots, or rejected the result
    "unauthorized",  # the shared-secret token is missing or wrong
    "bad_header",  # a frame failed validation (the receiver wrote nothing into its pool)
)
# splitscope_requests_aborted_total{reason}: requests ended before their answer was complete (the router
# counts each once, wherever the request then lived).
REQUESTS_ABORTED = "splitscope_requests_aborted"
ABORT_CLIENT_DISCONNECTED = "client_disconnected"  # the client closed its connection mid-request
REQUEST_ABORT_REASONS = (ABORT_CLIENT_DISCONNECTED,)
MODES = tuple(Mode)
# Tokens one engine step processed (prefill and decode together): 1 .. 16k, doubling.
STEP_TOKEN_BUCKETS = tuple(float(2**i) for i in range(15))

# Families the sidecar writes about its engine scrapes (not in a worker's process): one series per engine.
ENGINE_SCRAPE_UP = "splitscope_engine_scrape_up"
ENGINE_SCRAPE_DURATION = "splitscope_engine_scrape_duration_seconds"
# Families only an engine scrape feeds today (vLLM's iteration_tokens_total, num_preemptions,
# request_success): declared here so their names and labels are defined once.
STEP_TOKENS = "splitscope_step_tokens"
PREEMPTIONS = "splitscope_preemptions"
REQUESTS_FINISHED = "splitscope_requests_finished"
# The sidecar's local tail sampler (tracer/sidecar/tail_sampler.py): spans it kept or dropped on purpose
# (not losses: splitscope_tracer_dropped_records counts those), and its decisions per trace.
TAIL_SAMPLER_SPANS = "splitscope_tail_sampler_spans"
TAIL_SAMPLER_TRACES = "splitscope_tail_sampler_traces"

# `splitscope advise --metrics-port` (tracer/advise/exposition.py): the held advice per deployment, its last
# window's figures and its decisions by reason. Its own process and registry (`AdviceMetrics`), not a worker's.
ADVICE_INFO = "splitscope_advice_info"
ADVICE_DIFFERS = "splitscope_advice_differs"
ADVICE_GAIN = "splitscope_advice_gain_ratio"
ADVICE_CONFIDENCE = "splitscope_advice_confidence_ratio"
ADVICE_WINDOW_REQUESTS = "splitscope_advice_window_requests"
ADVICE_DECISIONS_COUNTER = "splitscope_advice_decisions_total"
ADVICE_FAMILIES = (
    ADVICE_INFO,
    ADVICE_DIFFERS,
    ADVICE_GAIN,
    ADVICE_CONFIDENCE,
    ADVICE_WINDOW_REQUESTS,
    ADVICE_DECISIONS_COUNTER,
)


# The catalogue, one row per family: what each metric is called, what it measures, its labels and buckets.
# `Catalogue` builds one family per row, in this order (the exposition's order). A row's `name` is the name
# Prometheus stores and queries use: a counter's ends in `_total` (prometheus_client takes it without), a
# histogram's is the family (without `_bucket`, `_sum`, `_count`).
COUNTER = "counter"
GAUGE = "gauge"
HISTOGRAM = "histogram"  # prometheus_client's, with exemplars (one observation a call)
BULK_HISTOGRAM = "bulk_histogram"  # BulkHistogram: fed many values a call, no exemplars
TOTAL = "_total"


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One family: `attribute` (its name on `Catalogue`), `name` (see above), `kind` (one of the four
    kinds above), `help`, `labels` (in series order) and, for histograms, `buckets` (seconds or tokens)."""

    attribute: str
    name: str
    kind: str
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


_REQUEST = ("gen_ai_request_model", "mode")
_WORKER = ("pool", "worker")
_OVERLAP = ("pool", PREFILL_OVERLAP_LABEL)

METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "ttft", TTFT_HISTOGRAM, HISTOGRAM, "Time to first token, as the server sent it", _REQUEST, LATENCY_BUCKETS_S
    ),
    MetricSpec(
        "tpot",
        "gen_ai_server_time_per_output_token_seconds",
        HISTOGRAM,
        "Time per output token after the first",
        _REQUEST,
        TOKEN_BUCKETS_S,
    ),
    MetricSpec(
        "request_duration",
        "gen_ai_server_request_duration_seconds",
        HISTOGRAM,
        "End-to-end request duration",
        _REQUEST,
        LATENCY_BUCKETS_S,
    ),
    MetricSpec(
        "stage_duration",
        STAGE_HISTOGRAM,
        HISTOGRAM,
        "Time a request spent in each stage",
        ("stage", "pool"),
        LATENCY_BUCKETS_S,
    ),
    MetricSpec(
        "inter_token_latency",
        ITL_HISTOGRAM,
        BULK_HISTOGRAM,
        "Gap between consecutive output tokens of a request",
        ("pool",),
        TOKEN_BUCKETS_S,
    ),
    # Fed a batch at a time (one value per engine step, no exemplar: a step serves many requests).
    MetricSpec(
        "step_duration",
        STEP_HISTOGRAM,
        BULK_HISTOGRAM,
        "Engine iteration time, split by whether prefill tokens shared the step (interference)",
        ("pool", "prefill_in_step"),
        LATENCY_BUCKETS_S,
    ),
    MetricSpec(
        "kv_transfer_bytes",
        "splitscope_kv_transfer_bytes_total",
        COUNTER,
        "KV cache bytes moved between pools",
        ("src_pool", "dst_pool"),
    ),
    MetricSpec(
        "kv_transfer_failures", KV_TRANSFER_FAILURES_COUNTER, COUNTER, "Failed KV transfers by reason", ("reason",)
    ),
    MetricSpec("tokens", "splitscope_tokens_total", COUNTER, "Tokens processed by phase", ("pool", "phase")),
    MetricSpec("requests_waiting", REQUESTS_WAITING_GAUGE, GAUGE, "Requests queued in a worker", _WORKER),
    MetricSpec("requests_running", "splitscope_requests_running", GAUGE, "Requests scheduled in a worker", _WORKER),
    MetricSpec("worker_busy", WORKER_BUSY_COUNTER, COUNTER, "Time a worker spent running engine steps", _WORKER),
    MetricSpec("pool_workers", POOL_WORKERS_GAUGE, GAUGE, "Workers in each pool", ("pool",)),
    MetricSpec("kv_cache_usage", "splitscope_kv_cache_usage_ratio", GAUGE, "Share of KV cache blocks in use", _WORKER),
    MetricSpec(
        "prefix_queried",
        "splitscope_prefix_cache_queried_tokens_total",
        COUNTER,
        "Prompt tokens looked up in the prefix cache",
        ("pool",),
    ),
    MetricSpec(
        "prefix_hit",
        "splitscope_prefix_cache_hit_tokens_total",
        COUNTER,
        "Prompt tokens found in the prefix cache",
        ("pool",),
    ),
    MetricSpec(
        "gpu_utilization", "splitscope_gpu_utilization_ratio", GAUGE, "GPU busy share over the last sample", ("gpu",)
    ),
    MetricSpec("gpu_memory_used", "splitscope_gpu_memory_used_bytes", GAUGE, "GPU memory in use", ("gpu",)),
    MetricSpec("gpu_telemetry_up", "splitscope_gpu_telemetry_up", GAUGE, "1 when GPU telemetry is being sampled"),
    MetricSpec("tracer_dropped", TRACER_DROPPED_COUNTER, COUNTER, "Telemetry records dropped, by reason", ("reason",)),
    MetricSpec(
        "requests_aborted",
        REQUESTS_ABORTED + TOTAL,
        COUNTER,
        "Requests aborted before their answer was complete, by reason",
        ("reason",),
    ),
    MetricSpec(
        "tail_sampler_spans",
        TAIL_SAMPLER_SPANS + TOTAL,
        COUNTER,
        "Spans the sidecar's tail sampler exported or dropped, by decision",
        ("decision",),
    ),
    MetricSpec(
        "tail_sampler_traces",
        TAIL_SAMPLER_TRACES + TOTAL,
        COUNTER,
        "Traces the sidecar's tail sampler decided, by decision and what triggered it (root, timeout, buffer_full)",
        ("decision", "trigger"),
    ),
    MetricSpec(
        "tracer_pending", "splitscope_tracer_pending_records", GAUGE, "Records waiting for export or CUDA events"
    ),
    MetricSpec(
        "step_tokens",
        STEP_TOKENS,
        HISTOGRAM,
        "Tokens one engine step processed, prefill and decode together",
        ("pool",),
        STEP_TOKEN_BUCKETS,
    ),
    MetricSpec(
        "preemptions",
        PREEMPTIONS + TOTAL,
        COUNTER,
        "Requests preempted (their KV freed, to be recomputed)",
        ("pool",),
    ),
    MetricSpec(
        "requests_finished",
        REQUESTS_FINISHED + TOTAL,
        COUNTER,
        "Finished requests by finish reason (stop, length, abort, error)",
        ("pool", "reason"),
    ),
    # Fed a batch of finished requests at a time (the sidecar's classifier), no exemplar.
    MetricSpec(
        "decode_tpot",
        DECODE_TPOT_HISTOGRAM,
        BULK_HISTOGRAM,
        "A finished request's decode time per output token after the first, split by whether another "
        "request's prefill ran on its worker during its decode (engines without step timing)",
        _OVERLAP,
        TOKEN_BUCKETS_S,
    ),
    MetricSpec(
        "decode_classified_steps",
        DECODE_STEPS_COUNTER,
        COUNTER,
        "Decode steps (output tokens after the first) of the requests splitscope_decode_tpot_seconds classified",
        _OVERLAP,
    ),
    MetricSpec(
        "decode_classified_seconds",
        DECODE_SECONDS_COUNTER,
        COUNTER,
        "Decode time of the requests splitscope_decode_tpot_seconds classified",
        _OVERLAP,
    ),
    MetricSpec(
        "overlap_prefill_steps",
        OVERLAP_PREFILL_STEPS_COUNTER,
        COUNTER,
        "Steps of overlapped decodes that carried another request's prefill (prefills starting together: one step)",
        ("pool",),
    ),
    MetricSpec(
        "overlap_prefill_seconds",
        OVERLAP_PREFILL_SECONDS_COUNTER,
        COUNTER,
        "Time of those steps: the union of the overlapping prefill windows inside each decode",
        ("pool",),
    ),
    MetricSpec(
        "overlap_prefill_tokens",
        OVERLAP_PREFILL_TOKENS_COUNTER,
        COUNTER,
        "Uncached prompt tokens of those prefills, weighted by the share of each prefill inside the decode",
        ("pool",),
    ),
    MetricSpec(
        "worker_prefill_busy",
        WORKER_PREFILL_BUSY_COUNTER,
        COUNTER,
        "Time a worker had at least one request in prefill, from request spans (engines without step timing)",
        _WORKER,
    ),
    MetricSpec(
        "overlap_late_prefills",
        OVERLAP_LATE_PREFILLS_COUNTER,
        COUNTER,
        "Prefills that arrived after a decode they overlapped was classified (not counted in it)",
        ("pool",),
    ),
    MetricSpec(
        "overlap_unclassified",
        OVERLAP_UNCLASSIFIED_COUNTER,
        COUNTER,
        "Finished decodes left unclassified because the classifier's bounded hold was full",
        ("pool",),
    ),
)


def build_family(spec: MetricSpec, registry: CollectorRegistry) -> Counter | Gauge | Histogram | BulkHistogram:
    """The prometheus_client family (or BulkHistogram) for one row, registered in `registry`."""
    labels = list(spec.labels)
    if spec.kind == COUNTER:
        return Counter(spec.name.removesuffix(TOTAL), spec.help, labels, registry=registry)
    if spec.kind == GAUGE:
        return Gauge(spec.name, spec.help, labels, registry=registry)
    if spec.kind == HISTOGRAM:
        return Histogram(spec.name, spec.help, labels, buckets=spec.buckets, registry=registry)
    if spec.kind == BULK_HISTOGRAM:
        return BulkHistogram(spec.name, spec.help, labels, buckets=spec.buckets, registry=registry)
    raise ValueError(f"metric {spec.name}: unknown kind {spec.kind!r}")


class Catalogue:
    """Every splitscope metric family (one per row of `METRICS`), registered in `registry` (one per
    process or per test); each is the attribute its row names.

    `worker_gauges=False` (the sidecar): `bind` gives each worker detached gauge children, never exposed,
    because a process that only sees spans never measures queue depth or KV cache use, and a gauge at 0
    would read as measured.
    """

    # One annotation per row of METRICS (a test holds the two equal): the families' types, for callers.
    ttft: Histogram
    tpot: Histogram
    request_duration: Histogram
    stage_duration: Histogram
    inter_token_latency: BulkHistogram
    step_duration: BulkHistogram
    kv_transfer_bytes: Counter
    kv_transfer_failures: Counter
    tokens: Counter
    requests_waiting: Gauge
    requests_running: Gauge
    worker_busy: Counter
    pool_workers: Gauge
    kv_cache_usage: Gauge
    prefix_queried: Counter
    prefix_hit: Counter
    gpu_utilization: Gauge
    gpu_memory_used: Gauge
    gpu_telemetry_up: Gauge
    tracer_dropped: Counter
    requests_aborted: Counter
    tail_sampler_spans: Counter
    tail_sampler_traces: Counter
    tracer_pending: Gauge
    step_tokens: Histogram
    preemptions: Counter
    requests_finished: Counter
    decode_tpot: BulkHistogram
    decode_classified_steps: Counter
    decode_classified_seconds: Counter
    overlap_prefill_steps: Counter
    overlap_prefill_seconds: Counter
    overlap_prefill_tokens: Counter
    worker_prefill_busy: Counter
    overlap_late_prefills: Counter
    overlap_unclassified: Counter

    def __init__(self, registry: CollectorRegistry, *, worker_gauges: bool = True) -> None:
        self.registry = registry
        self.worker_gauges = worker_gauges
        for spec in METRICS:
            setattr(self, spec.attribute, build_family(spec, registry))
        # Children that exist from the start, so increase() sees the first failure of each kind (a series
        # born at 1 has no increase) and absent() behaves before any failure.
        for drop_reason in DropReason:
            self.tracer_dropped.labels(reason=drop_reason)
        for reason in KV_TRANSFER_FAILURE_REASONS:
            self.kv_transfer_failures.labels(reason=reason)
        for reason in REQUEST_ABORT_REASONS:
            self.requests_aborted.labels(reason=reason)

    def process_set(self) -> dict[str, Gauge | Counter]:
        """The families a process sets itself, by family name: gauges it measures (queue depth, KV cache
        use, live workers, GPUs) and counters it increments directly, as opposed to those derived from its
        spans. A process shipping its spans to a sidecar sends these in metrics snapshots (wire.py), since
        no span carries them."""
        families: tuple[Gauge | Counter, ...] = (
            self.requests_waiting,
            self.requests_running,
            self.kv_cache_usage,
            self.pool_workers,
            self.gpu_utilization,
            self.gpu_memory_used,
            self.gpu_telemetry_up,
            self.tracer_pending,
            self.tracer_dropped,
            self.requests_aborted,
        )
        return {next(iter(family.describe())).name: family for family in families}

    def bind(self, pool: str, worker: str) -> WorkerMetrics:
        """The label children of one worker, created once."""
        if pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
        if self.worker_gauges:
            waiting, running, kv_cache = (
                g.labels(pool=pool, worker=worker)
                for g in (self.requests_waiting, self.requests_running, self.kv_cache_usage)
            )
        else:  # registered nowhere: settable, never exposed
            waiting, running, kv_cache = (Gauge(f"detached_{i}", "not exposed", registry=None) for i in range(3))
        return WorkerMetrics(
            stage={s: self.stage_duration.labels(stage=s, pool=pool) for s in METERED_STAGES},
            inter_token_latency=self.inter_token_latency.labels(pool=pool),
            step_with_prefill=self.step_duration.labels(pool=pool, prefill_in_step="true"),
            step_without_prefill=self.step_duration.labels(pool=pool, prefill_in_step="false"),
            prefill_tokens=self.tokens.labels(pool=pool, phase=Stage.PREFILL),
            decode_tokens=self.tokens.labels(pool=pool, phase=Stage.DECODE),
            requests_waiting=waiting,
            requests_running=running,
            busy_seconds=self.worker_busy.labels(pool=pool, worker=worker),
            kv_cache_usage=kv_cache,
            prefix_queried_tokens=self.prefix_queried.labels(pool=pool),
            prefix_hit_tokens=self.prefix_hit.labels(pool=pool),
        )


@dataclass(frozen=True, slots=True)
class WorkerMetrics:
    """Label children of one worker; every field is safe to call from any thread."""

    stage: dict
    inter_token_latency: BulkHistogramChild
    step_with_prefill: BulkHistogramChild
    step_without_prefill: BulkHistogramChild
    prefill_tokens: Counter
    decode_tokens: Counter
    requests_waiting: Gauge
    requests_running: Gauge
    busy_seconds: Counter
    kv_cache_usage: Gauge
    prefix_queried_tokens: Counter
    prefix_hit_tokens: Counter


class BulkHistogramChild:
    """One label set of a BulkHistogram. Thread-safe; `observe_many` costs one numpy pass per call."""

    def __init__(self, bounds: np.ndarray) -> None:
        self._bounds = bounds
        self._bound_list = bounds.tolist()
        self._counts = np.zeros(len(bounds) + 1, dtype=np.int64)  # last: above every bound (+Inf only)
        self._sum = 0.0
        self._exemplars: list[Exemplar | None] = [None] * len(self._counts)  # the latest per bucket
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        index = bisect_left(self._bound_list, value)  # `le` buckets, as searchsorted(side="left") below
        with self._lock:
            self._counts[index] += 1
            self._sum += value

    def observe_many(self, values: Sequence[float]) -> None:
        if not len(values):
            return
        array = np.asarray(values, dtype=float)
        # Prometheus buckets are `le`: a value equal to a bound belongs to that bound's bucket.
        counts = np.bincount(np.searchsorted(self._bounds, array, side="left"), minlength=len(self._counts))
        total = float(array.sum())
        with self._lock:
            self._counts += counts
            self._sum += total

    def set_exemplar(self, value: float, labels: dict[str, str]) -> None:
        """Make (`labels`, `value`) the exemplar of the bucket `value` falls in (OpenMetrics keeps one per
        bucket: the latest wins). The value itself is observed separately, through `observe_many`."""
        index = bisect_left(self._bound_list, value)
        with self._lock:
            self._exemplars[index] = Exemplar(labels, value, time.time())

    def snapshot(self) -> tuple[np.ndarray, float, list[Exemplar | None]]:
        with self._lock:
            return self._counts.copy(), self._sum, list(self._exemplars)


class BulkHistogram(Collector):
    """A histogram family fed many values at a time (per-token gaps), exposed through a custom collector.

    prometheus_client's Histogram costs one Python call per observed value; a decode span carries one value
    per output token, which made metering the largest cost of a span in the sidecar. This keeps per-bucket
    counts in numpy and renders the same exposition (`_bucket{le}`, `_count`, `_sum`); a bucket's exemplar
    is set apart from the counts (`BulkHistogramChild.set_exemplar`: one per span, not per value).
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        *,
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._bounds = np.asarray(sorted(buckets), dtype=float)
        # The `le` texts prometheus_client's own Histogram writes, so series match either way.
        self._le = [floatToGoString(bound) for bound in self._bounds]
        self._children: dict[tuple[str, ...], BulkHistogramChild] = {}
        self._lock = threading.Lock()
        registry.register(self)

    def labels(self, **labels: str) -> BulkHistogramChild:
        key = tuple(str(labels[name]) for name in self.labelnames)
        with self._lock:
            child = self._children.get(key)
            if child is None:
                child = self._children[key] = BulkHistogramChild(self._bounds)
            return child

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def describe(self) -> list[HistogramMetricFamily]:
        return [self._family()]

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = self._family()
        with self._lock:
            children = list(self._children.items())
        for key, child in children:
            counts, total, exemplars = child.snapshot()
            cumulative = np.cumsum(counts)
            les = [*self._le, "+Inf"]
            buckets: list[tuple[str, float] | tuple[str, float, Exemplar]] = [
                (le, float(c)) if e is None else (le, float(c), e) for le, c, e in zip(les, cumulative, exemplars)
            ]
            family.add_metric(list(key), buckets, total)
        yield family


def exemplar(trace_id: int) -> dict[str, str]:
    """OpenMetrics exemplar labels linking a latency sample to its trace."""
    return {"trace_id": format(trace_id, "032x")}


def deployment_namespace() -> str | None:
    """The deployment this process belongs to: `service.namespace` of OTEL_RESOURCE_ATTRIBUTES, or None.

    It becomes the `namespace` label of every series the process exports (architecture.md §4, §5), which is how alert
    rules and dashboards tell deployments sharing one Prometheus apart.
    """
    namespace = env_resource_attributes().get(RESOURCE_SERVICE_NAMESPACE)
    return str(namespace) if namespace else None


def process_labels(worker: str | None = None) -> dict[str, str]:
    """Labels every series of this process carries: `namespace` (when set) and `worker` (workers only)."""
    labels = {}
    namespace = deployment_namespace()
    if namespace:
        labels[NAMESPACE_LABEL] = namespace
    if worker:
        labels[WORKER_LABEL] = worker
    return labels


def serve_metrics(
    registry: CollectorRegistry, port: int, host: str = "127.0.0.1"
) -> tuple[WSGIServer, threading.Thread]:
    """Serve /metrics on a daemon thread; returns (server, thread). Port 0 picks a free port."""
    return start_http_server(port, addr=host, registry=registry)


# The advisor's families, a table like METRICS (built by AdviceMetrics into the advisor's own registry).
ADVICE_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "info",
        ADVICE_INFO,
        GAUGE,
        "1 for the held advice: verdict, target (ratio P:D, chunk budget tokens, or empty) and the deployed layout",
        ("namespace", "verdict", "target", "deployed"),
    ),
    MetricSpec(
        "differs",
        ADVICE_DIFFERS,
        GAUGE,
        "1 when the held advice asks for another layout than the one deployed",
        ("namespace",),
    ),
    MetricSpec(
        "gain",
        ADVICE_GAIN,
        GAUGE,
        "Last decided window: the winner's goodput over the option it had to beat, minus one",
        ("namespace",),
    ),
    MetricSpec(
        "confidence",
        ADVICE_CONFIDENCE,
        GAUGE,
        "Last decided window: share of bootstrap re-runs reaching its verdict (absent when skipped)",
        ("namespace",),
    ),
    MetricSpec(
        "window_requests",
        ADVICE_WINDOW_REQUESTS,
        GAUGE,
        "Requests that arrived in the last closed window",
        ("namespace",),
    ),
    MetricSpec(
        "decisions",
        ADVICE_DECISIONS_COUNTER,
        COUNTER,
        "Closed windows, by what each did to the held advice (reason)",
        ("namespace", "reason"),
    ),
)


class AdviceMetrics:
    """The advisor's families (architecture.md §5; one per row of `ADVICE_METRICS`), registered in
    `registry` (the advisor's own, one per process or per test). Every series carries `namespace`, the
    deployment advised on."""

    # One annotation per row of ADVICE_METRICS (a test holds the two equal).
    info: Gauge
    differs: Gauge
    gain: Gauge
    confidence: Gauge
    window_requests: Gauge
    decisions: Counter

    def __init__(self, registry: CollectorRegistry) -> None:
        for spec in ADVICE_METRICS:
            setattr(self, spec.attribute, build_family(spec, registry))
