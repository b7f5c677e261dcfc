"""Clock offset between a KV sender and its receiver, NTP-style (four timestamps per exchange).

t0: sender sends, t1: receiver receives, t2: receiver answers, t3: sender receives; t0 and t3 on the
sender's clock, t1 and t2 on the receiver's (both ``time.time_ns()``-like wall clocks, nanoseconds).

    offset = ((t1 - t0) + (t2 - t3)) / 2     receiver clock minus sender clock
    delay  = (t3 - t0) - (t2 - t1)           round trip on the wire, without the receiver's own time

The error of one offset sample is at most delay / 2, so of several samples the one with the smallest delay
is kept (NTP's clock filter in its simplest form). Pure functions; no I/O here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ClockEstimate:
    """Receiver clock minus sender clock, with the round-trip delay of the sample it came from.

    ``measured_wall_ns`` is on the sender's clock; |true offset - offset_ns| <= delay_ns / 2 when the
    path is symmetric.
    """

    offset_ns: int
    delay_ns: int
    measured_wall_ns: int

    def receiver_to_sender_ns(self, receiver_wall_ns: int) -> int:
        """A receiver timestamp placed on the sender's clock."""
        return receiver_wall_ns - self.offset_ns


def offset_and_delay_ns(t0_ns: int, t1_ns: int, t2_ns: int, t3_ns: int) -> tuple[int, int]:
    """(offset_ns, delay_ns) of one exchange; see the module docstring."""
    offset_ns = ((t1_ns - t0_ns) + (t2_ns - t3_ns)) // 2
    delay_ns = (t3_ns - t0_ns) - (t2_ns - t1_ns)
    return offset_ns, delay_ns


def best_estimate(samples: Iterable[tuple[int, int, int, int]]) -> ClockEstimate:
    """The estimate from the sample (t0, t1, t2, t3) with the smallest delay. Raises ValueError if empty."""
    best: ClockEstimate | None = None
    for t0_ns, t1_ns, t2_ns, t3_ns in samples:
        offset_ns, delay_ns = offset_and_delay_ns(t0_ns, t1_ns, t2_ns, t3_ns)
        if best is None or delay_ns < best.delay_ns:
            best = ClockEstimate(offset_ns=offset_ns, delay_ns=delay_ns, measured_wall_ns=t3_ns)
    if best is None:
        raise ValueError("no clock samples")
    return best
