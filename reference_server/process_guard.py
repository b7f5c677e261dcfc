"""Children that never outlive their launcher, even when it is SIGKILLed.

`die_with_parent(parent_pid)` runs first thing in a worker process: on Linux it asks the kernel for
SIGTERM when the parent dies (`prctl(PR_SET_PDEATHSIG)`), then checks the parent is still the expected
one (it may have died before the call). Elsewhere a daemon thread polls `os.getppid()` instead.
"""

from __future__ import annotations

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
