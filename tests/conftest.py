"""Shared test fixtures: where the shared fixtures live, free ports."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# CI lays a read-only copy of the team's shared/ folder beside the clone.
SHARED_DIR = REPO_ROOT.parent / "shared"


@pytest.fixture
def shared_dir() -> Path:
    if not SHARED_DIR.is_dir():
        pytest.fail(f"shared fixtures folder not found at {SHARED_DIR}")
    return SHARED_DIR


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def port() -> int:
    return free_port()
