"""What a load run is asked to do: `LoadConfig` and its parts, validated in one place.

Pure data: no I/O, no clocks. `LoadConfig.validate()` raises `ConfigError` (a `ValueError`) with one
readable sentence naming the flag at fault, so the CLI can print it as a usage error.
"""

from __future__ import annotations

import enum
import math
import secrets
from dataclasses import asdict, dataclass, field, replace
from urllib.parse import urlsplit

# A schedule is held in memory (one small record per request); refuse runs that would not fit sensibly.
MAX_SCHEDULED_REQUESTS = 1_000_000

COMPLETIONS_PATH = "/v1/completions"


class ConfigError(ValueError):
    """A load configuration that cannot run; the message names the flag and the fix."""


class ReplayFormat(enum.StrEnum):
    """How `--replay` reads its file (the readers: tracer.load.replay_formats); AUTO tells from the first line."""

    AUTO = "auto"
    SPLITSCOPE = "splitscope"
    AZURE = "azure"
    MOONCAKE = "mooncake"


@dataclass(frozen=True)
class LengthSpec:
    """A token-length distribution: fixed (`sigma == 0`) or lognormal around `median_tokens`.

    Lognormal draws are rounded to whole tokens and clamped to [1, `max_tokens`]; `max_tokens`
    defaults to 10x the median so a long tail cannot produce absurd requests.
    """

    median_tokens: int
    sigma: float = 0.0
    max_tokens: int | None = None

    @property
    def cap_tokens(self) -> int:
        return self.max_tokens if self.max_tokens is not None else 10 * self.median_tokens

    def validate(self, flag: str) -> None:
        if self.median_tokens < 1:
            raise ConfigError(f"--{flag}-tokens must be at least 1 (got {self.median_tokens})")
        if not math.isfinite(self.sigma) or self.sigma < 0:
            raise ConfigError(f"--{flag}-sigma must be a finite number >= 0 (got {self.sigma})")
        if self.max_tokens is not None and self.max_tokens < self.median_tokens:
            raise ConfigError(
                f"--{flag}-max-tokens ({self.max_tokens}) is below --{flag}-tokens ({self.median_tokens})"
            )


@dataclass(frozen=True)
class BurstSpec:
    """Every `every_s` seconds (first at t = every_s), `count` extra requests of `prompt_tokens` each."""

    every_s: float
    count: int
    prompt_tokens: int

    @classmethod
    def parse(cls, text: str) -> BurstSpec:
        """Parse "EVERY_S:COUNT:TOKENS", e.g. "10:4:8192"; raises ConfigError on anything else."""
        parts = text.split(":")
        if len(parts) != 3:
            raise ConfigError(f"--burst wants EVERY_S:COUNT:TOKENS, e.g. 10:4:8192 (got {text!r})")
        try:
            spec = cls(every_s=float(parts[0]), count=int(parts[1]), prompt_tokens=int(parts[2]))
        except ValueError:
            raise ConfigError(f"--burst wants numbers in EVERY_S:COUNT:TOKENS (got {text!r})") from None
        spec.validate()
        return spec

    def validate(self) -> None:
        if not math.isfinite(self.every_s) or self.every_s <= 0:
            raise ConfigError(f"--burst period must be > 0 seconds (got {self.every_s})")
        if self.count < 1 or self.prompt_tokens < 1:
            raise ConfigError("--burst COUNT and TOKENS must be at least 1")


@dataclass(frozen=True)
class ClientSLO:
    """Latency objectives in seconds; None means "not judged".

    `itl_s` applies to each request's p99 inter-token gap (the default ITL statistic of architecture.md §7).
    """

    ttft_s: float | None = None
    itl_s: float | None = None
    tpot_s: float | None = None

    def validate(self) -> None:
        for name, value in (("ttft", self.ttft_s), ("itl", self.itl_s), ("tpot", self.tpot_s)):
            if value is not None and (not math.isfinite(value) or value <= 0):
                raise ConfigError(f"--slo-{name} must be > 0 seconds (got {value})")


@dataclass(frozen=True)
class LoadConfig:
    """One load run. Arrivals come from `replay_path`, or from Poisson (`rate_rps`) plus optional bursts.

    Bounds: `duration_s` (arrivals in [0, duration_s)) and/or `requests` (the first N arrivals); a
    generated workload needs at least one, a replay file bounds itself and either flag truncates it.
    `chars_per_token` sizes synthetic prompts: 1.0 for byte-level tokenizers (the reference server),
    about 4 for BPE tokenizers of real models. `seed` None picks a random seed, recorded in the results.
    `text_seed` (default: `seed`) seeds the prompt text alone: the same `seed` with another `text_seed`
    replays the same arrivals and lengths with text no prefix cache has seen (A/B runs on one server).
    `replay_format` says how to read `replay_path`; `time_scale` multiplies its arrivals (0.5 = twice as fast).
    """

    url: str
    model: str
    rate_rps: float | None = None
    duration_s: float | None = None
    requests: int | None = None
    prompt: LengthSpec = field(default_factory=lambda: LengthSpec(256))
    output: LengthSpec = field(default_factory=lambda: LengthSpec(128))
    burst: BurstSpec | None = None
    sessions: int = 0
    shared_prefix_tokens: int = 0
    replay_path: str | None = None
    replay_format: ReplayFormat = ReplayFormat.AUTO
    time_scale: float = 1.0
    slo: ClientSLO = field(default_factory=ClientSLO)
    seed: int | None = None
    text_seed: int | None = None
    timeout_s: float = 120.0
    max_inflight: int = 512
    chars_per_token: float = 1.0

    def with_seed(self) -> LoadConfig:
        """This config with a concrete seed (a fresh random one if none was given)."""
        if self.seed is not None:
            return self
        return replace(self, seed=secrets.randbits(32))

    @property
    def endpoint(self) -> str:
        """The completions URL: `url` itself if it already ends in /v1/completions, else url + that path."""
        base = self.url.rstrip("/")
        return base if base.endswith(COMPLETIONS_PATH) else base + COMPLETIONS_PATH

    def validate(self) -> None:
        """Raise ConfigError on the first problem found; returns None when the config can run."""
        self._validate_target()
        self._validate_arrivals()
        self.prompt.validate("prompt")
        self.output.validate("output")
        if self.burst is not None:
            self.burst.validate()
        self._validate_sessions()
        self.slo.validate()
        self._validate_client()

    def _validate_target(self) -> None:
        """The server's URL and the model name."""
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"--url must be an http(s) URL such as http://127.0.0.1:8000 (got {self.url!r})")
        if not self.model:
            raise ConfigError("--model must not be empty")

    def _validate_arrivals(self) -> None:
        """When requests arrive and what bounds the run: a replay file, or a rate/burst with a duration/count."""
        if self.replay_path is not None:
            if self.rate_rps is not None or self.burst is not None or self.sessions:
                raise ConfigError(
                    "--replay takes arrivals, lengths and sessions from the file; drop --rate, --burst and --sessions"
                )
            if not math.isfinite(self.time_scale) or self.time_scale <= 0:
                raise ConfigError(f"--time-scale must be a number > 0 (got {self.time_scale})")
        elif self.replay_format is not ReplayFormat.AUTO or self.time_scale != 1.0:
            raise ConfigError("--replay-format and --time-scale apply to a --replay file; give --replay FILE")
        else:
            if self.rate_rps is None and self.burst is None:
                raise ConfigError("give --rate (Poisson arrivals per second), --burst or --replay")
            if self.duration_s is None and self.requests is None:
                raise ConfigError("give --duration or --requests to bound the run")
        if self.rate_rps is not None and (math.isnan(self.rate_rps) or self.rate_rps < 0):
            raise ConfigError(f"--rate must be >= 0 requests per second (got {self.rate_rps})")
        if self.rate_rps == math.inf and self.requests is None:
            raise ConfigError("--rate inf sends everything at once; bound it with --requests")
        if self.rate_rps == 0 and self.burst is None:
            raise ConfigError("--rate 0 sends nothing; give a positive rate or a --burst")
        if self.duration_s is not None and (not math.isfinite(self.duration_s) or self.duration_s <= 0):
            raise ConfigError(f"--duration must be > 0 seconds (got {self.duration_s})")
        if self.requests is not None and self.requests < 1:
            raise ConfigError(f"--requests must be at least 1 (got {self.requests})")
        if self.requests is not None and self.requests > MAX_SCHEDULED_REQUESTS:
            raise ConfigError(f"--requests above {MAX_SCHEDULED_REQUESTS} is not supported")

    def _validate_sessions(self) -> None:
        """Multi-turn sessions and the prefix shared within one."""
        if self.sessions < 0:
            raise ConfigError(f"--sessions must be >= 0 (got {self.sessions})")
        if self.shared_prefix_tokens < 0:
            raise ConfigError(f"--shared-prefix-tokens must be >= 0 (got {self.shared_prefix_tokens})")
        if self.shared_prefix_tokens and not self.sessions and self.replay_path is None:
            raise ConfigError("--shared-prefix-tokens needs --sessions N (the prefix is shared within a session)")

    def _validate_client(self) -> None:
        """The client's own limits: per-request timeout, concurrency, the chars-per-token tokenizer."""
        if not math.isfinite(self.timeout_s) or self.timeout_s <= 0:
            raise ConfigError(f"--timeout must be > 0 seconds (got {self.timeout_s})")
        if self.max_inflight < 1:
            raise ConfigError(f"--max-inflight must be at least 1 (got {self.max_inflight})")
        if not math.isfinite(self.chars_per_token) or self.chars_per_token <= 0:
            raise ConfigError(f"--tokenizer chars-per-token must be > 0 (got {self.chars_per_token})")

    def to_json_dict(self) -> dict:
        doc = asdict(self)
        doc["endpoint"] = self.endpoint
        if self.rate_rps == math.inf:
            doc["rate_rps"] = "inf"  # JSON has no infinity
        return doc
