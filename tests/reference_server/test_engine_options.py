"""reference_server.launch.engine_options: what `splitscope serve` is given reaches every worker, field for field,
through the worker's own command-line parser (the one the worker process runs)."""

from __future__ import annotations

from dataclasses import fields

from reference_server.launch.engine_options import EngineOptions
from reference_server.launch.serve import DEFAULTS, ServeConfig, serve_command, worker_command
from reference_server.serving.worker import WorkerOptions, parse_args
from tracer.step_sampling import DEFAULT_DECODE_SAMPLE_EVERY

# A value for every engine setting, each unlike its default, so a setting the launcher forgot to pass
# would come back as the worker's default and fail the comparison.
NON_DEFAULT = {
    "device": "cuda:1",
    "block_size": 32,
    "kv_blocks": 99,
    "max_batch": 7,
    "token_budget": 300,
    "kv_streams": 3,
    "seed": 5,
    "traces_file": "/tmp/spans.jsonl",
    "step_sample": 9,
    "sidecar_socket": "/tmp/sidecar.sock",
    "kv_wait_s": 2.5,
}


def _engine_fields(options: EngineOptions) -> dict[str, object]:
    return {field.name: getattr(options, field.name) for field in fields(EngineOptions)}


def test_every_engine_setting_has_a_value_unlike_its_default_here():
    assert set(NON_DEFAULT) == {field.name for field in fields(EngineOptions)}
    assert all(NON_DEFAULT[name] != value for name, value in _engine_fields(EngineOptions()).items())


def test_a_worker_parses_back_every_engine_setting_the_launcher_passes():
    config = ServeConfig(mode="chunked", preset="tiny", **NON_DEFAULT)
    command = worker_command(config, "chunked", "chunked-0", threads=2)
    options, parent_pid = parse_args(command[command.index("--role") :])
    assert _engine_fields(options) == NON_DEFAULT
    assert (options.role, options.name, options.preset, options.threads) == ("chunked", "chunked-0", "tiny", 2)
    assert parent_pid > 0


def test_unset_paths_are_left_to_the_worker_default():
    command = worker_command(ServeConfig(), "colocated", "colocated-0", threads=1)
    assert "--traces-file" not in command and "--sidecar-socket" not in command
    options, _ = parse_args(command[command.index("--role") :])
    assert _engine_fields(options) == _engine_fields(WorkerOptions(role="colocated", name="w"))


def test_serve_flags_default_to_the_dataclass():
    """The CLI's defaults are ServeConfig's, but for step sampling (the command samples decode-only steps
    for production, DEFAULT_DECODE_SAMPLE_EVERY; a ServeConfig built in code keeps every step) and the
    worker counts (None there tells "not given" apart, to reject a count the mode does not use)."""
    params = serve_command.make_context("serve", []).params
    own = {"step_sample", "workers", "prefill_workers", "decode_workers"}
    shared = {name: value for name, value in params.items() if hasattr(DEFAULTS, name) and name not in own}
    assert {"token_budget", "kv_wait_s", "preset", "block_size", "port"} <= set(shared)
    assert shared == {name: getattr(DEFAULTS, name) for name in shared}
    assert params["step_sample"] == DEFAULT_DECODE_SAMPLE_EVERY and DEFAULTS.step_sample == 1
