"""A pickle sent to any listener is refused (4xx, an error frame, or a closed connection) and never unpickled.

Listeners: the router (API and --metrics-port), each worker's internal API, the decode worker's KV
receiver, and the sidecar's OTLP/HTTP, OTLP/gRPC, /metrics and Unix-socket ingest. The pickle, if anything
ever unpickled it, would create a marker file; the test checks the file never appears, and that no module
on a receive path can unpickle at all (no pickle-family import, no torch.load / numpy.load).
"""

from __future__ import annotations

import ast
import json
import pickle
import re
import socket
import struct
import time
from pathlib import Path

import grpc
import pytest

from reference_server.kv_transfer.wire import MAGIC
from tests.conftest import REPO_ROOT
from tests.reference_server.server_harness import Server, http
from tests.security.listeners import descendants, listening
from tests.security.processes import ServedWorker, SidecarProcess
from tracer.sidecar import wire

READ_TIMEOUT_S = 15.0
PICKLE_CONTENT_TYPES = (
    "application/python-pickle",
    "application/octet-stream",
    "application/json",
    "application/x-protobuf",
)
UNPICKLING_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "shelve", "marshal", "copyreg"}
UNPICKLING_CALLS = {("torch", "load"), ("np", "load"), ("numpy", "load"), ("torch", "serialization")}


class _TouchOnUnpickle:
    """Unpickling this calls open(path, "w"): the marker file appears only if someone unpickled it."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "unpickled-by-a-listener"


def _pickle(marker: Path) -> bytes:
    return pickle.dumps(_TouchOnUnpickle(marker))


def _send_and_read_all(host: str, port: int, payload: bytes) -> bytes:
    """Send `payload`, half-close, and read until the peer closes. Fails the test if it never closes."""
    chunks = []
    deadline = time.monotonic() + READ_TIMEOUT_S
    with socket.create_connection((host, port), timeout=READ_TIMEOUT_S) as sock:
        try:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            return b""  # refused before it read it all: closed
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                return b"".join(chunks)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    raise AssertionError(f"{host}:{port} kept the connection open after a pickle")


def _refused(answer: bytes) -> str:
    """How a listener refused the pickle; raises if the answer looks like acceptance."""
    if answer.startswith(b"HTTP/1."):
        status = int(answer.split(b" ", 2)[1])
        assert 400 <= status < 500, answer[:200]
        return f"HTTP {status}"
    if answer.startswith(MAGIC):
        (length,) = struct.unpack("!I", answer[4:8])
        frame = json.loads(answer[8 : 8 + length])
        assert frame["type"] == "error" and frame["reason"] == "bad_header", frame
        return "KV error frame"
    return "connection closed"  # gRPC: not an HTTP/2 preface


def test_raw_pickle_on_every_tcp_listener_is_refused(server: Server, sidecar: SidecarProcess, marker: Path) -> None:
    listeners = listening(descendants(server.process.pid)) + listening(descendants(sidecar.process.pid))
    assert len(listeners) >= 8, listeners  # router x2, two worker APIs, KV receiver, sidecar x3
    how = {}
    for listener in listeners:
        how[listener.port] = _refused(_send_and_read_all(listener.host, listener.port, _pickle(marker)))
    # HTTP servers close on a request line that never ends (or answer 400); the KV receiver says why.
    assert "KV error frame" in how.values(), how
    assert not marker.exists()
    assert server.health()["status"] == "ok" and sidecar.healthy()


def test_pickle_bodies_on_every_http_route_are_refused(
    server: Server, workers: dict[str, ServedWorker], sidecar: SidecarProcess, marker: Path
) -> None:
    prefill, decode = workers["prefill"].url, workers["decode"].url
    routes = [
        server.url + "/v1/completions",
        server.url + "/health",
        server.url + "/metrics",
        f"http://127.0.0.1:{server.metrics_port}/metrics",
        prefill + "/prefill",
        prefill + "/health",
        prefill + "/metrics",
        decode + "/generate",
        decode + "/health",
        decode + "/metrics",
        sidecar.url + "/v1/traces",
        sidecar.url + "/metrics",
        f"http://127.0.0.1:{sidecar.metrics_port}/metrics",
    ]
    statuses = {}
    for url in routes:
        for content_type in PICKLE_CONTENT_TYPES:
            status, body, _ = http("POST", url, raw=_pickle(marker), headers={"Content-Type": content_type})
            statuses[(url, content_type)] = status
            assert 400 <= status < 500, (url, content_type, status, body[:200])
    # The routes that take a body refuse it as malformed, not merely as the wrong method.
    assert statuses[(server.url + "/v1/completions", "application/json")] == 400
    assert statuses[(prefill + "/prefill", "application/json")] == 400
    assert statuses[(decode + "/generate", "application/json")] == 400
    assert statuses[(sidecar.url + "/v1/traces", "application/x-protobuf")] == 400
    assert statuses[(sidecar.url + "/v1/traces", "application/python-pickle")] == 415
    assert not marker.exists()
    status, _, _ = server.complete({"prompt": "still serving", "max_tokens": 2})
    assert status == 200


def test_pickle_as_a_grpc_message_is_refused(sidecar: SidecarProcess, marker: Path) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}") as channel:
        export = channel.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export")  # raw bytes
        with pytest.raises(grpc.RpcError) as refused:
            export(_pickle(marker), timeout=10)
    assert refused.value.code() != grpc.StatusCode.OK
    assert not marker.exists() and sidecar.healthy()


def _dropped_bad_frames(sidecar: SidecarProcess) -> float:
    _, body, _ = http("GET", f"http://127.0.0.1:{sidecar.metrics_port}/metrics")
    found = re.search(rb'splitscope_tracer_dropped_records_total\{reason="sidecar_bad_frame"\} (\S+)', body)
    return float(found[1]) if found else 0.0


def test_pickle_on_the_unix_ingest_is_refused(sidecar: SidecarProcess, marker: Path) -> None:
    before = _dropped_bad_frames(sidecar)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:  # as the handshake
        sock.settimeout(READ_TIMEOUT_S)
        sock.connect(str(sidecar.socket_path))
        sock.sendall(_pickle(marker) + b"\n")
        answer = sock.makefile("rb").readline()
        assert wire.decode_answer(answer) is not None, answer
        assert sock.recv(1) == b""  # and closed
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:  # as a frame after a good handshake
        sock.settimeout(READ_TIMEOUT_S)
        sock.connect(str(sidecar.socket_path))
        sock.sendall(wire.encode_handshake("", {"service.name": "pickler"}))
        reader = sock.makefile("rb")
        assert wire.decode_answer(reader.readline()) is None
        payload = _pickle(marker)
        sock.sendall(wire.FRAME_HEADER.pack(len(payload)) + payload)
        assert reader.read(1) == b""  # the sidecar closed the connection
    assert _dropped_bad_frames(sidecar) == before + 1
    assert not marker.exists() and sidecar.healthy()


def _unpickling_uses(source: str) -> list[str]:
    """Imports of pickle-family modules and torch.load / numpy.load uses in one module's source."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in UNPICKLING_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNPICKLING_MODULES:
            found.append(node.module or "")
        elif (
            isinstance(node, ast.ImportFrom)
            and any(a.name in ("load", "Unpickler") for a in node.names)
            and (node.module or "").split(".")[0] in ("torch", "numpy")
        ):
            found.append(f"from {node.module} import load")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if (node.value.id, node.attr) in UNPICKLING_CALLS:
                found.append(f"{node.value.id}.{node.attr}")
        elif isinstance(node, ast.Name) and node.id == "Unpickler":
            found.append("Unpickler")
    return found


def test_no_receive_path_can_unpickle() -> None:
    """No module of the server, the sidecar or the toolkit imports a pickle-family module or calls
    torch.load / numpy.load; the check itself catches a planted use."""
    sources = sorted((REPO_ROOT / "reference_server").rglob("*.py")) + sorted((REPO_ROOT / "tracer").rglob("*.py"))
    assert len(sources) > 40
    uses = [f"{path.relative_to(REPO_ROOT)}: {use}" for path in sources for use in _unpickling_uses(path.read_text())]
    assert uses == []


def test_the_unpickling_check_finds_planted_uses() -> None:
    planted = (
        "import pickle\nfrom dill import loads\nimport torch\nx = torch.load('f')\nimport numpy as np\nnp.load('f')\n"
    )
    assert sorted(_unpickling_uses(planted)) == sorted(["pickle", "dill", "torch.load", "np.load"])
