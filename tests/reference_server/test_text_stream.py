"""TextStream: whole characters only, stop strings cut streaming-safe (reference_server.text_stream).

The oracle is plain string slicing of the whole decoded text: however the tokens are split into pushes,
the concatenated output must equal `full[:first stop]` (or `full` without a stop).
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from reference_server.text_stream import TextStream
from reference_server.tokenizer import decode, encode


def _streamed(token_ids: list[int], stop: tuple[str, ...], cuts: list[int]) -> tuple[list[str], bool]:
    stream = TextStream(stop)
    pieces, start = [], 0
    for end in sorted({c % (len(token_ids) + 1) for c in cuts} | {len(token_ids)}):
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
def test_streamed_text_is_the_whole_text_cut_before_the_first_stop(text, stop, cuts):
    token_ids = encode(text)
    full = decode(token_ids)
    positions = [i for i in (full.find(s) for s in stop) if i >= 0]
    expected = full[: min(positions)] if positions else full
    pieces, stopped = _streamed(token_ids, tuple(stop), cuts)
    assert "".join(pieces) == expected
    assert stopped == bool(positions)
