"""splitscope's tracer: per-stage timing on the serving hot path, spans and metrics off it.

Engine code imports from here only: `start_tracing` (once per process), then the returned session's
`tracer` (a `Tracer`: `RecordingTracer`, or `NoopTracer` when tracing is off) and `TraceContext` for
propagation. Importing this package loads neither the OpenTelemetry SDK, prometheus_client, numpy nor
torch: the local export path loads the first three when `start_tracing` chooses it, torch is loaded only
for CUDA-event timing.
"""

from tracer.api import NoopTracer, RecordingTracer, Tracer
from tracer.context import TraceContext
from tracer.session import TracingSession, start_tracing

__all__ = ["NoopTracer", "RecordingTracer", "TraceContext", "Tracer", "TracingSession", "start_tracing"]
