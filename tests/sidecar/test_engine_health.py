"""Scrape health (`splitscope_engine_scrape_up`, duration, a log line on failure and on recovery), the model
label of vLLM request metrics, and no span-fed gauge that would read as measured."""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.sidecar.conftest import FIXTURES, http_get, spans_when
from tests.sidecar.test_vllm import _send_vllm_span
from tracer import spans as s
from tracer.engines import vllm
from tracer.metrics import ENGINE_SCRAPE_DURATION, ENGINE_SCRAPE_UP


@pytest.fixture
def switchable_engine():
    """An engine /metrics endpoint serving the captured vLLM fixture; `state["up"] = False` makes it 503."""
    body = (FIXTURES / "vllm-worker-metrics.txt").read_bytes()
    state = {"up": True}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(200 if state["up"] else 503)
            self.send_header("Content-Length", str(len(body) if state["up"] else 0))
            self.end_headers()
            if state["up"]:
                self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics", state
    server.shutdown()
    server.server_close()


def _exposed(sidecar) -> dict:
    _, body = http_get(f"http://127.0.0.1:{sidecar.http_port}/metrics")
    return {f.name: f for f in text_string_to_metric_families(body.decode())}


def _up(families: dict) -> float:
    (sample,) = families[ENGINE_SCRAPE_UP].samples
    assert sample.labels == {"engine": "vllm"}
    return sample.value


def test_scrape_health_goes_down_and_recovers_with_one_log_line_each(make_sidecar, switchable_engine, caplog):
    url, state = switchable_engine
    sidecar = make_sidecar(grpc_port=None, scrape=[("vllm", url)])
    caplog.set_level(logging.WARNING, logger="tracer.sidecar.scrape")
    up = _exposed(sidecar)
    assert _up(up) == 1 and up["splitscope_requests_waiting"].samples
    (duration,) = up[ENGINE_SCRAPE_DURATION].samples
    assert 0 < duration.value < 2.0 and duration.labels == {"engine": "vllm"}

    state["up"] = False
    for _ in range(2):  # a second failed scrape logs nothing new
        down = _exposed(sidecar)
        assert _up(down) == 0
        assert not down["splitscope_requests_waiting"].samples and not down["splitscope_tokens"].samples
    failures = [r.getMessage() for r in caplog.records if "cannot scrape" in r.getMessage()]
    assert len(failures) == 1 and "503" in failures[0]

    state["up"] = True
    assert _up(_exposed(sidecar)) == 1
    assert [r.getMessage() for r in caplog.records if "recovered" in r.getMessage()] == [
        f"splitscope sidecar: vllm scrape of {url} recovered"
    ]


def test_no_engine_scrape_no_health_series_and_no_gauges_at_zero(make_sidecar, tmp_path):
    # vLLM spans alone: the stage histograms come from them, but queue depth and KV cache use are unknown.
    sidecar = make_sidecar(http_port=0, grpc_port=0)
    _send_vllm_span(f"127.0.0.1:{sidecar.grpc_port}")
    spans_when(tmp_path / "traces.jsonl", 4)
    families = _exposed(sidecar)
    assert families["splitscope_stage_duration_seconds"].samples
    for gauge in ("splitscope_requests_waiting", "splitscope_requests_running", "splitscope_kv_cache_usage_ratio"):
        assert not families[gauge].samples, gauge
    assert ENGINE_SCRAPE_UP not in families


def _request(attributes: dict) -> s.SpanData:
    return s.SpanData(vllm.SPAN_NAME, s.KIND_SERVER, 7, 8, 0, 1_000, 2_000, {vllm.ATTR_E2E: 1e-6, **attributes})


def test_model_label_order_span_then_flag_then_resource(caplog):
    resource = {s.ATTR_MODEL: "from-resource"}
    names = vllm.ModelNames(configured="from-flag")
    assert names.for_span(_request({vllm.ATTR_RESPONSE_MODEL: "from-span"}), resource) == "from-span"
    assert names.for_span(_request({}), resource) == "from-flag"
    assert vllm.ModelNames().for_span(_request({}), resource) == "from-resource"

    caplog.set_level(logging.WARNING, logger="tracer.engines.vllm")
    unknown = vllm.ModelNames()
    assert unknown.for_span(_request({}), {}) == unknown.for_span(_request({}), {}) == vllm.MODEL_UNKNOWN
    assert len([r for r in caplog.records if "name no model" in r.getMessage()]) == 1


def test_sidecar_model_flag_labels_request_metrics(make_sidecar, tmp_path):
    sidecar = make_sidecar(http_port=None, model="tiny-llama")
    endpoint = f"127.0.0.1:{sidecar.grpc_port}"
    _send_vllm_span(endpoint)  # this one names its model itself
    _send_vllm_span(endpoint, model=None)
    spans_when(tmp_path / "traces.jsonl", 8)
    count = "gen_ai_server_time_to_first_token_seconds_count"
    assert (
        sidecar.registry.get_sample_value(count, {"gen_ai_request_model": "Qwen/Qwen3-0.6B", "mode": "colocated"}) == 1
    )
    assert sidecar.registry.get_sample_value(count, {"gen_ai_request_model": "tiny-llama", "mode": "colocated"}) == 1
