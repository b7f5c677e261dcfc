"""Writes h200_qwen3_32b_vllm.json, the oracle's GPU-shaped step costs, from aiconfigurator's kernel tables.

Not run by the tests (they read the JSON); kept so the table can be made again or for another GPU, model or
engine. Needs aiconfigurator 0.12.0 (`pip install aiconfigurator==0.12.0`, Apache-2.0, NVIDIA) in its own
environment: `python tests/oracle/data/make_step_table.py > tests/oracle/data/h200_qwen3_32b_vllm.json`.

aiconfigurator prices one engine iteration as three passes (its `mixed_step` breakdown): the non-attention
ops (GEMMs, norms, embedding, sampling) over every token the iteration runs, the prefill's attention, and
the decodes' attention over their KV caches. The table keeps the three apart, so the oracle can price any
iteration its scheduler plans (tests/oracle/engine.py `GpuPhysics`).
"""

from __future__ import annotations

import json
import sys

from aiconfigurator.sdk import config
from aiconfigurator.sdk.models import get_model
from aiconfigurator.sdk.perf_database import get_database
from aiconfigurator.sdk.rust_engine_step import estimate_mixed_step_breakdown_with_rust as breakdown

SYSTEM, BACKEND, VERSION, MODEL = "h200_sxm", "vllm", "0.24.0", "Qwen/Qwen3-32B"
TOKENS = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192,
          12288, 16384)  # fmt: skip
BATCH = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)
KV_TOKENS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def main() -> None:
    database = get_database(SYSTEM, BACKEND, VERSION)
    model = get_model(MODEL, config.ModelConfig(tp_size=1), BACKEND)

    def parts(**step: int) -> dict[str, float]:
        return breakdown(model, database, osl=2, **step)["component_latency_ms"]

    table = {
        "provenance": f"aiconfigurator 0.12.0 (aiconfigurator-core 0.12.0, Apache-2.0), system {SYSTEM}, backend "
        f"{BACKEND} {VERSION}, model {MODEL} bf16, tensor parallel 1; mixed-step breakdown per pass; "
        "made by tests/oracle/data/make_step_table.py",
        "tokens": list(TOKENS),
        # non-attention ops of an iteration that runs this many tokens in all (prefill tokens + decodes)
        "linear_ms": [parts(ctx_tokens=t, gen_tokens=0, isl=t, prefix=0)["shared_non_attention"] for t in TOKENS],
        # attention of one whole prompt of this many tokens (no prefix)
        "prefill_attention_ms": [
            parts(ctx_tokens=t, gen_tokens=0, isl=t, prefix=0)["context_attention"] for t in TOKENS
        ],
        "batch": list(BATCH),
        "kv_tokens": list(KV_TOKENS),
        # attention of `batch` decodes, each over `kv_tokens` of KV cache: [batch][kv]
        "decode_attention_ms": [
            [parts(ctx_tokens=1, gen_tokens=b, isl=kv, prefix=0)["decode_attention"] for kv in KV_TOKENS] for b in BATCH
        ],
    }
    json.dump(table, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
