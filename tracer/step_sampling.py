"""Which step spans to export: a stratified rule with a weight on every kept span.

A worker steps 30-100 times a second; exporting one span per step costs more than the rest of its traces
together. Two strata, decided by the pipeline thread (never the engine's hot loop), one sampler per worker:

- steps that carry prefill tokens (few, and what the interference and prefill fits need): every one is
  kept, up to `prefill_budget_per_window` per window; past the budget, 1 in `decode_sample_every`;
- decode-only steps (the many): 1 in `decode_sample_every`.

A kept span stands for `weight` steps of its stratum (1, or the N of its 1-in-N), written as
`splitscope.sample.weight`, so a reader that weighs each span by it estimates sums and means over every
step (a weighted least-squares fit on the kept spans estimates the fit on all). The selection is
systematic (every N-th step of the stratum): engines' step patterns have no period to alias with, and a
counter costs nothing. Metrics never go through this: every step feeds the step histograms.

Dependency-free; not thread-safe (one pipeline thread owns it).
"""

from __future__ import annotations

from dataclasses import dataclass

# Defaults sized for production (bench/trace_volume.py): 1 in 10 decode-only steps, and every prefill
# step up to 10 a second averaged over the window.
DEFAULT_DECODE_SAMPLE_EVERY = 10
DEFAULT_PREFILL_BUDGET_PER_WINDOW = 600
DEFAULT_WINDOW_NS = 60_000_000_000


@dataclass
class StepSampler:
    """`keep(start_ns, prefill_tokens)` -> the kept span's weight, or 0 when the step's span is not exported.

    `decode_sample_every` 1 keeps every step (weight 1). `start_ns` only needs to increase per worker."""

    decode_sample_every: int = DEFAULT_DECODE_SAMPLE_EVERY
    prefill_budget_per_window: int = DEFAULT_PREFILL_BUDGET_PER_WINDOW
    window_ns: int = DEFAULT_WINDOW_NS

    def __post_init__(self) -> None:
        if self.decode_sample_every < 1:
            raise ValueError(f"decode_sample_every must be >= 1, got {self.decode_sample_every}")
        if self.prefill_budget_per_window < 0:
            raise ValueError(f"prefill_budget_per_window must be >= 0, got {self.prefill_budget_per_window}")
        self._window_started_ns: int | None = None
        self._prefill_kept_in_window = 0
        self._decode_seen = 0
        self._prefill_over_budget_seen = 0

    def keep(self, start_ns: int, prefill_tokens: int) -> int:
        every = self.decode_sample_every
        if prefill_tokens > 0:
            if self._window_started_ns is None or start_ns - self._window_started_ns >= self.window_ns:
                self._window_started_ns = start_ns
                self._prefill_kept_in_window = 0
            if self._prefill_kept_in_window < self.prefill_budget_per_window:
                self._prefill_kept_in_window += 1
                return 1
            # Over budget: the step stratum's 1-in-N rule, so a prefill flood costs what decode steps do.
            self._prefill_over_budget_seen += 1
            return every if (self._prefill_over_budget_seen - 1) % every == 0 else 0
        self._decode_seen += 1
        return every if (self._decode_seen - 1) % every == 0 else 0
