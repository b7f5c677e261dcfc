"""The line a worker prints on stdout once it serves: how the launcher learns its ports.

Torch-free, so the launcher reads it without importing the model.
"""

from __future__ import annotations

import json
from typing import Any

READY_PREFIX = "SPLITSCOPE_WORKER_READY "


def ready_line(announcement: dict[str, Any]) -> str:
    """The line (with its newline) that announces a ready worker."""
    return READY_PREFIX + json.dumps(announcement) + "\n"


def parse_ready_line(text: str) -> dict[str, Any] | None:
    """The announcement in `text`, or None when it is any other output of the worker."""
    if not text.startswith(READY_PREFIX):
        return None
    return json.loads(text[len(READY_PREFIX) :])
