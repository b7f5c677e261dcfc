"""Two network namespaces joined by a veth pair, rate-limited with `tc tbf` on both ends. Needs root.

    with VethLink.create() as link:
        link.set_rate(100_000_000)                # bits per second, both directions
        link.command(link.left, ["python", ...])  # argv that runs inside the left namespace

Addresses are private to the two namespaces (10.231.0.1/30 and 10.231.0.2/30); nothing is routed out
of them. Names are unique per instance; `close()` deletes both namespaces, which removes the veth pair.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass

LEFT_ADDRESS = "10.231.0.1"
RIGHT_ADDRESS = "10.231.0.2"
PREFIX_BITS = 30
# tbf: a burst of a few packets' worth per timer tick keeps the rate accurate at 1 Gbit/s without letting
# a transfer run ahead of the rate for long; a deep queue (bytes) means TCP sees delay, not drops.
BURST_BYTES = 256 * 1024
QUEUE_LIMIT_BYTES = 32 * 1024 * 1024


def unavailable_reason() -> str | None:
    """Why this machine cannot build the link (not root, tools missing), or None."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces and tc qdiscs (CI runs as root)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"needs iproute2's {' and '.join(missing)}"
    return None


def _run(*argv: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {result.stderr.strip()}")


@dataclass
class Side:
    netns: str
    device: str
    address: str


class VethLink:
    def __init__(self, left: Side, right: Side) -> None:
        self.left = left
        self.right = right

    @classmethod
    def create(cls) -> VethLink:
        tag = secrets.token_hex(3)
        link = cls(
            Side(f"sslow-{tag}-p", f"ssp{tag}", LEFT_ADDRESS), Side(f"sslow-{tag}-d", f"ssd{tag}", RIGHT_ADDRESS)
        )
        try:
            for side in (link.left, link.right):
                _run("ip", "netns", "add", side.netns)
            _run("ip", "link", "add", link.left.device, "type", "veth", "peer", "name", link.right.device)
            for side in (link.left, link.right):
                _run("ip", "link", "set", side.device, "netns", side.netns)
                _run("ip", "-n", side.netns, "addr", "add", f"{side.address}/{PREFIX_BITS}", "dev", side.device)
                _run("ip", "-n", side.netns, "link", "set", side.device, "up")
                _run("ip", "-n", side.netns, "link", "set", "lo", "up")
                _run(
                    "tc",
                    "-n",
                    side.netns,
                    "qdisc",
                    "add",
                    "dev",
                    side.device,
                    "root",
                    "tbf",
                    "rate",
                    "1gbit",
                    "burst",
                    str(BURST_BYTES),
                    "limit",
                    str(QUEUE_LIMIT_BYTES),
                )
        except BaseException:
            link.close()
            raise
        return link

    def set_rate(self, rate_bits_per_s: int) -> None:
        """Both directions of the link run at `rate_bits_per_s` from now on."""
        for side in (self.left, self.right):
            _run(
                "tc",
                "-n",
                side.netns,
                "qdisc",
                "change",
                "dev",
                side.device,
                "root",
                "tbf",
                "rate",
                f"{rate_bits_per_s}bit",
                "burst",
                str(BURST_BYTES),
                "limit",
                str(QUEUE_LIMIT_BYTES),
            )

    @staticmethod
    def command(side: Side, argv: list[str]) -> list[str]:
        """`argv` run inside `side`'s namespace (`ip netns exec` execs it: same pid, same parent)."""
        return ["ip", "netns", "exec", side.netns, *argv]

    def close(self) -> None:
        for side in (self.left, self.right):
            subprocess.run(["ip", "netns", "del", side.netns], capture_output=True, timeout=30, check=False)

    def __enter__(self) -> VethLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
