"""Engine /metrics (vLLM, Dynamo fixtures; hand-made SGLang and NIXL) served over real HTTP, mapped into ours."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.sidecar.conftest import FIXTURES, http_get
from tracer.sidecar.scrape import map_families


@pytest.fixture
def engine_server():
    """Serve files as /metrics on a free port: `url = serve(path, ...)`; each call appends its text."""
    texts: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            body = "".join(texts).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def serve(*paths: Path) -> str:
        for path in paths:
            texts.append(path.read_text() + "\n")
        return f"http://127.0.0.1:{server.server_address[1]}/metrics"

    yield serve
    server.shutdown()
    server.server_close()


def _families(text: str) -> dict:
    families = list(text_string_to_metric_families(text))
    names = [f.name for f in families]
    assert len(names) == len(set(names)), "a family appears twice in the exposition"
    return {f.name: f for f in families}


def _value(families: dict, family: str, sample: str, **labels) -> float:
    matches = [
        x.value
        for x in families[family].samples
        if x.name == sample and all(x.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(matches) == 1, (sample, labels, matches)
    return matches[0]


def test_vllm_fixture_maps_into_our_catalogue(make_sidecar, engine_server):
    url = engine_server(FIXTURES / "vllm-worker-metrics.txt", FIXTURES / "vllm-nixl-metrics.txt")
    sidecar = make_sidecar(
        grpc_port=None, pool="decode", worker="vllm-d0", mode="disaggregated", scrape=[("vllm", url)]
    )
    status, body = http_get(f"http://127.0.0.1:{sidecar.http_port}/metrics")
    f = _families(body.decode())
    assert status == 200
    assert _value(f, "splitscope_tokens", "splitscope_tokens_total", pool="decode", phase="prefill") == 66
    assert _value(f, "splitscope_tokens", "splitscope_tokens_total", pool="decode", phase="decode") == 600
    assert _value(f, "splitscope_requests_waiting", "splitscope_requests_waiting", worker="vllm-d0") == 2
    assert _value(f, "splitscope_requests_waiting", "splitscope_requests_waiting", worker="vllm-d0/1") == 5
    ttft = {"gen_ai_request_model": "Qwen/Qwen3-0.6B", "mode": "disaggregated"}
    assert (
        _value(
            f, "gen_ai_server_time_to_first_token_seconds", "gen_ai_server_time_to_first_token_seconds_count", **ttft
        )
        == 2
    )
    assert _value(
        f, "gen_ai_server_time_to_first_token_seconds", "gen_ai_server_time_to_first_token_seconds_sum", **ttft
    ) == pytest.approx(0.4143967628479004)
    # The engine's own bucket boundaries are kept (vLLM's TTFT buckets go to 2560 s; ours stop at 80 s).
    assert (
        _value(
            f,
            "gen_ai_server_time_to_first_token_seconds",
            "gen_ai_server_time_to_first_token_seconds_bucket",
            le="2560.0",
            **ttft,
        )
        == 2
    )
    assert (
        _value(
            f, "splitscope_inter_token_latency_seconds", "splitscope_inter_token_latency_seconds_count", pool="decode"
        )
        == 598
    )
    assert (
        _value(
            f,
            "splitscope_stage_duration_seconds",
            "splitscope_stage_duration_seconds_count",
            stage="queue",
            pool="decode",
        )
        == 2
    )
    # NIXL: two engine cores with equal buckets are summed into one series per stage / pool.
    assert (
        _value(
            f,
            "splitscope_stage_duration_seconds",
            "splitscope_stage_duration_seconds_count",
            stage="kv_transfer",
            pool="decode",
        )
        == 6
    )
    assert (
        _value(
            f,
            "splitscope_stage_duration_seconds",
            "splitscope_stage_duration_seconds_bucket",
            stage="kv_transfer",
            pool="decode",
            le="0.01",
        )
        == 4
    )
    assert (
        _value(
            f,
            "splitscope_kv_transfer_bytes",
            "splitscope_kv_transfer_bytes_total",
            src_pool="prefill",
            dst_pool="decode",
        )
        == 5e7
    )
    assert (
        _value(
            f, "splitscope_kv_transfer_failures", "splitscope_kv_transfer_failures_total", reason="nixl_transfer_failed"
        )
        == 3
    )
    # Our own families are still there, once: the pre-created drop counters of the catalogue.
    assert (
        _value(f, "splitscope_tracer_dropped_records", "splitscope_tracer_dropped_records_total", reason="ring_full")
        == 0
    )
    assert not any(name.startswith(("vllm:", "dynamo_", "lmcache:")) for name in f)


def test_dynamo_frontend_fixture_gives_ttft_itl_and_queueing(engine_server):
    text = (FIXTURES / "dynamo-frontend-metrics.txt").read_text()
    f = {m.name: m for m in map_families(text, "dynamo", pool="decode", worker="frontend", mode="disaggregated")}
    labels = {"gen_ai_request_model": "qwen/qwen3-0.6b", "mode": "disaggregated"}
    assert _value(
        f, "gen_ai_server_time_to_first_token_seconds", "gen_ai_server_time_to_first_token_seconds_sum", **labels
    ) == pytest.approx(1.5625701570000001)
    assert (
        _value(f, "gen_ai_server_request_duration_seconds", "gen_ai_server_request_duration_seconds_count", **labels)
        == 1
    )
    assert (
        _value(
            f, "splitscope_inter_token_latency_seconds", "splitscope_inter_token_latency_seconds_count", pool="decode"
        )
        == 299
    )
    assert (
        _value(f, "splitscope_requests_waiting", "splitscope_requests_waiting", pool="decode", worker="frontend") == 0
    )
    assert _value(f, "splitscope_tokens", "splitscope_tokens_total", phase="prefill") == 33
    assert _value(f, "splitscope_tokens", "splitscope_tokens_total", phase="decode") == 300


def test_sglang_hand_made_fixture_maps_stages(make_sidecar, engine_server):
    url = engine_server(FIXTURES / "sglang-metrics.txt")
    sidecar = make_sidecar(grpc_port=None, pool="prefill", worker="sgl-p0", scrape=[("sglang", url)])
    f = _families(http_get(f"http://127.0.0.1:{sidecar.http_port}/metrics")[1].decode())
    stage = "splitscope_stage_duration_seconds"
    assert _value(f, stage, stage + "_sum", stage="queue", pool="prefill") == pytest.approx(4.25)
    assert _value(f, stage, stage + "_sum", stage="prefill", pool="prefill") == pytest.approx(18.75)
    assert _value(f, stage, stage + "_count", stage="kv_transfer", pool="prefill") == 98
    assert not [x for x in f[stage].samples if x.labels.get("stage") == "tokenize"]  # no counterpart: left out
    assert _value(
        f, "splitscope_kv_cache_usage_ratio", "splitscope_kv_cache_usage_ratio", worker="sgl-p0"
    ) == pytest.approx(0.42)
    assert _value(f, "splitscope_requests_waiting", "splitscope_requests_waiting", worker="sgl-p0") == 7
    assert (
        _value(f, "splitscope_prefix_cache_hit_tokens", "splitscope_prefix_cache_hit_tokens_total", pool="prefill")
        == 21000
    )
    assert (
        _value(
            f,
            "splitscope_kv_transfer_failures",
            "splitscope_kv_transfer_failures_total",
            reason="sglang_transfer_failed",
        )
        == 2
    )


def test_an_unreachable_engine_leaves_our_metrics_served(make_sidecar, port):
    sidecar = make_sidecar(grpc_port=None, scrape=[("vllm", f"http://127.0.0.1:{port}/metrics")], scrape_timeout_s=0.5)
    status, body = http_get(f"http://127.0.0.1:{sidecar.http_port}/metrics")
    f = _families(body.decode())
    assert status == 200 and f["splitscope_tracer_dropped_records"].samples
    assert not f["splitscope_requests_waiting"].samples  # the catalogue's family, with no scraped series
    assert "cannot scrape" in sidecar.scrapers[0].last_error


def test_unknown_engine_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown engine 'tgi'"):
        map_families("", "tgi", pool="colocated", worker="w", mode="colocated")
