"""A prefill worker's KV handoff: transfer threads that ship finished prompts' KV to decode workers.

The engine thread calls `KVHandoff.__call__` when a prompt is done; it only puts a job on a bounded queue
(`queue.Full` when it is at its bound, which fails that one request). A few transfer threads take jobs,
send the blocks with `KVSender.send` (blocking, never on the engine thread), record the
`splitscope.kv_transfer` span and its `.send` child, give the blocks back through
`engine.finish_handoff` after success or failure, and deliver the outcome to the request's sink.

The kv_transfer span id is chosen before sending and travels as the parent in the transfer header's
`traceparent`, so the decode worker's `.recv` span hangs under it.

The kv_transfer stage runs from the prefill's end (`handoff_wall_ns`, the host time of the prefill span's
end mark) to the moment the receiver had the last byte checked (`TransferResult.receiver_end_wall_ns`,
moved onto this clock by the transfer's clock offset); the decode worker starts decoding after that, so
the stages never overlap. The `.send` child is the sender's own view: it ends when the last stream's
acknowledgement arrived, which may be after the decode worker already took the request over.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from reference_server.engine import EVENT_ERROR, KV_REFUSED, Deliver, Engine, Tracked, kv_attributes
from reference_server.kv_transfer import KVSender, KVTransferError
from reference_server.kv_transfer.wire import ABORTED
from tracer import spans as s

log = logging.getLogger(__name__)

EVENT_TRANSFERRED = "transferred"  # (EVENT_TRANSFERRED, first_token_id, info dict)


class KVHandoff:
    """Transfer threads of one prefill worker. `__call__` runs on the engine thread and never blocks."""

    def __init__(
        self,
        engine: Engine,
        sender: KVSender,
        tracer: Any,
        deliver: Deliver,
        *,
        worker: str,
        streams: int,
        threads: int = 4,
        max_queued: int = 256,
        clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        """`clock_ns` is the wall clock the sender times with (the tracer's, so the spans compare exactly)."""
        self.engine = engine
        self.sender = sender
        self.tracer = tracer
        self.deliver = deliver
        self.worker = worker
        self.streams = streams
        self._clock_ns = clock_ns
        self._jobs: queue.Queue[tuple[Tracked, int, int] | None] = queue.Queue(maxsize=max_queued)
        self._threads = [
            threading.Thread(target=self._run, name=f"kv-handoff-{i}", daemon=True) for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    def __call__(self, tracked: Tracked, first_token_id: int, handoff_wall_ns: int) -> None:
        """Engine thread: queue the transfer of `tracked`'s prompt KV. Raises queue.Full at the bound."""
        self._jobs.put_nowait((tracked, first_token_id, handoff_wall_ns))

    def close(self, timeout_s: float = 5.0) -> None:
        """Let queued transfers finish, then stop the threads (bounded wait)."""
        for _ in self._threads:
            try:
                self._jobs.put(None, timeout=timeout_s)
            except queue.Full:
                break
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._transfer(*job)
            except Exception:  # never lose a transfer thread to a bug
                log.exception("KV handoff failed unexpectedly")

    def _transfer(self, t: Tracked, first_token_id: int, handoff_wall_ns: int) -> None:
        request = t.request
        seq = t.seq
        assert seq is not None and seq.block_table is not None and t.kv_dst is not None
        kv_span_id = s.new_span_id()
        kv_ctx = t.ctx.child(kv_span_id)
        meta = {
            "first_token_id": first_token_id,
            "prompt_tokens": len(request.prompt_token_ids),
            "cached_tokens": seq.num_cached_tokens,
            "prefill_chunks": seq.num_prefill_chunks,
            "src_worker": self.worker,
        }
        result = None
        error_type = ""
        detail = ""
        try:
            result = self.sender.send(
                request.request_id,
                self.engine.kv_pool.tensor,
                list(seq.block_table.block_ids),
                t.kv_dst,
                kv_ctx.traceparent(),
                meta,
                streams=self.streams,
            )
        except KVTransferError as exc:
            error_type, detail = exc.reason, str(exc)
        except (ValueError, OSError) as exc:
            error_type, detail = "connection", f"{type(exc).__name__}: {exc}"
        finally:
            self.engine.finish_handoff(request.request_id)  # the source blocks go back either way
        dst = t.kv_dst_worker or f"{t.kv_dst[0]}:{t.kv_dst[1]}"
        if result is not None:
            # The stage ends where the decode worker holds the KV, not at the acknowledgement: by then
            # the decode worker may already have sent the first token.
            end_wall_ns = result.receiver_end_wall_ns
            attrs = kv_attributes(result, src=self.worker, dst=dst)
            self.tracer.stage_wall("kv_transfer", t.ctx, handoff_wall_ns, end_wall_ns, attrs, span_id=kv_span_id)
            self.tracer.stage_wall("kv_transfer.send", kv_ctx, result.start_wall_ns, result.end_wall_ns, attrs)
            info = {
                "prompt_tokens": len(request.prompt_token_ids),
                "cached_tokens": seq.num_cached_tokens,
                "prefill_chunks": seq.num_prefill_chunks,
                "kv_bytes": result.kv_bytes,
            }
            self.deliver([(t.sink, (EVENT_TRANSFERRED, first_token_id, info))])
            return
        if error_type == ABORTED:  # the client left and the decode worker cut the transfer: not a failure
            log.info("KV transfer of %s to %s cut: its request was aborted", request.request_id, dst)
            self.deliver([(t.sink, (EVENT_ERROR, 499, ABORTED, "the request was aborted"))])
            return
        log.warning("KV transfer of %s to %s failed: %s", request.request_id, dst, detail)
        end_wall_ns = self._clock_ns()
        attrs = {s.ATTR_KV_SRC: self.worker, s.ATTR_KV_DST: dst, s.ATTR_KV_STREAMS: self.streams}
        self.tracer.stage_wall(
            "kv_transfer", t.ctx, handoff_wall_ns, end_wall_ns, attrs, span_id=kv_span_id, error_type=error_type
        )
        if error_type == KV_REFUSED:  # the decode worker is out of KV room: capacity, retryable
            self.deliver([(t.sink, (EVENT_ERROR, 503, "overloaded", f"KV transfer refused: {detail}"))])
        else:
            self.deliver([(t.sink, (EVENT_ERROR, 500, "kv_transfer", f"KV transfer failed ({error_type}): {detail}"))])
