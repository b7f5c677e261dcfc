"""The server's metrics exporter: a `splitscope sidecar` at the lowest CPU priority beside router and workers.

With `splitscope serve --exporter-port PORT`, every process of the server (router and workers) ships its spans
and snapshots of its own gauges and counters over a Unix socket to this one sidecar, which serves the whole
server's /metrics on PORT (each worker's series with its `worker` label: tracer/sidecar/worker_series.py) and
exports the spans (`--traces-file`, OTEL_*). Why a process of its own, at nice 19: a scrape then renders
nothing inside a serving process (no GIL taken from an engine thread, no join on the router's loop), and the
CPU it does take yields to serving on a busy machine (bench/RESULTS.md, "Scraping /metrics").

The launcher starts it before anything else, reads its listening line from stderr (which gives the port
when PORT is 0) and forwards the rest of its output; `stop` SIGTERMs it last, after the router and workers
flushed into it. If it dies while the server runs, the launcher logs one error and serving goes on: the
processes buffer their spans for it and count what they drop
(`splitscope_tracer_dropped_records_total{reason="sidecar_unreachable"}` on the router's own /metrics). Run as `python -m reference_server.launch.metrics_exporter LAUNCHER_PID SIDECAR_ARGS...`, the
child lowers its own priority and dies with the launcher before it becomes the sidecar.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import sys
import tempfile
from dataclasses import dataclass

from reference_server.launch.process_guard import die_with_parent, forward_output, terminate

log = logging.getLogger(__name__)

EXPORTER_NICE = 19  # the lowest CPU priority: a scrape's CPU yields to serving
_LISTENING = "splitscope sidecar listening:"
_METRICS_PORT = re.compile(r"metrics \S+:(\d+)")


@dataclass
class Exporter:
    process: asyncio.subprocess.Process
    socket_path: str  # what the router and workers ship to (`--sidecar-socket`)
    port: int  # its /metrics
    directory: tempfile.TemporaryDirectory  # holds the socket; removed by `stop`
    stopping: bool = False


def exporter_command(socket_path: str, host: str, port: int, traces_file: str | None, mode: str) -> list[str]:
    """The child's command line: this module, then `splitscope sidecar` flags (Unix socket in, /metrics out)."""
    sidecar = ["--socket", socket_path, "--no-http", "--no-grpc", "--no-gpu", "--mode", mode]
    sidecar += ["--host", host, "--metrics-port", str(port), *(["--traces-file", traces_file] if traces_file else [])]
    return [sys.executable, "-m", "reference_server.launch.metrics_exporter", str(os.getpid()), *sidecar]


async def start_exporter(host: str, port: int, traces_file: str | None, mode: str, timeout_s: float) -> Exporter:
    """Start the exporter and wait until it listens. Raises RuntimeError (with its last output) if it exits
    or does not listen within `timeout_s`; nothing is left running then."""
    directory = tempfile.TemporaryDirectory(prefix="splitscope-exporter-")
    socket_path = os.path.join(directory.name, "sidecar.sock")
    process = await asyncio.create_subprocess_exec(
        *exporter_command(socket_path, host, port, traces_file, mode),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stderr is not None
    output: list[str] = []
    try:
        bound = await asyncio.wait_for(_listening_port(process.stderr, output), timeout_s)
    except (asyncio.TimeoutError, EOFError):
        await terminate(process, 5.0, "the metrics exporter")
        directory.cleanup()
        raise RuntimeError("the metrics exporter did not start: " + " | ".join(output[-5:])) from None
    exporter = Exporter(process, socket_path, bound, directory)
    asyncio.create_task(_forward(process.stderr, exporter))
    return exporter


async def _listening_port(stderr: asyncio.StreamReader, output: list[str]) -> int:
    while True:
        line = (await stderr.readline()).decode(errors="replace")
        if not line:
            raise EOFError
        output.append(line.rstrip())
        print(f"[exporter] {line}", end="", file=sys.stderr)
        if line.startswith(_LISTENING):
            match = _METRICS_PORT.search(line)
            if match is None:
                raise EOFError
            return int(match.group(1))


async def _forward(stderr: asyncio.StreamReader, exporter: Exporter) -> None:
    """Forward its output until it closes; then, unless the launcher is stopping it, say that it died."""
    await forward_output(stderr, "exporter")
    code = await exporter.process.wait()
    if not exporter.stopping:
        log.error("the metrics exporter exited with status %s; serving on, metrics and spans no longer exported", code)


async def stop_exporter(exporter: Exporter, grace_s: float) -> None:
    """SIGTERM (the sidecar flushes what it holds), SIGKILL after `grace_s`, then remove the socket's folder."""
    exporter.stopping = True
    await terminate(exporter.process, grace_s, "the metrics exporter")
    exporter.directory.cleanup()


def main(argv: list[str]) -> None:
    """The child: lowest priority, die with the launcher (argv[0]), then run `splitscope sidecar argv[1:]`."""
    from tracer.sidecar.main import sidecar_command

    os.nice(EXPORTER_NICE)
    die_with_parent(int(argv[0]))
    sidecar_command.main(argv[1:], prog_name="splitscope sidecar")


if __name__ == "__main__":
    main(sys.argv[1:])
