"""Paged KV cache: one block pool tensor per worker, block tables, a refcounted allocator, a prefix cache.

Layout (a contract with kv_transfer/): `KVCachePool.tensor` has shape
`[num_blocks, 2, n_layers, block_size, n_kv_heads, head_dim]` (index 1: 0 = K, 1 = V) and is contiguous,
so `pool.tensor[block_id]` -- one block's K and V for every layer -- is one contiguous byte range of
`pool.block_bytes` bytes. A sender ships those bytes as-is; a receiver with the same shape and dtype
writes them straight into `pool.tensor[dst_block_id]`.

Token position p of a sequence lives in block `block_ids[p // block_size]` at offset `p % block_size`;
its "slot" is `block_id * block_size + offset`.

The allocator is pure bookkeeping (no tensors). Its methods are thread-safe (one lock, held for
O(blocks touched)): the engine loop's scheduler and the KV receiver's connection threads share it.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

MIN_BLOCK_TOKENS = 16
MAX_BLOCK_TOKENS = 256


class KVShape(Protocol):
    """The model dimensions that size a KV cache (a `model.ModelArgs` satisfies it). Read-only: a frozen
    dataclass satisfies it, and nothing here sets them."""

    @property
    def n_layers(self) -> int: ...
    @property
    def n_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...


def kv_bytes_per_token(args: KVShape, dtype: torch.dtype) -> int:
    """Bytes of K and V, all layers, for one token: 2 x layers x kv_heads x head_dim x element size."""
    element_bytes = torch.empty((), dtype=dtype).element_size()
    return 2 * args.n_layers * args.n_kv_heads * args.head_dim * element_bytes


def check_block_size(block_size: int) -> None:
    if not MIN_BLOCK_TOKENS <= block_size <= MAX_BLOCK_TOKENS:
        raise ValueError(f"block size must be {MIN_BLOCK_TOKENS}..{MAX_BLOCK_TOKENS} tokens, got {block_size}")


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCachePool:
    """The block pool tensor of one worker, preallocated once (zeros) on `device`."""

    def __init__(
        self, args: KVShape, num_blocks: int, block_size: int, *, device: torch.device | str, dtype: torch.dtype
    ) -> None:
        check_block_size(block_size)
        if num_blocks < 1:
            raise ValueError(f"a KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.n_layers = args.n_layers
        # [num_blocks, 2 (K/V), n_layers, block_size, n_kv_heads, head_dim]
        self.tensor = torch.zeros(
            (num_blocks, 2, args.n_layers, block_size, args.n_kv_heads, args.head_dim), device=device, dtype=dtype
        )
        self.kv_bytes_per_token = kv_bytes_per_token(args, dtype)
        self.block_bytes = self.kv_bytes_per_token * block_size

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype


class OutOfBlocks(RuntimeError):
    """Not enough free (or evictable) KV blocks; nothing was allocated."""


@dataclass
class BlockTable:
    """One sequence's blocks, in position order, and how many token positions hold KV.

    `block_ids` may have room for more tokens than `num_tokens` (blocks reserved ahead of decoding).
    """

    block_size: int
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0

    @property
    def capacity_tokens(self) -> int:
        return len(self.block_ids) * self.block_size

    def slots_for(self, positions: torch.Tensor) -> torch.Tensor:
        """Slot (`block_id * block_size + offset`) of each position; same device and shape as `positions`.

        Raises IndexError when a position lies beyond the blocks of this table. Does no host sync when
        `positions` is on the host (the usual case: positions come from the scheduler's ints).
        """
        if positions.numel() and int(positions.max()) >= self.capacity_tokens:
            raise IndexError(f"position {int(positions.max())} is beyond this table's {self.capacity_tokens} tokens")
        table = torch.tensor(self.block_ids, dtype=torch.long, device=positions.device)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size


@dataclass(frozen=True)
class PrefixHit:
    """The longest cached prefix of a prompt, in whole blocks: its length and its blocks (refs taken)."""

    num_tokens: int
    block_ids: tuple[int, ...]


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Chained hash of every FULL block: hash(previous block's hash + this block's token ids).

    A block's hash therefore names the whole prefix up to its end, so equal hashes mean equal KV.
    """
    hashes: list[bytes] = []
    previous = b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        digest = hashlib.blake2b(previous, digest_size=16)
        digest.update(array("q", token_ids[start : start + block_size]).tobytes())
        previous = digest.digest()
        hashes.append(previous)
    return hashes


class BlockAllocator:
    """Refcounted block ids 0..num_blocks-1 with a prefix cache of full blocks by chained hash.

    A block is in exactly one state: free (no contents worth keeping), in use (refcount > 0), or cached
    and unreferenced (refcount 0, contents kept for prefix hits, evicted least-recently-used first when
    an allocation needs room). Every method is atomic under one internal lock, never blocks for long
    (no I/O, O(blocks touched)), and may be called from any thread.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        check_block_size(block_size)
        if num_blocks < 1:
            raise ValueError(f"an allocator needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._refcount = [0] * num_blocks
        self._hash_of_block: dict[int, bytes] = {}
        self._block_of_hash: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, refcount 0; oldest first
        self._lock = threading.Lock()

    # --- accounting -------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can get now: free plus cached-but-unreferenced (evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of_hash)

    def usage_ratio(self) -> float:
        """Share of blocks referenced by live sequences, 0..1 (the `splitscope_kv_cache_usage_ratio` gauge)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def refcount(self, block_id: int) -> int:
        return self._refcount[block_id]

    # --- allocation -------------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """`n` fresh blocks, refcount 1 each; raises OutOfBlocks (allocating nothing) when short."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        with self._lock:
            return self._allocate_locked(n)

    def try_allocate(self, n: int) -> list[int] | None:
        """`n` fresh blocks, or None when short (the KV receiver's `allocate_blocks` callback)."""
        try:
            return self.allocate(n)
        except OutOfBlocks:
            return None

    def _allocate_locked(self, n: int) -> list[int]:
        if n > self.num_free_blocks:
            raise OutOfBlocks(
                f"need {n} KV blocks, only {self.num_free_blocks} of {self.num_blocks} free "
                f"(block size {self.block_size} tokens)"
            )
        block_ids = []
        for _ in range(n):
            if self._free:
                block_id = self._free.pop()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                del self._block_of_hash[self._hash_of_block.pop(block_id)]
            self._refcount[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def allocate_table(self, num_tokens: int) -> BlockTable:
        """A BlockTable with room for `num_tokens` positions (num_tokens stays 0 until KV is written)."""
        return BlockTable(self.block_size, self.allocate(blocks_for_tokens(num_tokens, self.block_size)))

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block; at zero a cached block turns evictable, any other free.

        Raises ValueError on an id out of range or a block that is not in use (a double free), before
        changing anything.
        """
        with self._lock:
            self._free_locked(block_ids)

    def _free_locked(self, block_ids: Sequence[int]) -> None:
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks:
                raise ValueError(f"block id {block_id} is outside 0..{self.num_blocks - 1}")
        pending: dict[int, int] = {}
        for block_id in block_ids:
            pending[block_id] = pending.get(block_id, 0) + 1
            if pending[block_id] > self._refcount[block_id]:
                raise ValueError(f"block {block_id} freed more often than it is referenced (double free)")
        # Free in reverse so a sequence's last blocks are evicted before its first: its shorter prefixes
        # stay reusable longest.
        for block_id in reversed(block_ids):
            self._refcount[block_id] -= 1
            if self._refcount[block_id] == 0:
                if block_id in self._hash_of_block:
                    self._evictable[block_id] = None
                else:
                    self._free.append(block_id)

    # --- prefix cache -----------------------------------------------------------------------------

    def lookup_prefix(self, token_ids: Sequence[int], *, max_tokens: int | None = None) -> PrefixHit:
        """Longest run of cached full blocks from the start of `token_ids` (at most `max_tokens` tokens).

        Takes one reference on each hit block (the caller frees them with the sequence's other blocks).
        Callers that must recompute the last prompt token (to get its logits) pass len(prompt) - 1.
        """
        limit = len(token_ids) if max_tokens is None else min(max_tokens, len(token_ids))
        hashes = block_hashes(token_ids[:limit], self.block_size)  # hashed outside the lock
        hits: list[int] = []
        with self._lock:
            for block_hash in hashes:
                block_id = self._block_of_hash.get(block_hash)
                if block_id is None:
                    break
                hits.append(block_id)
            for block_id in hits:
                if self._refcount[block_id] == 0:
                    del self._evictable[block_id]
                self._refcount[block_id] += 1
        return PrefixHit(len(hits) * self.block_size, tuple(hits))

    def cache_full_blocks(self, table: BlockTable, token_ids: Sequence[int]) -> int:
        """Register every full block of `table` whose KV is written (`table.num_tokens`) for prefix hits.

        `token_ids` are the sequence's tokens from position 0. Blocks already cached, and hashes already
        held by another block, are left as they are. Returns how many blocks were newly registered.
        """
        written = min(table.num_tokens, len(token_ids))
        hashes = block_hashes(token_ids[:written], self.block_size)
        added = 0
        with self._lock:
            for block_id, block_hash in zip(table.block_ids, hashes):
                if self._refcount[block_id] == 0:
                    continue  # a block nobody holds may be handed out any moment: never cache it
                if block_id in self._hash_of_block or block_hash in self._block_of_hash:
                    continue
                self._hash_of_block[block_id] = block_hash
                self._block_of_hash[block_hash] = block_id
                added += 1
        return added
