"""What a process listens on, read from /proc: TCP listening sockets (IPv4 and IPv6) owned by given pids.

Linux only. `/proc/<pid>/net/tcp{,6}` lists the sockets of that process's network namespace; a socket
belongs to a process when one of its fds links to `socket:[inode]`.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

TCP_LISTEN = "0A"


@dataclass(frozen=True)
class Listener:
    pid: int
    host: str
    port: int


def descendants(pid: int) -> list[int]:
    """`pid` and every live process below it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited while we looked
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo += children.get(current, [])
    return found


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def _address(hex_address: str) -> tuple[str, int]:
    host_hex, port_hex = hex_address.split(":")
    raw = bytes.fromhex(host_hex)
    # The kernel prints each 32-bit word in host (little-endian) order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    if len(words) == 16 and words[:12] == b"\0" * 10 + b"\xff\xff":
        words = words[12:]  # an IPv4-mapped IPv6 socket (gRPC binds these): only that IPv4 address
    family = socket.AF_INET if len(words) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, words), int(port_hex, 16)


def listening(pids: list[int]) -> list[Listener]:
    """Every TCP socket in LISTEN state held by one of `pids`."""
    out = []
    for pid in pids:
        try:
            inodes = _socket_inodes(pid)
            tables = [Path(f"/proc/{pid}/net/tcp").read_text(), Path(f"/proc/{pid}/net/tcp6").read_text()]
        except OSError:
            continue  # exited while we looked
        for table in tables:
            for line in table.splitlines()[1:]:
                fields = line.split()
                if fields[3] == TCP_LISTEN and fields[9] in inodes:
                    host, port = _address(fields[1])
                    out.append(Listener(pid, host, port))
    return out
