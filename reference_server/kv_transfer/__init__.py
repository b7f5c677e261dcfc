"""KV cache transfer from a prefill worker's pool to a decode worker's pool over parallel TCP streams.

The public API of the transfer; import from here. ``KVSender.send`` (send.py) stripes a
request's blocks over N streams; ``KVReceiver`` (recv.py) allocates destination blocks when a
transfer's first header arrives and ``recv_into``s each share straight into its pool. Wire format and
validation: wire.py; clock offset: clock.py; byte access to pools: pool.py; a prefill worker's handoff threads: handoff.py.

Failure contract: a checksum mismatch, a dropped connection, a timeout or a refused header fails the whole
transfer. The receiver frees its destination blocks (once no stream writes into them any more) and calls
``on_failed``; the sender raises ``KVTransferError(reason)``, ``reason`` in ``FAILURE_REASONS`` (the
labels of ``splitscope_kv_transfer_failures_total``), and its caller frees the source blocks.
"""

from __future__ import annotations

from reference_server.kv_transfer.clock import ClockEstimate
from reference_server.kv_transfer.recv import KVReceiver, ReceiveInfo
from reference_server.kv_transfer.send import DEFAULT_STREAMS, KVSender, TransferResult
from reference_server.kv_transfer.wire import FAILURE_REASONS, TOKEN_ENV_VAR, KVTransferError

__all__ = [
    "DEFAULT_STREAMS",
    "FAILURE_REASONS",
    "TOKEN_ENV_VAR",
    "ClockEstimate",
    "KVReceiver",
    "KVSender",
    "KVTransferError",
    "ReceiveInfo",
    "TransferResult",
]
