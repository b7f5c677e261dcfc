"""The engine settings the launcher (`splitscope serve`) hands every worker: one definition, one default each.

`launch.ServeConfig` and `worker.WorkerOptions` both extend `EngineOptions`; the launcher passes a
worker these fields as `--flag value` (`worker_argv`), and the worker's parser makes one flag per field.
Imports nothing heavy: the launcher reads it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True, kw_only=True)
class EngineOptions:
    device: str = "cpu"
    block_size: int = 16  # KV block size in tokens
    kv_blocks: int = 0  # KV blocks per worker; 0: enough for max_batch full-length sequences (capped at 1 GiB)
    max_batch: int = 16  # sequences per engine step
    token_budget: int = 512  # tokens per step in chunked mode (`splitscope serve --chunk-budget`)
    kv_streams: int = 4  # parallel TCP streams per KV transfer
    seed: int = 0  # model weight seed
    traces_file: str | None = None
    step_sample: int = 1  # export 1 in N decode-only step spans
    sidecar_socket: str | None = None
    kv_wait_s: float = 5.0  # decode: how long a KV transfer waits for room before it is refused


def flag_of(field_name: str) -> str:
    """The command-line flag of an options field: `kv_wait_s` -> `--kv-wait-s`."""
    return "--" + field_name.replace("_", "-")


def worker_argv(options: EngineOptions) -> list[str]:
    """`options`' engine settings as worker flags, every one that is set (None or "" keeps the default)."""
    argv: list[str] = []
    for field in fields(EngineOptions):
        value = getattr(options, field.name)
        if value not in (None, ""):
            argv += [flag_of(field.name), str(value)]
    return argv
