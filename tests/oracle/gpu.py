"""GPU-shaped iteration costs for the oracle: an H200 serving Qwen3-32B with vLLM, priced from aiconfigurator's
measured kernel tables (tests/oracle/data/h200_qwen3_32b_vllm.json, its provenance inside; made by
make_step_table.py there), not from any fit of the report's.

An iteration costs what aiconfigurator's mixed-step estimate adds up, pass by pass:
- the non-attention ops (GEMMs, norms, embedding, sampling) over every token it runs (one per running decode
  plus the prefill tokens): flat while the weights' read dominates (about 17-20 ms up to 128 tokens on this
  GPU), then rising with the tokens once the GEMMs are compute-bound: the knee a linear fit on small
  batches cannot see;
- the decodes' attention over their KV caches: `batch` requests at their mean context, from the table's
  batch x KV grid (memory-bound, about linear in the KV tokens read);
- the prefill's attention: a floor per iteration that runs any (the kernels' launch across 64 layers), plus
  the attention of the prompt tokens it runs, priced by token pairs: a whole prompt of n tokens attends
  n^2 pairs (x2 in the engine's count), so the table's n maps to n^2 and a chunk at an offset to the pairs
  it adds; several prompts in one iteration are priced by their pairs together.
Every table is interpolated linearly between its points (and along its last segment past its end).
Pure; numpy only.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from tests.oracle.engine import Physics

TABLE_PATH = Path(__file__).with_name("data") / "h200_qwen3_32b_vllm.json"
# The served model's config.json, what its operator passes the report (data/qwen3_32b_config.md).
QWEN3_32B_CONFIG = Path(__file__).with_name("data") / "qwen3_32b_config.json"
# Qwen3-32B's KV cache in bf16: 64 layers x 8 KV heads x 128 dims x (K and V) x 2 bytes.
QWEN3_32B_KV_BYTES_PER_TOKEN = 64 * 8 * 128 * 2 * 2


@dataclass(frozen=True)
class StepTable:
    tokens: tuple[float, ...]
    linear_s: tuple[float, ...]
    prefill_attention_s: tuple[float, ...]
    batch: tuple[float, ...]
    kv_tokens: tuple[float, ...]
    decode_attention_s: tuple[tuple[float, ...], ...]  # [batch][kv_tokens]
    provenance: str

    @cached_property
    def pairs(self) -> tuple[float, ...]:
        """The engine's attention count of a whole prompt of each table size: n^2."""
        return tuple(n * n for n in self.tokens)

    @cached_property
    def prefill_attention_over_floor_s(self) -> tuple[float, ...]:
        return tuple(a - self.prefill_attention_s[0] for a in self.prefill_attention_s)

    @classmethod
    def load(cls, path: Path = TABLE_PATH) -> StepTable:
        raw = json.loads(path.read_text(encoding="utf-8"))
        ms = 1e-3
        return cls(
            tuple(float(t) for t in raw["tokens"]),
            tuple(v * ms for v in raw["linear_ms"]),
            tuple(v * ms for v in raw["prefill_attention_ms"]),
            tuple(float(b) for b in raw["batch"]),
            tuple(float(k) for k in raw["kv_tokens"]),
            tuple(tuple(v * ms for v in row) for row in raw["decode_attention_ms"]),
            raw["provenance"],
        )


def _segment(x: float, xs: tuple[float, ...]) -> tuple[int, float]:
    """The segment of `xs` that prices `x` (the first or last one outside them) and where x lies along it."""
    i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
    return i, (x - xs[i]) / (xs[i + 1] - xs[i])


def _interp(x: float, xs: tuple[float, ...], ys: tuple[float, ...]) -> float:
    """Linear between the points, and along the first / last segment outside them (never below zero)."""
    i, along = _segment(x, xs)
    return max(0.0, ys[i] + (ys[i + 1] - ys[i]) * along)


@dataclass(frozen=True)
class GpuPhysics(Physics):
    """Physics whose iteration time comes from the kernel table (the link fields as in Physics)."""

    table: StepTable = StepTable.load()
    kv_bytes_per_token: float = float(QWEN3_32B_KV_BYTES_PER_TOKEN)
    timing_source: str = "cuda"

    def iteration_s(
        self, now_s: float, running: int, context_tokens: int, prefill_tokens: int, attention_tokens2: int
    ) -> float:
        t = self.table
        seconds = _interp(running + prefill_tokens, t.tokens, t.linear_s)
        if running:  # bilinear in (batch, KV tokens): the two batch rows around it, each at the mean KV
            i, along = _segment(running, t.batch)
            rows = t.decode_attention_s
            low, high = (
                _interp(context_tokens / running, t.kv_tokens, rows[i]),
                _interp(context_tokens / running, t.kv_tokens, rows[i + 1]),
            )
            seconds += max(0.0, low + (high - low) * along)
        if prefill_tokens:
            floor = t.prefill_attention_s[0]
            seconds += floor + _interp(attention_tokens2, t.pairs, t.prefill_attention_over_floor_s)
        if self.throttle_period_s > 0 and int(now_s // self.throttle_period_s) % 2 == 1:
            seconds *= self.throttle_factor
        return seconds
