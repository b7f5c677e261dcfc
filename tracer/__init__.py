"""splitscope's tracer: per-stage timing on the serving hot path, spans and metrics off it.

Engine code imports from here only: `start_tracing` (once per process), then the returned session's
`tracer` (`Tracer`, or `NoopTracer` when tracing is off) and `TraceContext` for propagation.
"""

from tracer.api import NoopTracer, Tracer
from tracer.session import TracingSession, start_tracing
from tracer.spans import TraceContext

__all__ = ["NoopTracer", "TraceContext", "Tracer", "TracingSession", "start_tracing"]
