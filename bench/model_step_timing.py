"""Step times of a model preset on this machine: a long prefill, a decode step, and one mixed iteration.

Shows the interference the colocated policy creates: a decode step that shares its iteration with a
whole prefill takes as long as the prefill. Run: `python bench/model_step_timing.py --preset small`.
All figures come from this one run (median of --repeats); compare them as ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from reference_server.kv_cache import BlockAllocator, KVCachePool
from reference_server.model import ModelArgs, SeqSlice, build_model


def median_seconds(step, repeats: int) -> float:
    step()  # warm-up: first-call allocations
    samples = []
    for _ in range(repeats):
        start_ns = time.perf_counter_ns()
        step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        samples.append((time.perf_counter_ns() - start_ns) / 1e9)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prefill-tokens", type=int, default=2000)
    parser.add_argument("--decode-batch", type=int, default=8)
    parser.add_argument("--decode-context", type=int, default=500)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    opts = parser.parse_args()

    args = ModelArgs.from_name(opts.preset)
    model = build_model(args, seed=0, device=opts.device)
    total_tokens = opts.prefill_tokens + opts.decode_batch * (opts.decode_context + 8)
    num_blocks = 2 * total_tokens // opts.block_size + 8
    pool = KVCachePool(args, num_blocks, opts.block_size, device=opts.device, dtype=torch.float32)
    allocator = BlockAllocator(num_blocks, opts.block_size)
    generator = torch.Generator().manual_seed(0)

    def tokens(n: int) -> torch.Tensor:
        return torch.randint(0, 256, (n,), generator=generator).to(opts.device)

    prompt = tokens(opts.prefill_tokens)
    prefill_table = allocator.allocate_table(opts.prefill_tokens)
    prefill_batch = [SeqSlice(prompt, 0, prefill_table)]

    decode_tables = [allocator.allocate_table(opts.decode_context + 1) for _ in range(opts.decode_batch)]
    for table in decode_tables:
        model([SeqSlice(tokens(opts.decode_context), 0, table)], pool)
    decode_batch = [SeqSlice(tokens(1), opts.decode_context, table) for table in decode_tables]

    prefill_s = median_seconds(lambda: model(prefill_batch, pool), opts.repeats)
    decode_s = median_seconds(lambda: model(decode_batch, pool), opts.repeats)
    mixed_s = median_seconds(lambda: model(decode_batch + prefill_batch, pool), opts.repeats)
    params = sum(p.numel() for p in model.parameters())
    print(f"preset {opts.preset}: {params / 1e6:.1f} M parameters, {torch.get_num_threads()} threads, {opts.device}")
    print(f"prefill {opts.prefill_tokens} tokens:                {prefill_s * 1e3:8.1f} ms")
    print(f"decode step, batch {opts.decode_batch} at context {opts.decode_context}: {decode_s * 1e3:8.1f} ms")
    print(f"same decode step + that prefill (colocated): {mixed_s * 1e3:8.1f} ms")
    print(f"prefill / decode step: {prefill_s / decode_s:.1f}x; mixed / pure decode step: {mixed_s / decode_s:.1f}x")


if __name__ == "__main__":
    main()
