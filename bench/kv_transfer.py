"""KV transfer throughput against raw loopback TCP, measured in the same run.

For each stream count and block size, a request's blocks go from a sender pool (this process) into a
receiver pool (a second process, as between two workers): ``KVSender.send`` end to end, header round trip,
checksums and all, against plain ``sendall``/``recv_into`` of the same bytes over the same number of
connections, with no protocol. Source and destination block ids are shuffled, as in fragmented pools, so
every block is its own run. Raw and KV runs alternate. Throughputs are the best of the repeats (other
processes share the machine; the fastest run is the least disturbed), and the ratio of medians is shown
beside the ratio of bests.

Each row also shows the CPU one transfer costs, both processes together (user + system, median over the
repeats): on loopback both ends share the machine's cores, so when the cores are busy the throughput ratio
follows the inverse ratio of CPU per byte. The footer splits KV's extra CPU per MiB into the least the
checksum needs (both ends hash every byte, at the one-core rate printed above) and the rest.

    .venv/bin/python bench/kv_transfer.py                     # the table recorded in bench/RESULTS.md
    .venv/bin/python bench/kv_transfer.py --sizes-mib 64 --repeats 3
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import socket
import statistics
import struct
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy  # noqa: E402
import torch  # noqa: E402

from reference_server.kv_cache import BlockAllocator  # noqa: E402
from reference_server.kv_transfer import KVReceiver, KVSender  # noqa: E402
from reference_server.kv_transfer.wire import new_checksum  # noqa: E402

# A small Llama-like KV shape: 8 layers, 4 KV heads of 128, bf16 -> 16 KiB per token.
LAYERS, KV_HEADS, HEAD_DIM, DTYPE = 8, 4, 128, torch.bfloat16
BYTES_PER_TOKEN = 2 * LAYERS * KV_HEADS * HEAD_DIM * 2
_RAW_HEADER = struct.Struct("!QQ")  # offset, length of one raw stream's share
CHECKSUM_NAME = "xxh3_64 (used)"


def make_pool(num_blocks: int, block_tokens: int, fill: bool) -> torch.Tensor:
    shape = (num_blocks, 2, LAYERS, block_tokens, KV_HEADS, HEAD_DIM)
    if fill:
        return torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(DTYPE)
    return torch.zeros(shape, dtype=DTYPE)


# ------------------------------------------------------------------------------------------------ receiver


def receiver_process(commands: Connection, max_bytes: int) -> None:
    """The receiving worker: a raw TCP sink and one KVReceiver at a time; driven over ``commands``.

    Commands: ("kv", block_tokens, num_blocks) replaces the KVReceiver and answers its address; ("cpu",)
    answers this process's CPU seconds so far (user + system, all threads); ("stop",) ends it.
    """
    raw_sink = bytearray(max_bytes)
    raw_listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=raw_accept_loop, args=(raw_listener, raw_sink), daemon=True).start()
    commands.send(raw_listener.getsockname()[:2])
    receiver: KVReceiver | None = None
    while True:
        command = commands.recv()
        if command[0] == "cpu":
            commands.send(process_cpu_s())
            continue
        if receiver is not None:
            receiver.close()
            receiver = None
        if command[0] == "stop":
            return
        _, block_tokens, num_blocks = command
        allocator = fragmented_allocator(num_blocks, block_tokens)
        receiver = KVReceiver(
            make_pool(num_blocks, block_tokens, fill=False),
            allocate_blocks=allocator.try_allocate,
            free_blocks=allocator.free,
            on_complete=lambda _rid, block_ids, _meta, _info, free=allocator.free: free(block_ids),
            on_failed=lambda rid, reason: print(f"receiver: {rid} failed: {reason}", file=sys.stderr),
        )
        commands.send(receiver.address)


def fragmented_allocator(num_blocks: int, block_tokens: int) -> BlockAllocator:
    """A decode worker's allocator whose free list is shuffled, as in a pool that has served for a while.

    Freed blocks go back in the order they were taken, so every transfer lands on scattered blocks.
    """
    allocator = BlockAllocator(num_blocks, block_tokens)
    block_ids = allocator.allocate(num_blocks)
    random.Random(2).shuffle(block_ids)
    allocator.free(block_ids)
    return allocator


def process_cpu_s() -> float:
    """CPU seconds this process has used, user + system, all threads (ns resolution; os.times has 10 ms)."""
    return time.process_time()


def raw_accept_loop(listener: socket.socket, sink: bytearray) -> None:
    view = memoryview(sink)
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=raw_serve, args=(conn, view), daemon=True).start()


def raw_serve(conn: socket.socket, view: memoryview) -> None:
    header = bytearray(_RAW_HEADER.size)
    with conn:
        while True:
            if conn.recv_into(header, _RAW_HEADER.size, socket.MSG_WAITALL) < _RAW_HEADER.size:
                return
            offset, length = _RAW_HEADER.unpack(header)
            target = view[offset : offset + length]
            received = 0
            while received < length:
                count = conn.recv_into(target[received:])
                if count == 0:
                    return
                received += count
            conn.sendall(b"k")


# ------------------------------------------------------------------------------------------------ sender


class RawSender:
    """The baseline: N persistent connections, each sends its share and waits for a one-byte ack."""

    def __init__(self, address: tuple[str, int], streams: int, executor: ThreadPoolExecutor) -> None:
        self._connections = [socket.create_connection(address) for _ in range(streams)]
        for conn in self._connections:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._executor = executor

    def send(self, payload: memoryview) -> float:
        """Seconds to move ``payload`` and have every share acknowledged."""
        count = len(self._connections)
        bounds = [len(payload) * k // count for k in range(count + 1)]
        start = time.perf_counter()
        futures = [
            self._executor.submit(self._send_share, self._connections[k], payload, bounds[k], bounds[k + 1])
            for k in range(1, count)
        ]
        self._send_share(self._connections[0], payload, bounds[0], bounds[1])
        for future in futures:
            future.result()
        return time.perf_counter() - start

    @staticmethod
    def _send_share(conn: socket.socket, payload: memoryview, begin: int, end: int) -> None:
        conn.sendall(_RAW_HEADER.pack(begin, end - begin))
        conn.sendall(payload[begin:end])
        if conn.recv(1) != b"k":
            raise RuntimeError("raw receiver did not acknowledge")

    def close(self) -> None:
        for conn in self._connections:
            conn.close()


def both_processes_cpu_s(commands: Connection) -> float:
    """CPU seconds so far of both ends of the loopback transfers: this process and the receiver child."""
    commands.send(("cpu",))
    return process_cpu_s() + commands.recv()


def checksum_rates_gb_s(size_bytes: int = 64 << 20) -> dict[str, float]:
    data = memoryview(numpy.random.default_rng(1).bytes(size_bytes))  # zero pages would flatter the rates

    def xxh3() -> None:
        checksum = new_checksum()
        checksum.update(data)
        checksum.intdigest()

    rates = {}
    for name, run in ((CHECKSUM_NAME, xxh3), ("zlib.crc32", lambda: zlib.crc32(data))):
        best = min(_timed(run) for _ in range(3))
        rates[name] = size_bytes / best / 1e9
    return rates


def _timed(run) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--block-tokens", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--repeats", type=int, default=7, help="runs of each kind per row")
    args = parser.parse_args()
    if min(args.streams) < 1 or min(args.block_tokens) < 1 or min(args.sizes_mib) < 1 or args.repeats < 1:
        parser.error("streams, block tokens, sizes and repeats must be positive")

    max_bytes = max(args.sizes_mib) << 20
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    child = context.Process(target=receiver_process, args=(theirs, max_bytes), daemon=True)
    child.start()
    raw_address = tuple(ours.recv())
    payload = memoryview(numpy.random.default_rng(0).bytes(max_bytes))
    executor = ThreadPoolExecutor(max_workers=max(args.streams))

    print(
        f"# KV transfer vs raw loopback TCP ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads, "
        f"{BYTES_PER_TOKEN} B/token)"
    )
    checksum_rates = checksum_rates_gb_s()
    for name, rate in checksum_rates.items():
        print(f"# checksum {name}: {rate:.1f} GB/s on one core")
    print(
        "| streams | block tokens | block KiB | transfer MiB | raw GB/s | KV GB/s | KV / raw | KV / raw (medians) "
        "| raw core-ms | KV core-ms |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    ratios_at_64mib: list[float] = []
    raw_core_ms_per_mib: list[float] = []
    kv_core_ms_per_mib: list[float] = []
    try:
        for block_tokens in args.block_tokens:
            block_bytes = block_tokens * BYTES_PER_TOKEN
            max_blocks = max(1, max_bytes // block_bytes)
            ours.send(("kv", block_tokens, 2 * max_blocks))
            kv_address = tuple(ours.recv())
            src_pool = make_pool(2 * max_blocks, block_tokens, fill=True)
            for size_mib in args.sizes_mib:
                blocks = max(1, (size_mib << 20) // block_bytes)
                for streams in args.streams:
                    raw = RawSender(raw_address, streams, executor)
                    with KVSender(streams=streams) as sender:
                        src_ids = random.Random(blocks + streams).sample(range(2 * max_blocks), blocks)
                        sender.send("warmup", src_pool, src_ids, kv_address)  # connections + clock offset
                        raw.send(payload[: blocks * block_bytes])
                        raw_s, kv_s, raw_cpu_s, kv_cpu_s = [], [], [], []
                        for repeat in range(args.repeats):
                            cpu_before_s = both_processes_cpu_s(ours)
                            raw_s.append(raw.send(payload[: blocks * block_bytes]))
                            cpu_between_s = both_processes_cpu_s(ours)
                            result = sender.send(f"r{repeat}", src_pool, src_ids, kv_address)
                            kv_cpu_s.append(both_processes_cpu_s(ours) - cpu_between_s)
                            raw_cpu_s.append(cpu_between_s - cpu_before_s)
                            kv_s.append(result.duration_s)
                    raw.close()
                    nbytes = blocks * block_bytes
                    raw_rate = nbytes / min(raw_s) / 1e9
                    kv_rate = nbytes / min(kv_s) / 1e9
                    median_ratio = statistics.median(raw_s) / statistics.median(kv_s)
                    raw_core_ms = statistics.median(raw_cpu_s) * 1e3
                    kv_core_ms = statistics.median(kv_cpu_s) * 1e3
                    if size_mib >= 64:
                        ratios_at_64mib.append(kv_rate / raw_rate)
                        raw_core_ms_per_mib.append(raw_core_ms / (nbytes / (1 << 20)))
                        kv_core_ms_per_mib.append(kv_core_ms / (nbytes / (1 << 20)))
                    print(
                        f"| {streams} | {block_tokens} | {block_bytes >> 10} | {nbytes / (1 << 20):.0f} "
                        f"| {raw_rate:.2f} | {kv_rate:.2f} | {kv_rate / raw_rate:.2f} | {median_ratio:.2f} "
                        f"| {raw_core_ms:.1f} | {kv_core_ms:.1f} |",
                        flush=True,
                    )
    finally:
        ours.send(("stop",))
        child.join(10)
        executor.shutdown()
    if ratios_at_64mib:
        print(
            f"# KV / raw (bests) for transfers >= 64 MiB: median {statistics.median(ratios_at_64mib):.2f}, "
            f"min {min(ratios_at_64mib):.2f} (target >= 0.8)"
        )
        # Both ends hash every byte once; at the one-core rate that is a floor on the checksum's CPU.
        checksum_core_ms_per_mib = 2 * (1 << 20) / (checksum_rates[CHECKSUM_NAME] * 1e9) * 1e3
        raw_per_mib = statistics.median(raw_core_ms_per_mib)
        kv_per_mib = statistics.median(kv_core_ms_per_mib)
        print(
            f"# CPU per MiB moved (>= 64 MiB rows, median): raw {raw_per_mib:.3f} core-ms, KV {kv_per_mib:.3f}; "
            f"of KV's extra {kv_per_mib - raw_per_mib:.3f}, the checksum needs at least {checksum_core_ms_per_mib:.3f} "
            "(both ends, at the one-core rate)"
        )


if __name__ == "__main__":
    main()
