"""`splitscope load`: drive an OpenAI-compatible /v1/completions server with an open-loop workload."""

from __future__ import annotations

import asyncio
import re
import signal
from pathlib import Path

import click
from rich.console import Console
from rich.live import Live

from tracer.cli.options import Duration
from tracer.load.config import BurstSpec, ClientSLO, ConfigError, LengthSpec, LoadConfig, ReplayFormat
from tracer.load.display import LiveView, summary_tables
from tracer.load.results import LoadResult
from tracer.load.runner import RunProgress, run_load


class Tokenizer(click.ParamType):
    """`bytes` (1 token = 1 ASCII character) or `chars-per-token=X`; converts to characters per token."""

    name = "tokenizer"

    def get_metavar(self, param, ctx=None):  # untyped: click 8.1 and 8.2 signatures differ
        return "bytes|chars-per-token=X"

    def convert(self, value, param, ctx):  # untyped: click's signature
        if isinstance(value, float):
            return value
        text = str(value).strip()
        if text == "bytes":
            return 1.0
        match = re.fullmatch(r"chars-per-token=([0-9]*\.?[0-9]+)", text)
        if not match or float(match.group(1)) <= 0:
            self.fail(f"{value!r}: use 'bytes' or 'chars-per-token=X' with X > 0 (e.g. 4)", param, ctx)
        return float(match.group(1))


class BurstParam(click.ParamType):
    name = "EVERY_S:COUNT:TOKENS"

    def convert(self, value, param, ctx):  # untyped: click's signature
        if isinstance(value, BurstSpec):
            return value
        try:
            return BurstSpec.parse(str(value))
        except ConfigError as exc:
            self.fail(str(exc), param, ctx)


SECONDS = Duration(positive=False)  # zero passes here; the load config says which options need more


@click.command("load")
@click.option("--url", required=True, help="Server base URL (http://host:port) or its /v1/completions URL.")
@click.option("--model", required=True, help="Model name sent in each request.")
@click.option("--rate", "rate_rps", type=float, help="Poisson arrivals per second ('inf': all at once).")
@click.option("--duration", "duration_s", type=SECONDS, help="Send arrivals for this long (e.g. 60, 5m).")
@click.option("--requests", type=int, help="Send this many requests (the first N arrivals).")
@click.option(
    "--prompt-tokens", type=int, default=256, show_default=True, help="Prompt length (median if --prompt-sigma)."
)
@click.option(
    "--prompt-sigma", type=float, default=0.0, show_default=True, help="Lognormal sigma of prompt length; 0 = fixed."
)
@click.option("--prompt-max-tokens", type=int, help="Cap on lognormal prompt length [default: 10x median].")
@click.option(
    "--output-tokens", type=int, default=128, show_default=True, help="Output length (median if --output-sigma)."
)
@click.option(
    "--output-sigma", type=float, default=0.0, show_default=True, help="Lognormal sigma of output length; 0 = fixed."
)
@click.option("--output-max-tokens", type=int, help="Cap on lognormal output length [default: 10x median].")
@click.option("--burst", type=BurstParam(), help="Extra long prompts: every EVERY_S seconds, COUNT prompts of TOKENS.")
@click.option(
    "--sessions",
    type=int,
    default=0,
    show_default=True,
    help="Spread requests over N sessions (sent as the OpenAI 'user' field).",
)
@click.option(
    "--shared-prefix-tokens",
    type=int,
    default=0,
    show_default=True,
    help="Prompts of one session start with the same prefix of this many tokens.",
)
@click.option(
    "--replay",
    "replay_path",
    type=click.Path(dir_okay=False),
    help="Replay a file: splitscope JSONL of {arrival_s, prompt_tokens, output_tokens[, session]} per line, "
    "an Azure LLM inference trace CSV, or a Mooncake trace JSONL (see --replay-format).",
)
@click.option(
    "--replay-format",
    type=click.Choice([fmt.value for fmt in ReplayFormat]),
    default=ReplayFormat.AUTO.value,
    show_default=True,
    help="How to read --replay: auto (told from the first line), splitscope, azure "
    "(TIMESTAMP,ContextTokens,GeneratedTokens), mooncake (timestamp ms, input_length, output_length, hash_ids).",
)
@click.option(
    "--time-scale",
    type=float,
    default=1.0,
    show_default=True,
    help="Multiply --replay arrival times by this (> 0; 0.5 replays twice as fast).",
)
@click.option("--slo-ttft", type=SECONDS, help="Time-to-first-token objective (e.g. 500ms).")
@click.option("--slo-itl", type=SECONDS, help="Objective on each request's p99 inter-token gap (e.g. 50ms).")
@click.option("--slo-tpot", type=SECONDS, help="Time-per-output-token objective.")
@click.option(
    "--seed", type=int, help="Seed of arrivals, lengths, sessions and prompt text [default: random, recorded]."
)
@click.option(
    "--text-seed",
    type=int,
    help="Seed of the prompt text alone [default: --seed]: the same arrivals and lengths with text no prefix "
    "cache has seen.",
)
@click.option("--timeout", "timeout_s", type=SECONDS, default=120.0, show_default=True, help="Per-request deadline.")
@click.option(
    "--max-inflight",
    type=int,
    default=512,
    show_default=True,
    help="Safety cap on requests in flight; a due request beyond it is not sent, and counted.",
)
@click.option(
    "--tokenizer",
    "chars_per_token",
    type=Tokenizer(),
    default="bytes",
    show_default=True,
    help="How prompt text is sized: 'bytes' for byte-level tokenizers (the reference server), "
    "'chars-per-token=4' for typical BPE tokenizers of real models.",
)
@click.option("--out", "out_path", type=click.Path(dir_okay=False), help="Write every request's measurements as JSON.")
@click.option(
    "--progress/--no-progress", "show_progress", default=True, show_default=True, help="Live progress on stderr."
)
def load_command(
    url: str,
    model: str,
    rate_rps: float | None,
    duration_s: float | None,
    requests: int | None,
    prompt_tokens: int,
    prompt_sigma: float,
    prompt_max_tokens: int | None,
    output_tokens: int,
    output_sigma: float,
    output_max_tokens: int | None,
    burst: BurstSpec | None,
    sessions: int,
    shared_prefix_tokens: int,
    replay_path: str | None,
    replay_format: str,
    time_scale: float,
    slo_ttft: float | None,
    slo_itl: float | None,
    slo_tpot: float | None,
    seed: int | None,
    text_seed: int | None,
    timeout_s: float,
    max_inflight: int,
    chars_per_token: float,
    out_path: str | None,
    show_progress: bool,
) -> None:
    """Send streamed completions on an open-loop schedule and measure TTFT, inter-token gaps, TPOT and
    end-to-end latency on the client; report percentiles, SLO attainment and goodput.

    Arrivals never wait on responses. Each request carries a W3C `traceparent`; its trace id is in the
    --out results so it can be found in the server's traces.
    """
    config = LoadConfig(
        url=url,
        model=model,
        rate_rps=rate_rps,
        duration_s=duration_s,
        requests=requests,
        prompt=LengthSpec(prompt_tokens, prompt_sigma, prompt_max_tokens),
        output=LengthSpec(output_tokens, output_sigma, output_max_tokens),
        burst=burst,
        sessions=sessions,
        shared_prefix_tokens=shared_prefix_tokens,
        replay_path=replay_path,
        replay_format=ReplayFormat(replay_format),
        time_scale=time_scale,
        slo=ClientSLO(ttft_s=slo_ttft, itl_s=slo_itl, tpot_s=slo_tpot),
        seed=seed,
        text_seed=text_seed,
        timeout_s=timeout_s,
        max_inflight=max_inflight,
        chars_per_token=chars_per_token,
    ).with_seed()
    try:
        config.validate()
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    if out_path is not None and not Path(out_path).resolve().parent.is_dir():
        raise click.UsageError(f"--out: folder {Path(out_path).parent} does not exist")

    progress = RunProgress()
    err_console = Console(stderr=True)
    try:
        if show_progress:
            with Live(LiveView(progress), console=err_console, refresh_per_second=4, transient=True):
                result = asyncio.run(_run_until_interrupted(config, progress))
        else:
            result = asyncio.run(_run_until_interrupted(config, progress))
    except ConfigError as exc:  # a bad replay file is found when the schedule is built
        raise click.ClickException(str(exc)) from None

    Console().print(summary_tables(result.summary))
    if out_path is not None:
        result.write_json(out_path)
        err_console.print(f"wrote {len(result.records)} request records to {out_path} (seed {config.seed})")
    summary = result.summary
    if result.stopped_early:
        err_console.print(f"interrupted: {summary.scheduled} of {progress.scheduled} scheduled requests were due")
        click.get_current_context().exit(130)  # the shell's code for "stopped by Ctrl-C", after the results
    if summary.sent and not summary.ok:
        first = next(r for r in result.records if r.error_detail)
        raise click.ClickException(
            f"all {summary.sent} requests failed; first: {first.error_kind}: {first.error_detail}"
        )


async def _run_until_interrupted(config: LoadConfig, progress: RunProgress) -> LoadResult:
    """`run_load`, where a first Ctrl-C stops the schedule and keeps the results; a second one aborts."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_first_interrupt() -> None:
        stop.set()
        loop.remove_signal_handler(signal.SIGINT)  # back to KeyboardInterrupt for a second Ctrl-C

    try:
        loop.add_signal_handler(signal.SIGINT, on_first_interrupt)
    except (NotImplementedError, RuntimeError):  # no signal handlers here (Windows, or not the main thread)
        pass
    return await run_load(config, progress=progress, stop=stop)
