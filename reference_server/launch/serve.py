"""`splitscope serve`: start the worker processes, run the router, stop everything on Ctrl-C / SIGTERM.

The launcher (this process) starts one `python -m reference_server.serving.worker` per worker, each binding
free ports and announcing them on its stdout (`SPLITSCOPE_WORKER_READY {json}`), then runs the router
(aiohttp) on `--port` in its own event loop. Layouts: `colocated` / `chunked` with `--workers N`, or
`disaggregated` with `--prefill-workers P --decode-workers D`.

No orphans: SIGTERM or SIGINT stops the router, then SIGTERMs every worker and waits (SIGKILL after a
grace period). If the launcher itself is SIGKILLed, each worker gets SIGTERM from the kernel
(`process_guard.die_with_parent`). A worker that exits while serving leaves the rotation; the rest
keep serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click

from reference_server.launch.engine_options import EngineOptions, worker_argv
from reference_server.launch.metrics_exporter import Exporter, start_exporter, stop_exporter
from reference_server.launch.process_guard import forward_output, terminate
from reference_server.launch.ready_line import parse_ready_line
from tracer.step_sampling import DEFAULT_DECODE_SAMPLE_EVERY
from tracer.vocabulary import RESOURCE_SERVICE_NAMESPACE, ROLES_OF_MODE, Mode, Role

log = logging.getLogger("reference_server.launch.serve")

STOP_GRACE_S = 10.0


@dataclass(frozen=True)
class ServeConfig(EngineOptions):
    """`splitscope serve`'s settings: the layout and the router's, plus the engine settings every worker
    gets (`EngineOptions`, keyword-only; `token_budget` is the `--chunk-budget` flag)."""

    mode: str = Mode.COLOCATED
    workers: int = 1
    prefill_workers: int = 1
    decode_workers: int = 1
    preset: str = "small"
    host: str = "127.0.0.1"
    port: int = 8000
    metrics_port: int | None = None
    exporter_port: int | None = None  # run the metrics exporter (metrics_exporter.py) with /metrics here
    slo_ttft: float | None = None  # seconds; the router marks root spans that miss it
    slo_itl: float | None = None  # seconds, on each request's p99 inter-token gap
    startup_timeout_s: float = 300.0

    def roles(self) -> list[tuple[Role, str]]:
        """(role, name) of every worker, in start order; a worker is named after its role."""
        counts = {Role.PREFILL: self.prefill_workers, Role.DECODE: self.decode_workers}
        return [
            (role, f"{role}-{i}")
            for role in ROLES_OF_MODE[Mode(self.mode)]
            for i in range(counts.get(role, self.workers))
        ]

    def validate(self) -> None:
        """Raise ValueError with one line naming the flag at fault."""
        from reference_server.kv_cache import check_block_size
        from reference_server.model import PRESETS

        if self.mode not in tuple(Mode):
            raise ValueError(f"--mode must be colocated, chunked or disaggregated (got {self.mode!r})")
        if self.preset not in PRESETS:
            raise ValueError(f"--preset must be one of {', '.join(PRESETS)} (got {self.preset!r})")
        for flag, value in (
            ("--workers", self.workers),
            ("--prefill-workers", self.prefill_workers),
            ("--decode-workers", self.decode_workers),
            ("--max-batch", self.max_batch),
            ("--kv-streams", self.kv_streams),
            ("--step-sample", self.step_sample),
        ):
            if value < 1:
                raise ValueError(f"{flag} must be at least 1 (got {value})")
        if self.exporter_port is not None and self.sidecar_socket:
            raise ValueError("--exporter-port runs its own sidecar for the server; drop --sidecar-socket")
        if self.token_budget <= self.max_batch:
            raise ValueError(f"--chunk-budget ({self.token_budget}) must exceed --max-batch ({self.max_batch})")
        if not 0 <= self.kv_wait_s <= 60:
            raise ValueError(f"--kv-wait-s must be in [0, 60] seconds, got {self.kv_wait_s}")
        if self.kv_blocks < 0:
            raise ValueError(f"--kv-blocks must be >= 0 (0 = automatic), got {self.kv_blocks}")
        try:
            check_block_size(self.block_size)
        except ValueError as exc:
            raise ValueError(f"--block-size: {exc}") from None
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"--device must be cpu or cuda (got {self.device!r})")
        if self.device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise ValueError("--device cuda was asked for, but torch sees no CUDA device")


DEFAULTS = ServeConfig()  # the CLI's defaults are the dataclass's


@dataclass
class WorkerProcess:
    role: str
    name: str
    process: asyncio.subprocess.Process
    ready: dict | None = None


def worker_command(config: ServeConfig, role: str, name: str, threads: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "reference_server.serving.worker",
        "--role",
        role,
        "--name",
        name,
        "--parent-pid",
        str(os.getpid()),
        "--preset",
        config.preset,
        "--threads",
        str(threads),
        *worker_argv(config),
    ]


async def _await_ready(worker: WorkerProcess) -> dict:
    stdout = worker.process.stdout
    assert stdout is not None
    while True:
        line = await stdout.readline()
        if not line:
            code = await worker.process.wait()
            raise RuntimeError(
                f"worker {worker.name} exited with status {code} before it was ready (see its log above)"
            )
        text = line.decode(errors="replace")
        announcement = parse_ready_line(text)
        if announcement is not None:
            return announcement
        sys.stderr.write(f"[{worker.name}] {text}")


async def start_workers(config: ServeConfig) -> list[WorkerProcess]:
    """Start every worker and wait until each announced its ports. On failure, stop them all and raise."""
    roles = config.roles()
    threads = max(1, (os.cpu_count() or 1) // len(roles))
    workers: list[WorkerProcess] = []
    try:
        for role, name in roles:
            process = await asyncio.create_subprocess_exec(
                *worker_command(config, role, name, threads),
                stdout=asyncio.subprocess.PIPE,
                stdin=asyncio.subprocess.DEVNULL,
            )
            workers.append(WorkerProcess(role, name, process))
        readies = await asyncio.wait_for(asyncio.gather(*(_await_ready(w) for w in workers)), config.startup_timeout_s)
    except BaseException as exc:
        await stop_workers(workers)
        if isinstance(exc, asyncio.TimeoutError):
            raise RuntimeError(f"workers were not ready within {config.startup_timeout_s:g} s") from None
        raise
    for worker, ready in zip(workers, readies):
        worker.ready = ready
        assert worker.process.stdout is not None
        asyncio.create_task(forward_output(worker.process.stdout, worker.name))  # after its ready line
    return workers


async def stop_workers(workers: list[WorkerProcess], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM every live worker, wait up to `grace_s`, SIGKILL the rest, and reap them all."""
    await asyncio.gather(*(terminate(w.process, grace_s, f"worker {w.name}") for w in workers))


async def serve(
    config: ServeConfig, on_ready: Callable[[str], None] | None = None, stop: asyncio.Event | None = None
) -> None:
    """Run the server until SIGTERM/SIGINT (or `stop` is set). `on_ready(url)` once it serves."""
    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    exporter = None
    if config.exporter_port is not None:  # first: every process below ships to it
        exporter = await start_exporter(
            config.host, config.exporter_port, config.traces_file, config.mode, config.startup_timeout_s
        )
        config = dataclasses.replace(config, sidecar_socket=exporter.socket_path)
    try:
        await _serve(config, on_ready, stop, exporter)
    finally:
        if exporter is not None:  # last: the router and workers flushed into it
            await stop_exporter(exporter, STOP_GRACE_S)


async def _serve(
    config: ServeConfig, on_ready: Callable[[str], None] | None, stop: asyncio.Event, exporter: Exporter | None
) -> None:
    from aiohttp import web
    from prometheus_client import CollectorRegistry

    from reference_server.serving.router import Endpoint, Router
    from tracer import start_tracing
    from tracer.export.gpu import GpuSampler
    from tracer.slo_outcome import RequestSlo

    tracing = start_tracing(
        None,
        None,
        traces_file=config.traces_file,
        sidecar_socket=config.sidecar_socket,
        registry=CollectorRegistry(),  # the router serves /metrics on either path
        slo=RequestSlo(config.slo_ttft, config.slo_itl),
    )
    gpu = GpuSampler(tracing.catalogue).start() if tracing.catalogue is not None else None
    click.echo(
        f"starting {len(config.roles())} {config.mode} worker(s) ({config.preset}, {config.device})...", err=True
    )
    workers = await start_workers(config)
    stopping = False
    runners: list[web.AppRunner] = []
    router: Router | None = None
    watchers: list[asyncio.Task] = []
    try:
        ready = [w.ready for w in workers if w.ready]
        router = Router(
            mode=config.mode,
            model=config.preset,
            max_context_tokens=min(r["max_context_tokens"] for r in ready),
            endpoints=[Endpoint.from_ready(r) for r in ready],
            tracing=tracing,
        )
        await router.start()

        async def watch(worker: WorkerProcess) -> None:
            code = await worker.process.wait()
            if not stopping:
                log.error("worker %s exited with status %s; serving on without it", worker.name, code)
                assert router is not None
                router.mark_dead(worker.name)

        watchers = [asyncio.create_task(watch(w)) for w in workers]
        sites = [(router.app(), config.port)]
        if config.metrics_port is not None:
            sites.append((router.metrics_app(), config.metrics_port))
        bound_ports = []
        for app, port in sites:
            runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0)
            await runner.setup()
            runners.append(runner)
            # Our own socket, so port 0 works (the OS picks) and we can say which port it picked.
            sock = socket.create_server(
                (config.host, port), family=socket.AF_INET6 if ":" in config.host else socket.AF_INET
            )
            await web.SockSite(runner, sock, shutdown_timeout=2.0).start()
            bound_ports.append(sock.getsockname()[1])
        url = f"http://{_url_host(config.host)}:{bound_ports[0]}"
        metrics = f", metrics on :{bound_ports[1]}" if len(bound_ports) > 1 else ""
        metrics += f", exporter /metrics on :{exporter.port}" if exporter is not None else ""
        click.echo(f"serving {config.preset} ({config.mode}: {', '.join(w.name for w in workers)}) on {url}{metrics}")
        if on_ready is not None:
            on_ready(url)
        await stop.wait()
    finally:
        stopping = True
        click.echo("stopping...", err=True)
        for runner in runners:
            await runner.cleanup()
        if router is not None:
            await router.close()
        await stop_workers(workers)
        for task in watchers:
            task.cancel()
        if gpu is not None:
            gpu.stop()
        await asyncio.to_thread(tracing.shutdown, 5.0)


def with_namespace(resource_attributes: str, namespace: str) -> str:
    """OTEL_RESOURCE_ATTRIBUTES with `service.namespace` set to `namespace` (a later key wins)."""
    return ",".join(filter(None, (resource_attributes.strip(), f"{RESOURCE_SERVICE_NAMESPACE}={namespace}")))


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


@click.command("serve")
@click.option(
    "--mode",
    type=click.Choice([mode.value for mode in Mode]),
    default=Mode.COLOCATED.value,
    show_default=True,
    help="colocated (whole prefills join decode steps), chunked (token budget per step), "
    "or disaggregated (separate prefill and decode pools, KV moved over TCP)",
)
@click.option("--workers", type=int, default=None, help="workers in a colocated/chunked layout [1]")
@click.option("--prefill-workers", type=int, default=None, help="prefill workers (disaggregated) [1]")
@click.option("--decode-workers", type=int, default=None, help="decode workers (disaggregated) [1]")
@click.option("--preset", default=DEFAULTS.preset, show_default=True, help="model shape preset (tiny, small, ...)")
@click.option("--host", default=DEFAULTS.host, show_default=True, help="address the router binds")
@click.option(
    "--port",
    type=int,
    default=DEFAULTS.port,
    show_default=True,
    help="router port (/v1/completions, /health, /metrics); 0 picks a free one (printed)",
)
@click.option("--traces-file", type=click.Path(dir_okay=False), default=None, help="append OTLP/JSON spans here")
@click.option(
    "--metrics-port",
    type=int,
    default=None,
    help="also serve the router's joined /metrics on this port (the fallback path: prefer --exporter-port)",
)
@click.option(
    "--exporter-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="run a metrics exporter (a sidecar at the lowest CPU priority) that every process ships to, serving "
    "the whole server's /metrics on this port: the path to scrape (deploy/prometheus.yml does), instead of the "
    "router's join, and a scrape costs the serving processes nothing (0 picks a free port, printed)",
)
@click.option(
    "--chunk-budget",
    "token_budget",
    type=int,
    default=DEFAULTS.token_budget,
    show_default=True,
    help="tokens per step in chunked mode",
)
@click.option("--block-size", type=int, default=DEFAULTS.block_size, show_default=True, help="KV block size in tokens")
@click.option(
    "--kv-streams",
    type=int,
    default=DEFAULTS.kv_streams,
    show_default=True,
    help="parallel TCP streams per KV transfer",
)
@click.option(
    "--step-sample",
    type=click.IntRange(min=1),
    default=DEFAULT_DECODE_SAMPLE_EVERY,
    show_default=True,
    help="export 1 in N decode-only step spans (weighted); steps with prefill tokens are all kept up to a budget",
)
@click.option(
    "--slo-ttft",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="time-to-first-token objective (s): root spans get splitscope.slo.violated/.missed",
)
@click.option(
    "--slo-itl",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="inter-token objective on each request's p99 gap (s)",
)
@click.option("--device", default=DEFAULTS.device, show_default=True, help="cpu or cuda")
@click.option("--sidecar-socket", default=None, help="ship spans to a splitscope sidecar on this Unix socket")
@click.option("--seed", type=int, default=DEFAULTS.seed, show_default=True, help="model weight seed")
@click.option("--max-batch", type=int, default=DEFAULTS.max_batch, show_default=True, help="sequences per engine step")
@click.option(
    "--kv-blocks", type=int, default=DEFAULTS.kv_blocks, show_default=True, help="KV blocks per worker (0: automatic)"
)
@click.option(
    "--kv-wait-s",
    type=float,
    default=DEFAULTS.kv_wait_s,
    show_default=True,
    help="how long a decode worker waits for KV room before refusing a transfer (the client gets 503)",
)
@click.option(
    "--namespace",
    default=None,
    help="the deployment's name: the `namespace` label of every series and `service.namespace` of every "
    "span (default: service.namespace of OTEL_RESOURCE_ATTRIBUTES, else none)",
)
def serve_command(
    mode: str, workers: int | None, prefill_workers: int | None, decode_workers: int | None, **options: Any
) -> None:
    """Run the reference server: router plus worker processes, until Ctrl-C or SIGTERM."""
    namespace = options.pop("namespace")
    if namespace is not None:
        if not namespace.strip() or any(c in namespace for c in ",=\n"):
            raise click.UsageError(f"--namespace must be a non-empty name without ',' or '=' (got {namespace!r})")
        # The workers inherit the environment: router, workers and their spans all name the deployment.
        os.environ["OTEL_RESOURCE_ATTRIBUTES"] = with_namespace(
            os.environ.get("OTEL_RESOURCE_ATTRIBUTES", ""), namespace
        )
    if mode == Mode.DISAGGREGATED and workers is not None:
        raise click.UsageError("--workers is for colocated/chunked; use --prefill-workers and --decode-workers")
    if mode != Mode.DISAGGREGATED and (prefill_workers is not None or decode_workers is not None):
        raise click.UsageError("--prefill-workers/--decode-workers need --mode disaggregated")
    config = ServeConfig(
        mode=mode,
        workers=1 if workers is None else workers,
        prefill_workers=1 if prefill_workers is None else prefill_workers,
        decode_workers=1 if decode_workers is None else decode_workers,
        **options,
    )
    try:
        config.validate()
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="%(asctime)s launcher %(levelname)s %(name)s: %(message)s"
    )
    # The router's event loop forwards every token; a thread beside it (a /metrics render or join, the
    # tracing pipeline) holds the GIL for up to the switch interval each time the loop wants it back.
    # 1 ms instead of the default 5 ms bounds that wait, as in the workers.
    sys.setswitchinterval(0.001)
    try:
        asyncio.run(serve(config))
    except RuntimeError as exc:
        raise click.ClickException(str(exc)) from None
    except OSError as exc:  # e.g. the port is taken
        raise click.ClickException(f"cannot serve: {exc}") from None
