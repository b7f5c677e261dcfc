"""A Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) over a paged KV cache.

One forward runs one engine iteration: any mix of prefill chunks and decode tokens from different
sequences (`SeqSlice`s). All new tokens go through the projections and the MLP as one flattened matmul;
their K/V are written into the block pool at their slots; attention then runs per sequence over the
K/V gathered from the pool through its block table. That shared iteration is what makes colocated
interference real: a decode token in the same batch as a 2,000-token prefill waits for all of it.

`prefill`, `decode_one_token` and `generate` are thin named wrappers: they are the span boundaries.
`Transformer.forward_dense` is the unpaged reference used to check the paged path.

The device is always passed in (CPU by default); nothing here assumes CUDA.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from reference_server.kv_cache import BlockAllocator, BlockTable, KVCachePool, blocks_for_tokens, kv_bytes_per_token
from reference_server.tokenizer import EOS_ID, VOCAB_SIZE

__all__ = [
    "PRESETS",
    "ModelArgs",
    "SeqSlice",
    "Transformer",
    "build_model",
    "decode_one_token",
    "generate",
    "kv_bytes_per_token",
    "multinomial_sample_one_no_sync",
    "prefill",
    "sample",
    "sample_no_sync",
]


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int  # SwiGLU hidden size
    vocab_size: int = VOCAB_SIZE
    max_seq_len: int = 4096
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    head_dim: int = 0  # 0: dim // n_heads

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> ModelArgs:
        try:
            preset = PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}") from None
        return replace(preset, **overrides) if overrides else preset


PRESETS: dict[str, ModelArgs] = {
    # Unit tests: a forward over a few hundred tokens takes milliseconds.
    "tiny": ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192, max_seq_len=1024),
    # The CPU demo, sized for 2 CPU cores (float32): a 2,000-token prefill ~0.6 s, a decode step of batch 8
    # at context 500 ~18 ms, so a colocated prefill stalls decodes ~35x (bench/model_step_timing.py).
    "small": ModelArgs(dim=384, n_layers=6, n_heads=6, n_kv_heads=2, ffn_dim=1024, max_seq_len=4096),
    # Real shapes, for GPU use and KV sizing (the tokenizer here is byte-level, the vocab size is Llama 3's).
    "llama3-8b": ModelArgs(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256, max_seq_len=8192
    ),
    "llama3-70b": ModelArgs(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab_size=128256, max_seq_len=8192
    ),
}


@dataclass
class SeqSlice:
    """The new positions of one sequence in an iteration.

    `token_ids` [n_new] (long, on the model's device) hold positions start_pos .. start_pos + n_new - 1;
    `block_table` must already have blocks for every one of them and holds the KV of positions
    0 .. start_pos - 1. The forward writes the new K/V and sets `block_table.num_tokens` to the end.
    """

    token_ids: torch.Tensor
    start_pos: int
    block_table: BlockTable

    @property
    def end_pos(self) -> int:
        return self.start_pos + self.token_ids.shape[0]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_f32 = x.float()
        normed = x_f32 * torch.rsqrt(x_f32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_tables(args: ModelArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each [max_seq_len, head_dim // 2], float32."""
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float64) / args.head_dim))
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves of the last dim. x [T, H, D]; cos/sin [T, D/2] for each token's position."""
    x_f32 = x.float()
    x1, x2 = x_f32.chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


@dataclass
class _BatchLayout:
    """Per-iteration index tensors, built once and shared by every layer."""

    cos: torch.Tensor  # [T, D/2]
    sin: torch.Tensor  # [T, D/2]
    write_blocks: torch.Tensor  # [T] block id of each new token
    write_offsets: torch.Tensor  # [T] offset in its block
    read_blocks: list[torch.Tensor]  # per sequence: its block ids covering 0 .. end_pos - 1
    token_ranges: list[tuple[int, int]]  # per sequence: its rows in the flattened batch
    context_lens: list[int]  # per sequence: end_pos
    masks: list[torch.Tensor | None]  # per sequence: attention mask; None with `causal` or for a single query
    causal: list[bool]  # per sequence: a prefill from position 0 (square causal: SDPA's fast path)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wqkv = nn.Linear(args.dim, (args.n_heads + 2 * args.n_kv_heads) * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = self.wqkv(x).split((q_size, kv_size, kv_size), dim=-1)
        q = apply_rope(q.view(-1, self.n_heads, self.head_dim), cos, sin)  # [T, H, D]
        k = apply_rope(k.view(-1, self.n_kv_heads, self.head_dim), cos, sin)  # [T, Hkv, D]
        return q, k, v.view(-1, self.n_kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, layout: _BatchLayout, pool: torch.Tensor) -> torch.Tensor:
        """x [T, dim] -> [T, dim]; writes this layer's K/V of the T new tokens into `pool` first."""
        q, k, v = self._qkv(x, layout.cos, layout.sin)
        pool[layout.write_blocks, 0, self.layer_id, layout.write_offsets] = k
        pool[layout.write_blocks, 1, self.layer_id, layout.write_offsets] = v
        outputs = []
        for (first, last), blocks, context_len, mask, causal in zip(
            layout.token_ranges, layout.read_blocks, layout.context_lens, layout.masks, layout.causal
        ):
            # [n_blocks, block_size, Hkv, D] -> [Hkv, context, D]
            keys = pool[blocks, 0, self.layer_id].flatten(0, 1)[:context_len].transpose(0, 1)
            values = pool[blocks, 1, self.layer_id].flatten(0, 1)[:context_len].transpose(0, 1)
            queries = q[first:last].transpose(0, 1)  # [H, n_new, D]
            out = F.scaled_dot_product_attention(
                queries[None], keys[None], values[None], attn_mask=mask, is_causal=causal, enable_gqa=True
            )  # [1, H, n_new, D]
            outputs.append(out[0].transpose(0, 1).reshape(last - first, -1))
        return self.wo(torch.cat(outputs))

    def forward_dense(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Unpaged causal attention over one whole sequence: x [S, dim] -> [S, dim]."""
        q, k, v = self._qkv(x, cos, sin)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True, enable_gqa=True
        )
        return self.wo(out[0].transpose(0, 1).reshape(x.shape[0], -1))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int) -> None:
        super().__init__()
        self.attention = Attention(args, layer_id)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: torch.Tensor, layout: _BatchLayout, pool: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), layout, pool)
        return h + self.feed_forward(self.ffn_norm(h))

    def forward_dense(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention.forward_dense(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    # Registered buffers: nn.Module's __getattr__ is typed Tensor | Module; these are always tensors.
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        cos, sin = rope_tables(args)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def device(self) -> torch.device:
        return self.output.weight.device

    def _layout(self, batch: list[SeqSlice], pool: KVCachePool) -> _BatchLayout:
        """Index tensors for one iteration: built from host ints, each copied to the device once."""
        block_size = pool.block_size
        positions, write_blocks, read_blocks, token_ranges = [], [], [], []
        masks: list[torch.Tensor | None] = []  # None: SDPA's own causal mask, or none needed
        first = 0
        for seq in batch:
            n_new = seq.token_ids.shape[0]
            if n_new == 0:
                raise ValueError("a SeqSlice needs at least one new token")
            if seq.block_table.block_size != block_size:
                raise ValueError(f"block table of {seq.block_table.block_size}-token blocks, pool has {block_size}")
            if seq.end_pos > self.args.max_seq_len:
                raise ValueError(f"position {seq.end_pos - 1} is beyond max_seq_len {self.args.max_seq_len}")
            if seq.end_pos > seq.block_table.capacity_tokens:
                raise ValueError(
                    f"block table holds {seq.block_table.capacity_tokens} tokens, slice needs {seq.end_pos}"
                )
            seq_positions = torch.arange(seq.start_pos, seq.end_pos)
            seq_blocks = torch.tensor(seq.block_table.block_ids[: blocks_for_tokens(seq.end_pos, block_size)])
            positions.append(seq_positions)
            write_blocks.append(seq_blocks[seq_positions // block_size])
            read_blocks.append(seq_blocks.to(self.device, non_blocking=True))
            token_ranges.append((first, first + n_new))
            # New query i sits at position start_pos + i and sees keys 0 .. start_pos + i. SDPA's is_causal
            # aligns the mask top-left, right only when the chunk starts at 0; later chunks need a mask.
            if n_new == 1 or seq.start_pos == 0:
                masks.append(None)
            else:
                visible = torch.arange(seq.end_pos)[None, :] <= seq_positions[:, None]  # [n_new, end_pos]
                masks.append(visible.to(self.device, non_blocking=True))
            first += n_new
        all_positions = torch.cat(positions)
        device_positions = all_positions.to(self.device, non_blocking=True)
        return _BatchLayout(
            cos=self.rope_cos[device_positions],
            sin=self.rope_sin[device_positions],
            write_blocks=torch.cat(write_blocks).to(self.device, non_blocking=True),
            write_offsets=(all_positions % block_size).to(self.device, non_blocking=True),
            read_blocks=read_blocks,
            token_ranges=token_ranges,
            context_lens=[seq.end_pos for seq in batch],
            masks=masks,
            causal=[seq.start_pos == 0 and seq.token_ids.shape[0] > 1 for seq in batch],
        )

    @torch.inference_mode()
    def forward(self, batch: list[SeqSlice], pool: KVCachePool) -> torch.Tensor:
        """One iteration over mixed prefill chunks and decode tokens -> logits [len(batch), vocab] (float32).

        Row i holds the logits after the LAST new token of batch[i]. Writes the new K/V into `pool` and
        sets each `block_table.num_tokens` to its slice's end. Blocking only as far as the device is
        (on CUDA the call returns once kernels are queued); no host sync.
        """
        if not batch:
            raise ValueError("forward() needs at least one SeqSlice")
        if pool.dtype != self.output.weight.dtype:
            raise ValueError(f"KV pool is {pool.dtype}, model is {self.output.weight.dtype}")
        layout = self._layout(batch, pool)
        x = self.tok_embeddings(torch.cat([seq.token_ids for seq in batch]))  # [T, dim]
        for layer in self.layers:
            x = layer(x, layout, pool.tensor)
        last_rows = torch.tensor([last - 1 for _, last in layout.token_ranges]).to(self.device, non_blocking=True)
        for seq in batch:
            seq.block_table.num_tokens = max(seq.block_table.num_tokens, seq.end_pos)
        return self.output(self.norm(x[last_rows])).float()

    @torch.inference_mode()
    def forward_dense(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Reference forward with no KV cache: token_ids [S] -> logits [S, vocab] (float32), causal."""
        seq_len = token_ids.shape[0]
        cos, sin = self.rope_cos[:seq_len], self.rope_sin[:seq_len]
        x = self.tok_embeddings(token_ids)
        for layer in cast("list[TransformerBlock]", self.layers):  # a ModuleList of blocks, typed as Modules
            x = layer.forward_dense(x, cos, sin)
        return self.output(self.norm(x)).float()


def _seeded_normal_(tensor: torch.Tensor, seed: int, name: str, std: float) -> None:
    """Fill `tensor` from a CPU generator keyed by (seed, parameter name): same bytes in every process."""
    generator = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    values = torch.empty(tensor.shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
    tensor.copy_(values)


def build_model(
    args: ModelArgs, *, seed: int = 0, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> Transformer:
    """A Transformer with deterministic weights: the same `seed` gives the same weights in every process.

    Weights are drawn on the host in float32 (independent of device), then cast. Linear weights have
    std 1/sqrt(fan_in); the residual projections (wo, w2) are further scaled by 1/sqrt(2 n_layers) so
    the residual stream stays O(1), and the output head gives logits of std ~1: sampling is not
    degenerate. Returns the model in eval mode.
    """
    with torch.device("meta"):
        model = Transformer(args)
    # Allocate straight in the target dtype (an 8B model never exists in float32 on the device).
    model = model.to(dtype=dtype).to_empty(device=device)
    residual_scale = 1.0 / math.sqrt(2 * args.n_layers)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name == "tok_embeddings.weight":
                _seeded_normal_(param, seed, name, 1.0)
            else:
                std = 1.0 / math.sqrt(param.shape[1])
                if name.endswith(("wo.weight", "w2.weight")):
                    std *= residual_scale
                _seeded_normal_(param, seed, name, std)
    # RoPE tables stay float32 whatever the weights' dtype.
    cos, sin = rope_tables(args)
    model.rope_cos = cos.to(device)
    model.rope_sin = sin.to(device)
    return model.eval()


# --- sampling --------------------------------------------------------------------------------------


def multinomial_sample_one_no_sync(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row of `probs` [n, vocab] without a host sync: argmax(probs / Exponential(1)).

    The exponential race picks index i with probability probs[i] (gpt-fast's trick); torch.multinomial
    would sync. Returns long [n] on probs' device.
    """
    race = torch.empty_like(probs).exponential_(1, generator=generator)
    return torch.argmax(probs / race, dim=-1)


def sample_no_sync(
    logits: torch.Tensor, temperature: float | torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Next token per row of `logits` [n, vocab] -> long [n] on the same device; never syncs the host.

    `temperature` is a float for the whole batch or a tensor [n] per row; 0 means greedy (argmax).
    Rows with temperature > 0 draw from softmax(logits / temperature) using `generator` (which must be
    on logits' device), so a seeded generator makes the draws reproducible.
    """
    greedy = torch.argmax(logits, dim=-1)
    if isinstance(temperature, (int, float)):
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if temperature == 0:
            return greedy
        return multinomial_sample_one_no_sync(torch.softmax(logits.float() / temperature, dim=-1), generator)
    temperature = temperature.to(logits.device, torch.float32)
    safe_temperature = torch.where(temperature > 0, temperature, torch.ones_like(temperature))[:, None]
    drawn = multinomial_sample_one_no_sync(torch.softmax(logits.float() / safe_temperature, dim=-1), generator)
    return torch.where(temperature > 0, drawn, greedy)


sample = sample_no_sync  # the name in the design notes; the long name says what it guarantees


# --- span boundaries (gpt-fast style) -------------------------------------------------------------


def prefill(
    model: Transformer,
    seq: SeqSlice,
    pool: KVCachePool,
    *,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Prefill one sequence's prompt (or a chunk of it); returns the next token, long [1], on device."""
    return sample_no_sync(model([seq], pool), temperature, generator)


def decode_one_token(
    model: Transformer,
    batch: list[SeqSlice],
    pool: KVCachePool,
    *,
    temperature: float | torch.Tensor = 0.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One decode step for a batch of single-token slices; returns next tokens, long [len(batch)]."""
    return sample_no_sync(model(batch, pool), temperature, generator)


def generate(
    model: Transformer,
    prompt_ids: list[int],
    max_new_tokens: int,
    pool: KVCachePool,
    allocator: BlockAllocator,
    *,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    stop_at_eos: bool = True,
) -> list[int]:
    """Generate for one prompt alone (no batching): prefill, then decode token by token.

    Allocates the sequence's blocks up front and frees them before returning (also on error). Tokens
    stay on the device until the end: one host sync per call, so decoding continues past an EOS and
    the output is cut there afterwards.
    """
    if not prompt_ids:
        raise ValueError("generate() needs a non-empty prompt")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    total_tokens = len(prompt_ids) + max_new_tokens - 1  # the last sampled token's KV is never written
    if total_tokens > model.args.max_seq_len:
        raise ValueError(f"prompt + output ({total_tokens} tokens) exceeds max_seq_len {model.args.max_seq_len}")
    table = allocator.allocate_table(total_tokens)
    try:
        prompt = torch.tensor(prompt_ids, dtype=torch.long, device=model.device)
        token = prefill(model, SeqSlice(prompt, 0, table), pool, temperature=temperature, generator=generator)
        generated = [token]
        for position in range(len(prompt_ids), total_tokens):
            token = decode_one_token(
                model, [SeqSlice(token, position, table)], pool, temperature=temperature, generator=generator
            )
            generated.append(token)
        output = torch.cat(generated).tolist()
    finally:
        allocator.free(table.block_ids)
    if stop_at_eos and EOS_ID in output:
        output = output[: output.index(EOS_ID) + 1]
    return output
