"""tracer.records: the bounded ring drops oldest, counts drops, wakes the consumer, resets after fork."""

from __future__ import annotations

import os

import pytest

from tracer.records import RecordRing


def test_ring_drops_oldest_and_counts():
    ring = RecordRing(capacity=4)
    for i in range(10):
        ring.push(i)
    assert ring.dropped == 6
    assert ring.drain(100) == [6, 7, 8, 9]
    assert len(ring) == 0


def test_ring_wakes_consumer_at_half_full():
    ring = RecordRing(capacity=8)
    for i in range(4):
        ring.push(i)
    assert not ring.wakeup.is_set()
    ring.push(4)
    assert ring.wakeup.is_set()


def test_drain_respects_max_items_in_order():
    ring = RecordRing(capacity=16)
    for i in range(5):
        ring.push(i)
    assert ring.drain(2) == [0, 1]
    assert ring.drain(10) == [2, 3, 4]


def test_capacity_must_hold_two():
    with pytest.raises(ValueError, match="at least 2"):
        RecordRing(capacity=1)


def test_child_after_fork_starts_empty():
    ring = RecordRing(capacity=4)
    for i in range(6):
        ring.push(i)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report what it sees, then leave without running the parent's atexit hooks
        os.close(read)
        os.write(write, f"{len(ring)},{ring.dropped}".encode())
        os._exit(0)
    os.close(write)
    child_view = os.read(read, 100).decode()
    os.waitpid(pid, 0)
    assert child_view == "0,0"
    assert len(ring) == 4 and ring.dropped == 2
