"""Property-based fuzzing of the trace-file loader: any bytes give spans or one TraceFileError, never
another exception, and valid lines around a bad one are never lost with --skip-bad."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tracer.otlp import ReadStats, TraceFileError, iter_spans

FUZZ_CASES = 400

GOOD_LINE = json.dumps(
    {
        "resourceSpans": [
            {
                "resource": {"attributes": []},
                "scopeSpans": [
                    {
                        "spans": [
                            {
                                "traceId": "0af7651916cd43dd8448eb211c80319c",
                                "spanId": "b7ad6b7169203331",
                                "name": "splitscope.prefill",
                                "kind": 1,
                                "startTimeUnixNano": "1",
                                "endTimeUnixNano": "2",
                                "attributes": [{"key": "splitscope.prefill.tokens", "value": {"intValue": "7"}}],
                            }
                        ]
                    }
                ],
            }
        ]
    }
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=20,
)
span_like = st.fixed_dictionaries(
    {},
    optional={
        "traceId": st.text(max_size=40) | st.just("0af7651916cd43dd8448eb211c80319c"),
        "spanId": st.text(max_size=20) | st.just("b7ad6b7169203331"),
        "parentSpanId": st.text(max_size=20),
        "name": json_values,
        "kind": json_values,
        "startTimeUnixNano": json_values,
        "endTimeUnixNano": json_values,
        "attributes": json_values,
        "events": json_values,
        "status": json_values,
    },
)
otlp_like = st.builds(
    lambda spans, extra: {"resourceSpans": [{"resource": {"attributes": extra}, "scopeSpans": [{"spans": spans}]}]},
    st.lists(span_like, max_size=3),
    json_values,
)
bad_lines = (
    st.binary(max_size=200).filter(lambda b: b"\n" not in b)
    | otlp_like.map(lambda o: json.dumps(o).encode())
    | json_values.map(lambda v: json.dumps(v).encode())
)


@settings(max_examples=FUZZ_CASES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(line=bad_lines)
def test_any_line_gives_spans_or_one_trace_file_error(tmp_path, line):
    path = tmp_path / "fuzz.jsonl"
    path.write_bytes(GOOD_LINE.encode() + b"\n" + line + b"\n" + GOOD_LINE.encode() + b"\n")
    try:
        spans = list(iter_spans([path]))
    except TraceFileError as error:
        assert error.line_number == 2
        stats = ReadStats()
        kept = list(iter_spans([path], skip_bad=True, stats=stats))
        assert stats.skipped_lines == 1 and len(kept) == 2  # the good lines around it survive
    else:
        assert len(spans) >= 2
        for span in spans:
            assert len(span.trace_id) == 32 and len(span.span_id) == 16 and isinstance(span.attributes, dict)
            assert isinstance(span.name, str) and isinstance(span.start_ns, int) and isinstance(span.end_ns, int)
