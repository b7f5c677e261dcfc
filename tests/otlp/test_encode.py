"""The fast OTLP/JSON line encoder writes exactly what tracer.export.otel.encode_line writes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tracer import spans as s
from tracer.export.otel import encode_line, make_resource, to_readable_span
from tracer.otlp.encode import LineEncoder, resource_prefix

RESOURCE = make_resource("svc", {"deployment.environment": "test", "ports": [1, 2]})


def _reference(spans: list[s.SpanData]) -> bytes:
    return encode_line([to_readable_span(d, RESOURCE) for d in spans])


def _fast(spans: list[s.SpanData]) -> bytes:
    return LineEncoder().line(resource_prefix(RESOURCE.attributes), spans)


def test_contract_spans_encode_identically():
    spans = [
        s.SpanData(
            "text_completion tiny",
            s.KIND_SERVER,
            0xABC,
            0xDEF1,
            0x12,
            1000,
            2000,
            {s.ATTR_MODEL: "tiny", s.ATTR_INPUT_TOKENS: 100, s.ATTR_TTFT_S: 0.052, "none": None},
        ),
        s.SpanData(
            s.SPAN_DECODE,
            s.KIND_INTERNAL,
            0xABC,
            0xDEF2,
            0xDEF1,
            1500,
            2000,
            {s.ATTR_POOL: "decode", s.ATTR_DECODE_ITL_P99_S: float("nan"), "inf": float("-inf")},
            events=[(s.EVENT_DECODE_STALL, 1700, {"gap_s": 0.07, "prefill_tokens": 2000}), ("", 0, {})],
            links=[(0xABD, 0x77, {s.ATTR_LINK_STALLED_NS: 70_000_000, s.ATTR_LINK_PREFILL_TOKENS: 2000}), (1, 2, {})],
        ),
        s.SpanData(
            s.SPAN_KV_TRANSFER,
            s.KIND_INTERNAL,
            0xABC,
            0xDEF3,
            0xDEF1,
            1500,
            1600,
            {"error.type": "stale", s.ATTR_KV_BYTES: 1 << 40},
            error_type="checksum",
        ),
        s.SpanData("x", s.KIND_INTERNAL, 1, 2, 0, 0, 0, {}, error_type='boom \u00e9"\n'),
        s.SpanData(
            "nested",
            s.KIND_INTERNAL,
            1,
            3,
            0,
            5,
            6,
            {"kv": {"a": [1, "b", True]}, "e": [], "bytes": b"\x00\x01", "t": (1.5,)},
        ),
    ]
    assert _fast(spans) == _reference(spans)


_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.lists(st.one_of(st.integers(-100, 100), st.text(max_size=3), st.floats()), max_size=3),
)
_spans = st.builds(
    s.SpanData,
    name=st.text(min_size=1, max_size=12),
    kind=st.sampled_from([1, 2]),
    trace_id=st.integers(1, 2**128 - 1),
    span_id=st.integers(1, 2**64 - 1),
    parent_span_id=st.integers(0, 2**64 - 1),
    start_ns=st.integers(0, 2**62),
    end_ns=st.integers(2**62, 2**63 - 1),
    attributes=st.dictionaries(st.text(min_size=1, max_size=10), _values, max_size=6),
    events=st.lists(
        st.tuples(
            st.text(max_size=5),
            st.integers(0, 2**62),
            st.dictionaries(st.text(min_size=1, max_size=4), _values, max_size=2),
        ),
        max_size=2,
    ),
    error_type=st.one_of(st.just(""), st.text(max_size=6)),
    links=st.lists(
        st.tuples(
            st.integers(1, 2**128 - 1),
            st.integers(1, 2**64 - 1),
            st.dictionaries(st.text(min_size=1, max_size=4), _values, max_size=2),
        ),
        max_size=2,
    ),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_spans, min_size=1, max_size=4))
def test_any_span_data_encodes_identically(spans):
    assert _fast(spans) == _reference(spans)
