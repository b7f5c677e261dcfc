"""What a model's Hugging Face `config.json` says about the bytes and arithmetic of one engine step.

The step fit (`fit.fit_passes`) prices what small traced batches cannot show from two ratios the model fixes,
whatever the GPU and however the model is sharded (tensor parallelism divides both sides alike):
- a context token's KV read over the weights' read: a step's floor is reading the weights and a decode's
  attention is reading its KV cache, both at the memory's bandwidth, so once the fit knows the floor it knows
  the KV read (Qwen3-32B: 256 KiB a token over 65.5 GB, 4.0e-6);
- a prompt's attention arithmetic over a token's GEMM arithmetic: whole prompts alone never separate the
  two (a prompt of n tokens runs n GEMM tokens and n^2 attention pairs together), while a chunk deep in its
  prompt is nearly all attention; pricing the pairs at the GEMMs' FLOP rate lets whole-prompt traces price
  chunks (Qwen3-32B: 1.7e-5).
Dense decoder models (Llama, Qwen, Mistral style: gated MLP, grouped-query attention). Pure computation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}
_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


class ModelConfigError(ValueError):
    """A config.json that does not describe a dense decoder this module can price (the message says why)."""


@dataclass(frozen=True)
class ModelShape:
    weight_bytes: float  # every parameter once, embeddings and the output head included
    kv_bytes_per_token: float  # K and V of one token over every layer
    gemm_flops_per_token: float  # the layers' matrix multiplies for one token (logits: only a prompt's last)
    attention_flops_per_pair: float  # per unit of the engine's attention count (n^2 for a prompt of n tokens)

    @property
    def kv_read_per_weight_read(self) -> float:
        """A context token's KV read over a step's weights' read (both bytes, one bandwidth)."""
        return self.kv_bytes_per_token / self.weight_bytes

    @property
    def attention_per_gemm_token(self) -> float:
        """One unit of attention count over one token's GEMMs, in arithmetic."""
        return self.attention_flops_per_pair / self.gemm_flops_per_token

    @classmethod
    def from_hf_config(cls, path: Path) -> ModelShape:
        """Raises ModelConfigError on a file that is not a dense decoder's config (one message, the reason)."""
        try:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as error:
            raise ModelConfigError(f"cannot read the model config {path}: {error}") from error
        raw = raw.get("text_config", raw)  # multimodal configs nest the language model's
        missing = [key for key in _REQUIRED if not isinstance(raw.get(key), int)]
        if missing:
            raise ModelConfigError(f"model config {path} lacks {', '.join(missing)} (a Hugging Face config.json)")
        if any(key in raw for key in ("num_experts", "num_local_experts", "n_routed_experts")):
            raise ModelConfigError(f"model config {path} is a mixture of experts: only dense models are priced")
        dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16")
        if dtype not in _DTYPE_BYTES:
            raise ModelConfigError(f"model config {path}: unknown dtype {dtype} (one of {', '.join(_DTYPE_BYTES)})")
        hidden, layers, heads = raw["hidden_size"], raw["num_hidden_layers"], raw["num_attention_heads"]
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or hidden // heads)
        attention_params = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, o and k, v projections
        mlp_params = 3 * hidden * raw["intermediate_size"]  # gate, up, down
        layer_params = layers * (attention_params + mlp_params)
        embeddings = raw["vocab_size"] * hidden * (1 if raw.get("tie_word_embeddings", False) else 2)
        width = _DTYPE_BYTES[dtype]
        return cls(
            weight_bytes=float(width * (layer_params + embeddings)),
            kv_bytes_per_token=float(layers * kv_heads * head_dim * 2 * width),
            gemm_flops_per_token=float(2 * layer_params),
            # Causal attention over a prompt of n tokens: QK^T and PV, 2 * head_dim FLOPs each per pair and
            # head, over n^2 / 2 pairs; the engine counts n^2.
            attention_flops_per_pair=float(2 * head_dim * heads * layers),
        )
