"""GPU check of the CUDA-event clock (needs an NVIDIA GPU; exits 2 with one line without one).

1. Times a prefill-sized matmul ([tokens, d] @ [d, d], bf16) and a decode-sized one ([batch, d] @ [d, d])
   through `CudaEventClock` (marks around each, resolved with `query()` by the pipeline's rule) and compares
   the per-iteration duration with the kernel times torch.profiler records for the same iterations.
   Target: within 5%.
2. Runs a traced decode-like loop (marks, step records, token times, the anchor after the host copy)
   under `torch.cuda.set_sync_debug_mode("error")`: any synchronisation the tracer adds raises. The only
   host wait allowed is the loop's own `.tolist()` of sampled tokens, done with sync debug off for that
   line, exactly where an engine already waits.

    python bench/gpu_check.py [--iters 50]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from array import array

import torch


def kernel_ms_by_iteration(prof, count: int) -> float:
    """Mean device time per iteration of the profiled region's CUDA kernels (ms)."""
    total_us = sum(
        e.device_time_total for e in prof.key_averages() if e.device_time_total > 0 and e.key != "ProfilerStep*"
    )
    return total_us / 1000 / count


def time_with_events(clock, fn, iters: int) -> list[float]:
    """Per-iteration durations (ms) from the event clock, resolved without synchronising."""
    pairs = []
    for _ in range(iters):
        start = clock.mark()
        fn()
        pairs.append((start, clock.mark()))
    results: list[float] = []
    deadline = time.monotonic() + 30
    while pairs and time.monotonic() < deadline:  # poll as the pipeline does: query(), never synchronize()
        remaining = []
        for start, end in pairs:
            interval = clock.resolve(start, end, time.perf_counter_ns())
            if interval is None:
                remaining.append((start, end))
            else:
                results.append((interval.end_wall_ns - interval.start_wall_ns) / 1e6)
        pairs = remaining
    if pairs:
        raise RuntimeError(f"{len(pairs)} event pairs never completed")
    return results


def check_durations(iters: int) -> bool:
    from torch.profiler import ProfilerActivity, profile

    from tracer.timing import SOURCE_CUDA, CudaEventClock

    clock = CudaEventClock()
    d = 4096
    w = torch.randn(d, d, device="cuda", dtype=torch.bfloat16)
    shapes = {
        "prefill (2048 tokens)": torch.randn(2048, d, device="cuda", dtype=torch.bfloat16),
        "decode (batch 32)": torch.randn(32, d, device="cuda", dtype=torch.bfloat16),
    }
    ok = True
    for label, x in shapes.items():

        def fn(x=x):
            return x @ w

        for _ in range(10):
            fn()
        torch.cuda.synchronize()  # setup only: outside the measured, traced region
        event_ms = statistics.median(time_with_events(clock, fn, iters))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                fn()
            torch.cuda.synchronize()
        kernel_ms = kernel_ms_by_iteration(prof, iters)
        error = abs(event_ms - kernel_ms) / kernel_ms
        ok &= error <= 0.05
        print(
            f"{label:24s} events {event_ms:8.4f} ms  profiler kernels {kernel_ms:8.4f} ms  "
            f"difference {error * 100:5.2f}% (target <= 5%)  source={SOURCE_CUDA}"
        )
    return ok


def check_no_sync(steps: int) -> bool:
    from tracer import TraceContext, start_tracing

    session = start_tracing("colocated", "w0", device="cuda", processors=[])
    tracer = session.tracer
    d, batch = 4096, 32
    w = torch.randn(d, d, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(batch, d, device="cuda", dtype=torch.bfloat16)
    ctx = TraceContext.new_root().child(1)
    times, prefill = array("q"), array("i")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        start = tracer.mark()
        for _ in range(steps):
            t0 = tracer.mark()
            h = x @ w
            tokens_device = h.argmax(dim=-1)
            t1 = tracer.mark()
            torch.cuda.set_sync_debug_mode("default")  # the engine's own wait, not the tracer's
            tokens_device.tolist()
            torch.cuda.set_sync_debug_mode("error")
            tracer.clock.anchor()
            times.append(time.perf_counter_ns())
            prefill.append(0)
            tracer.step(t0, t1, batch, 0, 1024 * batch)
        tracer.decode(ctx, start, tracer.mark(), times, prefill, {})
    except RuntimeError as exc:
        print(f"tracer synchronised the device: {exc}")
        return False
    finally:
        torch.cuda.set_sync_debug_mode("default")
    session.shutdown(10.0)
    sources = session.pipeline.emitted
    print(
        f"traced loop of {steps} steps under set_sync_debug_mode('error'): no synchronisation; {sources} spans emitted"
    )
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run it on a machine with an NVIDIA GPU", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    ok = check_durations(args.iters)
    ok &= check_no_sync(args.steps)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
