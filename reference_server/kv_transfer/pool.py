"""Byte access to a paged KV pool for the transfer: zero-copy views on CPU, pinned staging on CUDA.

The pool is one contiguous tensor ``[num_blocks, 2, n_layers, block_tokens, n_kv_heads, head_dim]``, so
block i is the contiguous bytes of ``pool[i]`` and a run of consecutive ids is one contiguous byte range.
Both classes hand out buffers run by run (a run is cut at ``max_run_bytes``):

- ``read_runs(ids)`` yields read-only-use buffers holding the blocks' bytes, in ``ids`` order;
- ``write_runs(ids)`` yields buffers to fill, in ``ids`` order; a filled buffer's bytes are in the pool
  once the generator is resumed, all of them once it is exhausted. Closing it early writes nothing more.
- ``read_batches(ids, batch_bytes)`` / ``write_batches(ids, batch_bytes)``: the same bytes as lists of
  views of at most ``batch_bytes`` in all, one ``sendmsg`` / ``recvmsg_into`` each (see ``batched``).

Called on transfer threads, never on an engine's hot loop. Blocking.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Generator, Iterator, Sequence
from contextlib import closing, contextmanager
from typing import TYPE_CHECKING, Union

import torch

from reference_server.kv_transfer.wire import ALLOWED_DTYPES, BlockLayout

_DTYPE_NAMES = {getattr(torch, name): name for name in ALLOWED_DTYPES if hasattr(torch, name)}
DEFAULT_MAX_RUN_BYTES = 64 << 20
# Pinned staging is allocated per concurrent stream, so runs through it are kept smaller.
DEFAULT_CUDA_RUN_BYTES = 8 << 20
# One sendmsg/recvmsg_into carries at most this many views (Linux IOV_MAX is 1024).
MAX_BATCH_VIEWS = 256


def layout_of(pool: torch.Tensor) -> BlockLayout:
    """The pool's block layout; raises ValueError if it is not a contiguous 6-d pool of an allowed dtype."""
    if pool.dim() != 6 or pool.shape[1] != 2:
        raise ValueError(
            f"KV pool must be [num_blocks, 2, n_layers, block_tokens, n_kv_heads, head_dim], got {list(pool.shape)}"
        )
    if not pool.is_contiguous():
        raise ValueError("KV pool must be contiguous so that each block is one byte range")
    if pool.dtype not in _DTYPE_NAMES:
        raise ValueError(f"KV pool dtype {pool.dtype} is not one of {sorted(ALLOWED_DTYPES)}")
    if pool.shape[0] < 1:
        raise ValueError("KV pool has no blocks")
    return BlockLayout(dtype=_DTYPE_NAMES[pool.dtype], block_shape=tuple(pool.shape[1:]), num_blocks=pool.shape[0])


def consecutive_runs(block_ids: Sequence[int], max_run_blocks: int) -> list[tuple[int, int]]:
    """(first id, count) per run of consecutive ids, in order; a run holds at most ``max_run_blocks``."""
    runs: list[tuple[int, int]] = []
    for block_id in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == block_id and runs[-1][1] < max_run_blocks:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block_id, 1))
    return runs


def batched(
    runs: Generator[memoryview, None, None], batch_bytes: int, *, across_runs: bool
) -> Generator[list[memoryview], None, None]:
    """The bytes of ``runs`` as lists of views of at most ``batch_bytes`` in all, for one ``sendmsg`` /
    ``recvmsg_into`` each (fewer calls, fewer wake-ups) and a checksum pass while the batch is in cache.

    ``across_runs`` lets a batch gather several runs; only for views that stay valid after the next run
    is taken (a host pool). Staged access (CUDA) reuses its buffer per run, so its batches never span runs
    and the next run is taken only after the last batch of this one was consumed. Closing this generator
    closes ``runs`` (a staged pool then returns its buffer).
    """
    with closing(runs):
        yield from _batches(runs, batch_bytes, across_runs)


def _batches(runs: Iterator[memoryview], batch_bytes: int, across_runs: bool) -> Iterator[list[memoryview]]:
    batch: list[memoryview] = []
    size = 0
    for run in runs:
        begin = 0
        while begin < len(run):
            take = min(batch_bytes - size, len(run) - begin)
            batch.append(run[begin : begin + take])
            size += take
            begin += take
            if size == batch_bytes or len(batch) >= MAX_BATCH_VIEWS:
                yield batch
                batch, size = [], 0
        if batch and not across_runs:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


class _BatchedRuns:
    """``read_batches`` / ``write_batches`` over a subclass's ``read_runs`` / ``write_runs``; the subclass
    says whether its views outlive the next run (``views_outlive_run``), so a batch may span runs."""

    views_outlive_run: bool

    if TYPE_CHECKING:  # each subclass defines both

        def read_runs(self, block_ids: Sequence[int]) -> Generator[memoryview, None, None]: ...

        def write_runs(self, block_ids: Sequence[int]) -> Generator[memoryview, None, None]: ...

    def read_batches(self, block_ids: Sequence[int], batch_bytes: int) -> Generator[list[memoryview], None, None]:
        return batched(self.read_runs(block_ids), batch_bytes, across_runs=self.views_outlive_run)

    def write_batches(self, block_ids: Sequence[int], batch_bytes: int) -> Generator[list[memoryview], None, None]:
        return batched(self.write_runs(block_ids), batch_bytes, across_runs=self.views_outlive_run)


class HostPoolBytes(_BatchedRuns):
    """Zero-copy byte views of a CPU pool: sends read the pool's memory, receives ``recv_into`` it."""

    views_outlive_run = True  # views of the pool itself

    def __init__(self, pool: torch.Tensor, max_run_bytes: int = DEFAULT_MAX_RUN_BYTES) -> None:
        self.layout = layout_of(pool)
        if pool.device.type != "cpu":
            raise ValueError("HostPoolBytes needs a CPU pool; use pool_bytes() to pick the right access")
        self._pool = pool  # keeps the storage alive as long as the views
        # uint8 first: numpy has no bfloat16, and bytes are all the wire needs.
        # ndarray is a buffer; numpy's stubs declare __buffer__ only for Python 3.12 and later.
        self._bytes = memoryview(pool.detach().view(torch.uint8).reshape(-1).numpy())  # type: ignore[arg-type]
        self._max_run_blocks = max(1, max_run_bytes // self.layout.block_bytes)

    def _view(self, first_block: int, count: int) -> memoryview:
        block_bytes = self.layout.block_bytes
        return self._bytes[first_block * block_bytes : (first_block + count) * block_bytes]

    def read_runs(self, block_ids: Sequence[int]) -> Generator[memoryview, None, None]:
        for first_block, count in consecutive_runs(block_ids, self._max_run_blocks):
            yield self._view(first_block, count)

    write_runs = read_runs  # the views are the pool's memory: filling one writes the pool


class CudaStagedPoolBytes(_BatchedRuns):
    """A CUDA pool staged through pinned host buffers, one per concurrent user (a stream of a transfer).

    NOT EXERCISED BY CI (no GPU there): kept small on purpose. At most ``max_stagings`` pinned buffers of
    ``max_run_bytes`` exist; a generator holds one while it runs and blocks for one if all are taken.
    Copies run on a private CUDA stream and are waited for before a staging buffer is handed out or reused,
    so the engine's streams never block. Callers guarantee that whatever wrote the source blocks has
    finished (in the worker, the prefill's sampled token reached the host, which waited for the forward).
    """

    views_outlive_run = False  # one staging buffer per generator, refilled per run

    def __init__(self, pool: torch.Tensor, max_run_bytes: int = DEFAULT_CUDA_RUN_BYTES, max_stagings: int = 8) -> None:
        self.layout = layout_of(pool)
        if pool.device.type != "cuda":
            raise ValueError("CudaStagedPoolBytes needs a CUDA pool")
        block_bytes = self.layout.block_bytes
        self._blocks = pool.detach().view(torch.uint8).reshape(self.layout.num_blocks, block_bytes)
        self._max_run_blocks = max(1, min(max_run_bytes // block_bytes, self.layout.num_blocks))
        self._device = pool.device
        self._free_stagings: queue.LifoQueue[tuple[torch.Tensor, memoryview, torch.cuda.Stream]] = queue.LifoQueue()
        self._stagings_left = max_stagings
        self._lock = threading.Lock()

    @contextmanager
    def _staging(self) -> Iterator[tuple[torch.Tensor, memoryview, torch.cuda.Stream]]:
        with self._lock:
            create = self._free_stagings.empty() and self._stagings_left > 0
            if create:
                self._stagings_left -= 1
        if create:
            buffer = torch.empty((self._max_run_blocks, self.layout.block_bytes), dtype=torch.uint8, pin_memory=True)
            # ndarray is a buffer; numpy's stubs declare __buffer__ only for Python 3.12 and later.
            staging = (buffer, memoryview(buffer.view(-1).numpy()), torch.cuda.Stream(device=self._device))  # type: ignore[arg-type]
        else:
            staging = self._free_stagings.get()
        try:
            yield staging
        finally:
            self._free_stagings.put(staging)

    def read_runs(self, block_ids: Sequence[int]) -> Generator[memoryview, None, None]:
        block_bytes = self.layout.block_bytes
        with self._staging() as (buffer, buffer_bytes, copy_stream):
            for first_block, count in consecutive_runs(block_ids, self._max_run_blocks):
                with torch.cuda.stream(copy_stream):
                    buffer[:count].copy_(self._blocks[first_block : first_block + count], non_blocking=True)
                copy_stream.synchronize()
                yield buffer_bytes[: count * block_bytes]

    def write_runs(self, block_ids: Sequence[int]) -> Generator[memoryview, None, None]:
        block_bytes = self.layout.block_bytes
        with self._staging() as (buffer, buffer_bytes, copy_stream):
            for first_block, count in consecutive_runs(block_ids, self._max_run_blocks):
                yield buffer_bytes[: count * block_bytes]
                with torch.cuda.stream(copy_stream):
                    self._blocks[first_block : first_block + count].copy_(buffer[:count], non_blocking=True)
                # The staging buffer is refilled by the next run: wait until the device has read it.
                copy_stream.synchronize()


PoolBytes = Union["HostPoolBytes", "CudaStagedPoolBytes"]


def pool_bytes(pool: torch.Tensor) -> PoolBytes:
    """Byte access for ``pool``: zero-copy on CPU, pinned staging on CUDA. Raises ValueError otherwise."""
    if pool.device.type == "cpu":
        return HostPoolBytes(pool)
    if pool.device.type == "cuda":
        return CudaStagedPoolBytes(pool)
    raise ValueError(f"KV pool on {pool.device} is not supported (CPU or CUDA)")
