"""TextStream: whole characters only, stop strings cut streaming-safe (reference_server.serving.text_stream).

The oracle is plain string slicing of decoded prefixes. A stop ends the answer when it completes, as an
engine stops generating then: at the first push after which the text decoded so far (whole characters)
contains a stop string, the answer is that text cut before the earliest stop in it; without a stop, it is
the whole text. So the cut depends on where the pushes fall when stop strings overlap: with stops "a" and
"\naa", the text "\naa" pushed as "\na" + "a" ends before the "a" ("\n"), pushed whole it ends before
"\naa" (""), just as an engine generating those tokens would have stopped.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from reference_server.serving.text_stream import TextStream
from reference_server.tokenizer import decode, encode


def _push_ends(token_ids: list[int], cuts: list[int]) -> list[int]:
    """Where the pushes end: each cut (modulo the length), and the end."""
    return sorted({c % (len(token_ids) + 1) for c in cuts} | {len(token_ids)})


def _streamed(token_ids: list[int], stop: tuple[str, ...], cuts: list[int]) -> tuple[list[str], bool]:
    stream = TextStream(stop)
    pieces, start = [], 0
    for end in _push_ends(token_ids, cuts):
        pieces.append(stream.push(token_ids[start:end]))
        start = end
        if stream.stopped:
            break
    pieces.append(stream.flush())
    return pieces, stream.stopped


def test_a_split_character_is_held_until_its_last_byte():
    stream = TextStream()
    euro = encode("€")  # three bytes, three tokens
    assert [stream.push([t]) for t in euro] == ["", "", "€"]
    assert stream.flush() == ""


def test_a_possible_stop_prefix_is_held_then_released_or_cut():
    stream = TextStream(["END"])
    assert stream.push(encode("abcE")) == "abc"  # "E" may start "END"
    assert stream.push(encode("Nx")) == "ENx"  # it did not
    assert stream.push(encode("yEN")) == "y"
    assert stream.push(encode("Dzz")) == "" and stream.stopped
    assert stream.push(encode("more")) == "" and stream.flush() == ""


@given(
    text=st.text(alphabet=st.sampled_from("ab€é\n"), max_size=40),
    stop=st.lists(st.text(alphabet=st.sampled_from("ab€\n"), min_size=1, max_size=3), max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=10),
)
def test_streamed_text_is_the_text_so_far_cut_before_the_first_stop_to_complete(text, stop, cuts):
    token_ids = encode(text)
    expected, expect_stop = decode(token_ids), False
    for end in _push_ends(token_ids, cuts):
        so_far = bytes(token_ids[:end]).decode("utf-8", errors="ignore")  # whole characters only
        positions = [i for i in (so_far.find(s) for s in stop) if i >= 0]
        if positions:
            expected, expect_stop = so_far[: min(positions)], True
            break
    pieces, stopped = _streamed(token_ids, tuple(stop), cuts)
    assert "".join(pieces) == expected
    assert stopped == expect_stop


def test_overlapping_stops_end_the_answer_where_the_first_one_completes():
    assert _streamed(encode("\naa"), ("a", "\naa"), [2]) == (["\n", ""], True)  # "\na", then nothing
    assert _streamed(encode("\naa"), ("a", "\naa"), []) == (["", ""], True)  # whole: "\naa" starts first
