"""The verdict's reasons read right: no doubled labels, and a loss is called a loss."""

from __future__ import annotations

from tracer.report.decide import decide
from tracer.report.goodput import GoodputResult
from tracer.report.simulate import Layout
from tracer.vocabulary import Verdict


def _result(layout: Layout, goodput_per_gpu: float) -> GoodputResult:
    return GoodputResult(layout, goodput_per_gpu * layout.gpus, goodput_per_gpu, None, 1)


def test_reasons_name_each_layout_once_and_say_below_for_a_loss():
    colocated = Layout("colocated", workers=2)
    results = [
        _result(colocated, 1.0),
        _result(Layout("chunked", workers=2, chunk_budget_tokens=256), 1.05),
        _result(Layout("disaggregated", prefill_workers=1, decode_workers=1), 0.51),
    ]
    decision = decide(colocated, results, margin=0.15)
    assert decision.verdict == Verdict.STAY_COLOCATED
    text = " | ".join(decision.reasons)
    assert "split split" not in text and "chunked chunked" not in text, text
    assert (
        "the best split (split 1:1: 0.51 req/s/GPU) is 51% below the best single pool (chunked 256 x2: 1.05 req/s/GPU)"
        in text
    )
    assert "(colocated x2: 1 req/s/GPU) by only 5%, under the 15% margin" in text
    assert "+15%" not in text and "(-51%)" not in text
