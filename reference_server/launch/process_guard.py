"""Children that never outlive their launcher, even when it is SIGKILLed, and how the launcher ends them.

`die_with_parent(parent_pid)` runs first thing in a child (worker, metrics exporter): on Linux it asks the
kernel for SIGTERM when the parent dies (`prctl(PR_SET_PDEATHSIG)`), then checks the parent is still the
expected one (it may have died before the call). Elsewhere a daemon thread polls `os.getppid()` instead.
On the launcher's side, `terminate` stops a child with a grace period and `forward_output` keeps draining
its output pipe into the launcher's stderr, each line prefixed with the child's name.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import threading

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
_POLL_INTERVAL_S = 0.5


def _prctl_pdeathsig(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> None:
    """Make this process receive `sig` when `parent_pid` (its launcher) exits. Call once, early."""
    if not _prctl_pdeathsig(sig):
        threading.Thread(target=_watch_parent, args=(parent_pid, sig), name="parent-watch", daemon=True).start()
    if os.getppid() != parent_pid:  # the launcher died before we asked
        os.kill(os.getpid(), sig)


def _watch_parent(parent_pid: int, sig: int) -> None:
    stop = threading.Event()
    while not stop.wait(_POLL_INTERVAL_S):
        if os.getppid() != parent_pid:
            log.warning("launcher %d is gone; stopping", parent_pid)
            os.kill(os.getpid(), sig)
            return


async def terminate(process: asyncio.subprocess.Process, grace_s: float, name: str) -> None:
    """SIGTERM `process` if it still runs, wait up to `grace_s`, SIGKILL it past that, and reap it."""
    if process.returncode is None:
        try:
            process.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
    try:
        await asyncio.wait_for(process.wait(), grace_s)
    except asyncio.TimeoutError:
        log.warning("%s did not stop within %g s; killing it", name, grace_s)
        try:
            process.kill()
        except ProcessLookupError:
            pass
        await process.wait()


async def forward_output(stream: asyncio.StreamReader, name: str) -> None:
    """Drain a child's output pipe to our stderr (so it never blocks on a full pipe) until it closes."""
    while line := await stream.readline():
        sys.stderr.write(f"[{name}] {line.decode(errors='replace')}")
