"""tracer.records: the bounded ring drops oldest, counts drops from sequence gaps, resets after fork."""

from __future__ import annotations

import os
import threading

import pytest

from tracer.records import RecordRing


def push(ring: RecordRing, value: int) -> None:
    ring.append((value, next(ring.seq)))  # the hot path's shape: sequence number last


def test_ring_drops_oldest_and_counts():
    ring = RecordRing(capacity=4)
    for i in range(10):
        push(ring, i)
    assert [r[0] for r in ring.drain(100)] == [6, 7, 8, 9]
    assert ring.dropped == 0  # settled one drain later: a late producer may still append 0..5
    ring.drain(100)
    assert ring.dropped == 6
    assert len(ring) == 0


def test_drain_respects_max_items_in_order_and_counts_no_drop_without_overflow():
    ring = RecordRing(capacity=16)
    for i in range(5):
        push(ring, i)
    assert [r[0] for r in ring.drain(2)] == [0, 1]
    assert [r[0] for r in ring.drain(10)] == [2, 3, 4]
    assert ring.dropped == 0


def test_drops_across_several_drains_accumulate():
    ring = RecordRing(capacity=4)
    for round_ in range(3):
        for i in range(6):
            push(ring, i)
        ring.drain(100)
    ring.settle_all()
    assert ring.dropped == 6


def test_concurrent_producers_lose_nothing_but_the_counted_drops():
    ring = RecordRing(capacity=1 << 16)
    drained = []
    stop = threading.Event()

    def consume():
        while not stop.is_set() or len(ring):
            drained.extend(ring.drain(1024))

    consumer = threading.Thread(target=consume)
    consumer.start()
    producers = [threading.Thread(target=lambda: [push(ring, i) for i in range(20_000)]) for _ in range(3)]
    for p in producers:
        p.start()
    for p in producers:
        p.join()
    stop.set()
    consumer.join()
    ring.settle_all()
    assert len(drained) == 60_000
    assert ring.dropped == 0


def test_a_late_append_from_another_producer_is_not_counted_as_dropped():
    ring = RecordRing(capacity=8)
    late = next(ring.seq)  # a producer took its number, then lost the CPU before appending
    push(ring, 1)
    push(ring, 2)
    ring.drain(10)
    ring.append(("late", late))
    assert [r[0] for r in ring.drain(10)] == ["late"]
    ring.settle_all()
    assert ring.dropped == 0


def test_capacity_must_hold_two():
    with pytest.raises(ValueError, match="at least 2"):
        RecordRing(capacity=1)


def test_child_after_fork_starts_empty():
    ring = RecordRing(capacity=4)
    for i in range(6):
        push(ring, i)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report what it sees, then leave without running the parent's atexit hooks
        os.close(read)
        push(ring, 99)
        os.write(write, f"{len(ring)},{[r[1] for r in ring.drain(10)]}".encode())
        os._exit(0)
    os.close(write)
    child_view = os.read(read, 100).decode()
    os.waitpid(pid, 0)
    assert child_view == "1,[0]"  # empty ring, fresh sequence
    assert len(ring) == 4
    ring.drain(10)
    ring.settle_all()
    assert ring.dropped == 2
