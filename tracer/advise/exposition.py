"""`advise --metrics-port`: the held advice as Prometheus series (families in tracer.metrics.AdviceMetrics).

`AdviceExporter.publish` is called once per closed window. `splitscope_advice_info` keeps one series per
namespace: when the held advice (or the deployed layout) changes, the old labels are removed before the new
ones are set, so a query never sees two advices at once. Gain, confidence and requests are the last closed
window's (gain and confidence: the last window that decided something; confidence is absent while the
bootstrap is off). `splitscope_advice_decisions_total{reason}` counts windows by AdviceReason, every reason
created at 0 on the first publish so `increase()` sees the first of each.

Thread: publish from one thread (the advisor's loop); prometheus_client serves the scrape on its own.
"""

from __future__ import annotations

from tracer.advise.build import Advice, WindowAdvice
from tracer.advise.deployed import Shape, advised_shape, differs
from tracer.metrics import AdviceMetrics
from tracer.vocabulary import AdviceReason


def target(advice: Advice | WindowAdvice) -> str:
    """The `target` label: the ratio ("1:3"), the chunk budget in tokens ("512"), or ""."""
    if advice.ratio:
        return advice.ratio
    if advice.chunk_budget_tokens:
        return str(advice.chunk_budget_tokens)
    return ""


class AdviceExporter:
    def __init__(self, metrics: AdviceMetrics) -> None:
        self.metrics = metrics
        self._info_labels: tuple[str, str, str, str] | None = None
        self._namespaces: set[str] = set()

    def publish(
        self, namespace: str, window: WindowAdvice, held: Advice, deployed: Shape | None, reason: AdviceReason
    ) -> None:
        m = self.metrics
        if namespace not in self._namespaces:
            self._namespaces.add(namespace)
            for each in AdviceReason:
                m.decisions.labels(namespace, each)
        labels = (namespace, held.verdict, target(held), deployed.label if deployed else "")
        if labels != self._info_labels:
            if self._info_labels is not None:
                m.info.remove(*self._info_labels)
            m.info.labels(*labels).set(1)
            self._info_labels = labels
        advised = advised_shape(held.verdict, held.ratio, held.chunk_budget_tokens)
        m.differs.labels(namespace).set(1 if differs(advised, deployed) else 0)
        m.window_requests.labels(namespace).set(window.requests)
        if window.gain is not None:
            m.gain.labels(namespace).set(window.gain)
        if window.confidence is not None:
            m.confidence.labels(namespace).set(window.confidence)
        elif window.key is not None:
            try:
                m.confidence.remove(namespace)
            except KeyError:
                pass  # never set
        m.decisions.labels(namespace, reason).inc()
