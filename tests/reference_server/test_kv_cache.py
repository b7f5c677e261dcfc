"""Block pool layout, allocator accounting, prefix cache (reference_server.kv_cache)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reference_server.kv_cache import (
    BlockAllocator,
    BlockTable,
    KVCachePool,
    OutOfBlocks,
    block_hashes,
    kv_bytes_per_token,
)
from reference_server.model import ModelArgs


def test_llama3_presets_kv_bytes_per_token_in_bf16() -> None:
    assert kv_bytes_per_token(ModelArgs.from_name("llama3-8b"), torch.bfloat16) == 131072  # 128 KiB
    assert kv_bytes_per_token(ModelArgs.from_name("llama3-70b"), torch.bfloat16) == 327680  # 320 KiB
    assert kv_bytes_per_token(ModelArgs.from_name("llama3-8b"), torch.float32) == 2 * 131072


@pytest.mark.parametrize("block_size", [16, 256])
def test_pool_block_is_one_contiguous_byte_range_holding_k_and_v_of_every_layer(block_size: int) -> None:
    args = ModelArgs.from_name("tiny")
    pool = KVCachePool(args, num_blocks=3, block_size=block_size, device="cpu", dtype=torch.float32)
    assert pool.tensor.shape == (3, 2, args.n_layers, block_size, args.n_kv_heads, args.head_dim)
    assert pool.tensor.is_contiguous()
    assert pool.block_bytes == pool.kv_bytes_per_token * block_size
    block = pool.tensor[1]
    assert block.is_contiguous()
    assert block.numel() * block.element_size() == pool.block_bytes
    # The block's bytes sit between its neighbours' in the one allocation.
    assert block.data_ptr() - pool.tensor.data_ptr() == pool.block_bytes


@pytest.mark.parametrize("bad_block_size", [8, 15, 257, 512])
def test_block_size_outside_16_to_256_is_refused(bad_block_size: int) -> None:
    with pytest.raises(ValueError, match="block size must be 16..256"):
        BlockAllocator(num_blocks=4, block_size=bad_block_size)


def test_allocate_then_free_returns_every_block() -> None:
    allocator = BlockAllocator(num_blocks=10, block_size=16)
    first, second = allocator.allocate(4), allocator.allocate(6)
    assert len(set(first) | set(second)) == 10
    assert allocator.num_free_blocks == 0
    assert allocator.usage_ratio() == 1.0
    allocator.free(first)
    assert allocator.usage_ratio() == pytest.approx(0.6)
    allocator.free(second)
    assert allocator.num_free_blocks == 10
    assert allocator.usage_ratio() == 0.0


def test_out_of_blocks_is_clear_and_allocates_nothing() -> None:
    allocator = BlockAllocator(num_blocks=5, block_size=16)
    allocator.allocate(3)
    with pytest.raises(OutOfBlocks, match="need 3 KV blocks, only 2 of 5 free"):
        allocator.allocate(3)
    assert allocator.num_free_blocks == 2
    assert len(allocator.allocate(2)) == 2


def test_double_free_is_refused_without_changing_anything() -> None:
    allocator = BlockAllocator(num_blocks=4, block_size=16)
    blocks = allocator.allocate(2)
    with pytest.raises(ValueError, match="double free"):
        allocator.free([blocks[0], blocks[1], blocks[1]])
    assert allocator.num_free_blocks == 2
    allocator.free(blocks)
    with pytest.raises(ValueError, match="double free"):
        allocator.free(blocks[:1])
    with pytest.raises(ValueError, match="outside"):
        allocator.free([4])


def test_block_table_slots_follow_its_blocks() -> None:
    table = BlockTable(block_size=16, block_ids=[7, 2, 5])
    slots = table.slots_for(torch.tensor([0, 15, 16, 40]))
    assert slots.tolist() == [7 * 16, 7 * 16 + 15, 2 * 16, 5 * 16 + 8]
    with pytest.raises(IndexError, match="beyond"):
        table.slots_for(torch.tensor([48]))


def test_block_hash_names_the_whole_prefix_not_just_the_block() -> None:
    block = list(range(16))
    alone = block_hashes(block, 16)
    after_other = block_hashes(list(range(100, 116)) + block, 16)
    assert len(alone) == 1 and len(after_other) == 2
    assert alone[0] != after_other[1]
    assert block_hashes(block + [1, 2, 3], 16) == alone  # a partial block gets no hash


def _prefill_and_cache(allocator: BlockAllocator, tokens: list[int]) -> list[int]:
    table = allocator.allocate_table(len(tokens))
    table.num_tokens = len(tokens)
    allocator.cache_full_blocks(table, tokens)
    return table.block_ids


def test_prefix_hit_returns_the_cached_blocks_in_order_and_takes_references() -> None:
    allocator = BlockAllocator(num_blocks=8, block_size=16)
    prompt = list(range(50))  # 3 full blocks + 2 tokens
    blocks = _prefill_and_cache(allocator, prompt)
    assert allocator.num_cached_blocks == 3

    sharing = allocator.lookup_prefix(prompt[:40] + [999] * 20)
    assert sharing.num_tokens == 32
    assert sharing.block_ids == tuple(blocks[:2])
    assert [allocator.refcount(b) for b in blocks[:3]] == [2, 2, 1]

    allocator.free(blocks)  # the first sequence ends: blocks 0,1 still shared, block 2 evictable
    assert [allocator.refcount(b) for b in blocks[:3]] == [1, 1, 0]
    assert allocator.num_free_blocks == 8 - 2

    capped = allocator.lookup_prefix(prompt[:48], max_tokens=47)  # never the whole prompt
    assert capped.block_ids == tuple(blocks[:2])
    allocator.free(capped.block_ids)
    allocator.free(sharing.block_ids)
    assert allocator.num_free_blocks == 8


def test_unreferenced_cached_blocks_are_evicted_lru_when_allocation_needs_room() -> None:
    allocator = BlockAllocator(num_blocks=4, block_size=16)
    older, newer = list(range(32)), list(range(500, 532))
    allocator.free(_prefill_and_cache(allocator, older))
    allocator.free(_prefill_and_cache(allocator, newer))
    assert allocator.num_cached_blocks == 4 and allocator.num_free_blocks == 4

    allocator.allocate(1)  # no plain free block left: evicts from the least recently freed sequence
    assert allocator.lookup_prefix(newer).num_tokens == 32
    # The older sequence's last block went first (blocks are freed last-to-first), its first survived.
    older_hit = allocator.lookup_prefix(older)
    assert older_hit.num_tokens == 16


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "cached_prompt"]), st.integers(0, 5)), max_size=40))
def test_allocator_never_leaks_or_double_counts(ops: list[tuple[str, int]]) -> None:
    allocator = BlockAllocator(num_blocks=12, block_size=16)
    held: list[list[int]] = []
    for op, n in ops:
        if op == "alloc":
            try:
                held.append(allocator.allocate(n))
            except OutOfBlocks:
                pass
        elif op == "free" and held:
            allocator.free(held.pop(n % len(held)))
        elif op == "cached_prompt":
            prompt = [n] * (16 * (n % 3 + 1))
            hit = allocator.lookup_prefix(prompt)
            try:
                fresh = allocator.allocate(len(prompt) // 16 - len(hit.block_ids))
            except OutOfBlocks:
                allocator.free(hit.block_ids)
                continue
            table = BlockTable(16, [*hit.block_ids, *fresh], len(prompt))
            allocator.cache_full_blocks(table, prompt)
            held.append(table.block_ids)
        in_use = sum(1 for b in range(12) if allocator.refcount(b) > 0)
        assert in_use + allocator.num_free_blocks == 12
    for blocks in held:
        allocator.free(blocks)
    assert allocator.num_free_blocks == 12
    assert all(allocator.refcount(b) == 0 for b in range(12))


def test_try_allocate_answers_none_when_short_for_the_kv_receiver_callback() -> None:
    allocator = BlockAllocator(num_blocks=4, block_size=16)
    blocks = allocator.try_allocate(3)
    assert blocks is not None and len(blocks) == 3
    assert allocator.try_allocate(2) is None
    assert allocator.num_free_blocks == 1
    allocator.free(blocks)
    assert allocator.try_allocate(4) is not None
