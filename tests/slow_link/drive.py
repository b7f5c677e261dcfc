"""Run a 1 prefill + 1 decode deployment across a rate-limited veth link and drive prompts through it.

Started by the slow-link test inside the prefill namespace (`ip netns exec P python -m
tests.slow_link.drive PLAN.json`), as root. The prefill worker and the router live in this namespace;
the decode worker runs in the other one (`ip netns exec D`), bound to its veth address, so every KV
byte crosses the link; the router reaches it over the link too. Every process shares the
SPLITSCOPE_KV_TOKEN the plan gives (the decode worker binds beyond loopback, which requires it).

Plan (JSON): {"link": {"left": Side, "right": Side}, "preset", "traces_file", "out", "token",
"max_tokens", "phases": [{"label", "rate_bits_per_s", "prompt_tokens": [int, ...]}]}. For each phase it
sets the rate, sends its prompts one after another (so transfers never share the link), and writes to
`out`: {"phases": [{"label", "rate_bits_per_s", "start_wall_ns", "end_wall_ns", "request_ids"}]}.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import string
import sys
import time
from typing import Any

import aiohttp
from aiohttp import web

from reference_server.kv_transfer import TOKEN_ENV_VAR
from reference_server.launch.ready_line import parse_ready_line
from reference_server.launch.serve import (
    ServeConfig,
    WorkerProcess,
    stop_workers,
    worker_command,
)
from reference_server.serving.router import Endpoint, Router
from tests.slow_link.netns import Side, VethLink
from tracer import start_tracing

STARTUP_TIMEOUT_S = 180.0
REQUEST_TIMEOUT_S = 120.0
# Before the first phase: one short request whose transfer opens the sender's connections to the decode
# worker (one per stream), a one-time cost that belongs to no phase. (max_tokens 2: a request that ends
# at its first token never moves its KV.)
WARM_UP_PROMPT_TOKENS = 256


def prompt_of(tokens: int, seed: int) -> str:
    """Distinct text of `tokens` byte-level tokens (no shared prefix: the prefix cache never hits)."""
    rng = random.Random(seed)
    return "".join(rng.choice(string.ascii_lowercase + " ") for _ in range(tokens))


async def _start_worker(argv: list[str], role: str, name: str) -> WorkerProcess:
    process = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL
    )
    return WorkerProcess(role, name, process)


async def _ready(worker: WorkerProcess) -> dict[str, Any]:
    """The worker's READY line; its other output goes to our stderr, and keeps draining afterwards."""
    stdout = worker.process.stdout
    assert stdout is not None
    while line := await stdout.readline():
        text = line.decode(errors="replace")
        announcement = parse_ready_line(text)
        if announcement is not None:
            asyncio.create_task(_drain(stdout, worker.name))
            return announcement
        sys.stderr.write(f"[{worker.name}] {text}")
    raise RuntimeError(f"worker {worker.name} exited with {await worker.process.wait()} before it was ready")


async def _drain(stream: asyncio.StreamReader, name: str) -> None:
    while line := await stream.readline():
        sys.stderr.write(f"[{name}] {line.decode(errors='replace')}")


async def _complete(client: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> str:
    """POST one completion; its id (the root span's splitscope.request.id). Raises unless 200."""
    async with client.post(url, json=body) as response:
        answer = await response.json()
        if response.status != 200:
            raise RuntimeError(f"request failed with {response.status}: {answer}")
    return answer["id"]


async def run(plan: dict[str, Any]) -> dict[str, Any]:
    os.environ[TOKEN_ENV_VAR] = plan["token"]  # inherited by both workers; read by the router
    link = VethLink(Side(**plan["link"]["left"]), Side(**plan["link"]["right"]))
    config = ServeConfig(mode="disaggregated", preset=plan["preset"], traces_file=plan["traces_file"])
    threads = max(1, (os.cpu_count() or 1) // 2)
    decode_argv = worker_command(config, "decode", "decode-0", threads) + ["--host", link.right.address]
    workers = [
        await _start_worker(worker_command(config, "prefill", "prefill-0", threads), "prefill", "prefill-0"),
        await _start_worker(link.command(link.right, decode_argv), "decode", "decode-0"),
    ]
    tracing = start_tracing(None, None, traces_file=plan["traces_file"])
    router: Router | None = None
    runner: web.AppRunner | None = None
    try:
        readies = await asyncio.wait_for(asyncio.gather(*(_ready(w) for w in workers)), STARTUP_TIMEOUT_S)
        router = Router(
            mode="disaggregated",
            model=plan["preset"],
            endpoints=[Endpoint.from_ready(r) for r in readies],
            max_context_tokens=min(r["max_context_tokens"] for r in readies),
            tracing=tracing,
        )
        await router.start()
        runner = web.AppRunner(router.app(), access_log=None)
        await runner.setup()
        sock = socket.create_server(("127.0.0.1", 0))
        await web.SockSite(runner, sock).start()
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/completions"
        phases = []
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as client:
            await _complete(
                client, url, {"model": plan["preset"], "prompt": prompt_of(WARM_UP_PROMPT_TOKENS, -1), "max_tokens": 2}
            )
            for phase_index, phase in enumerate(plan["phases"]):
                link.set_rate(phase["rate_bits_per_s"])
                start_wall_ns = time.time_ns()
                request_ids = []
                for i, tokens in enumerate(phase["prompt_tokens"]):
                    body = {
                        "model": plan["preset"],
                        "prompt": prompt_of(tokens, 1000 * phase_index + i),
                        "max_tokens": plan["max_tokens"],
                        "ignore_eos": True,
                    }
                    request_ids.append(await _complete(client, url, body))
                phases.append(
                    {
                        "label": phase["label"],
                        "rate_bits_per_s": phase["rate_bits_per_s"],
                        "start_wall_ns": start_wall_ns,
                        "end_wall_ns": time.time_ns(),
                        "request_ids": request_ids,
                    }
                )
        return {"phases": phases}
    finally:
        if runner is not None:
            await runner.cleanup()
        if router is not None:
            await router.close()
        await stop_workers(workers)  # they flush their spans before they exit
        await asyncio.to_thread(tracing.shutdown, 5.0)


def main() -> None:
    with open(sys.argv[1]) as file:
        plan = json.load(file)
    result = asyncio.run(run(plan))
    with open(plan["out"], "w") as file:
        json.dump(result, file)


if __name__ == "__main__":
    main()
