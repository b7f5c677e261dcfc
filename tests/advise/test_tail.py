"""tracer.advise.tail: incremental reading of a growing trace file, checked against the bytes the test
itself wrote (partial lines, appends, a late file, truncation, rotation, protobuf framing)."""

from __future__ import annotations

import os

from tracer.advise.tail import FileTail
from tracer.otlp import TraceFormat


def _line(n: int) -> bytes:
    return b'{"resourceSpans": [], "n": %d}\n' % n


def _append(path, data: bytes) -> None:  # type: ignore[no-untyped-def]
    with open(path, "ab") as handle:
        handle.write(data)


def _numbers(records) -> list[int]:  # type: ignore[no-untyped-def]
    return [int(r.data.rsplit(b":", 1)[1].strip(b" }\n")) for r in records]


def test_appended_lines_are_read_once_each_in_order(tmp_path):
    path = tmp_path / "t.jsonl"
    _append(path, _line(1) + _line(2))
    tail = FileTail(path)
    first = tail.poll()
    assert _numbers(first) == [1, 2] and [r.number for r in first] == [1, 2]
    assert {r.trace_format for r in first} == {TraceFormat.OTLP_JSON}
    assert tail.poll() == []  # nothing new: nothing returned again
    _append(path, _line(3) + b"\n" + _line(4))  # a blank line keeps its number, as iter_records counts
    later = tail.poll()
    assert _numbers(later) == [3, 4] and [r.number for r in later] == [3, 5]
    assert tail.offset_bytes == os.path.getsize(path)


def test_a_partial_last_line_waits_for_its_newline(tmp_path):
    path = tmp_path / "t.jsonl"
    whole = _line(2)
    _append(path, _line(1) + whole[:10])
    tail = FileTail(path)
    assert _numbers(tail.poll()) == [1]
    assert tail.offset_bytes == len(_line(1))  # the offset stops before the partial line
    _append(path, whole[10:-1])  # still no newline
    assert tail.poll() == []
    _append(path, b"\n")
    (record,) = tail.poll()
    assert record.data == whole.rstrip(b"\n") and record.number == 2


def test_a_file_that_appears_later_is_read_from_its_start(tmp_path):
    path = tmp_path / "later.jsonl"
    tail = FileTail(path)
    assert tail.poll() == [] and tail.poll() == []
    _append(path, _line(1))
    assert _numbers(tail.poll()) == [1]


def test_a_truncated_file_is_read_again_from_its_start(tmp_path):
    path = tmp_path / "t.jsonl"
    _append(path, _line(1) + _line(2) + _line(3))
    tail = FileTail(path)
    assert _numbers(tail.poll()) == [1, 2, 3]
    with open(path, "r+b") as handle:  # copytruncate: same inode, emptied, then written anew
        handle.truncate(0)
    _append(path, _line(4))
    records = tail.poll()
    assert _numbers(records) == [4] and records[0].number == 1
    assert tail.truncations == 1 and tail.rotations == 0


def test_rotation_reads_the_old_file_to_its_end_then_the_new_one(tmp_path):
    path = tmp_path / "t.jsonl"
    _append(path, _line(1))
    tail = FileTail(path)
    assert _numbers(tail.poll()) == [1]
    rotated = tmp_path / "t.jsonl.1"
    os.rename(path, rotated)
    _append(rotated, _line(2))  # the writer still held the old file open
    _append(path, _line(3) + _line(4))  # and the new file starts
    records = tail.poll()
    assert _numbers(records) == [2, 3, 4]
    assert [r.number for r in records] == [2, 1, 2]
    assert tail.rotations == 1
    _append(path, _line(5))
    assert _numbers(tail.poll()) == [5]


def test_protobuf_records_wait_until_their_length_is_there(tmp_path):
    path = tmp_path / "t.pb"
    records = [b"\x0a\x01a", b"\x0a\x03bcd"]
    framed = [len(r).to_bytes(4, "big") + r for r in records]
    _append(path, framed[0] + framed[1][:5])
    tail = FileTail(path)
    (first,) = tail.poll()
    assert first.trace_format is TraceFormat.OTLP_PROTO and first.data == records[0] and first.number == 1
    _append(path, framed[1][5:])
    (second,) = tail.poll()
    assert second.data == records[1] and second.number == 2
