"""The router's /metrics: its own exposition joined with every worker's, unparsed. The subordinate path.

The server's /metrics is its metrics exporter (`serve --exporter-port`, launch/metrics_exporter.py: what
deploy/prometheus.yml scrapes, and what a scrape costs the serving processes nothing on). This join is the
fallback for a server run without one (a quick look; the tests that start many servers), and it runs inside
the serving processes: scraped often on a busy host it moves TTFT and the gap tail (architecture.md section 5).

Each worker labels every series it exports with its `worker` (and the deployment's `namespace`), so no two
processes ever export the same series: nothing is summed across processes. A worker that misses a fetch or
restarts changes only its own series, which Prometheus then sees as missing or reset, never as a drop of
the fleet's total (architecture.md §5).

Joining is not parsing: an exposition is cut into family blocks at its `# HELP` lines, blocks of the same
family from several processes are written one after another under the first one's HELP/TYPE lines (the
text formats allow a family's metadata once), and OpenMetrics' `# EOF` is written once at the end. Samples,
exemplars and `_created` lines travel as bytes. The join runs on a thread, off the event loop that forwards
tokens. A worker that does not answer in time, or answers in another format, is missing from that scrape.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import aiohttp

log = logging.getLogger(__name__)

_HELP = b"# HELP "
_EOF = b"# EOF\n"


def _family_blocks(body: bytes) -> list[tuple[bytes, bytes, bytes]]:
    """(family name, metadata lines, sample lines) of each family of one exposition, in order.

    A family starts at a line beginning `# HELP `; no other line can (label values escape their newlines).
    """
    if body.endswith(_EOF):
        body = body[: -len(_EOF)]
    head, *families = (b"\n" + body.removesuffix(b"\n")).split(b"\n" + _HELP)
    if head.strip():
        log.debug("exposition text before its first family dropped: %r", head[:80])
    blocks = []
    for family in families:
        block = _HELP + family + b"\n"
        name = family.split(b" ", 1)[0].split(b"\n", 1)[0]
        samples_at = 0
        while block.startswith(b"#", samples_at):  # HELP, TYPE, UNIT: the family's metadata lines
            newline = block.find(b"\n", samples_at)
            samples_at = len(block) if newline < 0 else newline + 1
        blocks.append((name, block[:samples_at], block[samples_at:]))
    return blocks


def join_expositions(bodies: Sequence[bytes], openmetrics: bool) -> bytes:
    """One exposition holding every family of `bodies` (each one process's, same format), metadata once.

    CPU-bound but linear in bytes, with no per-sample work; blocking: run it off the event loop.
    """
    families: dict[bytes, list[bytes]] = {}
    for body in bodies:
        for name, metadata, samples in _family_blocks(body):
            parts = families.get(name)
            if parts is None:
                families[name] = [metadata, samples]
            else:
                parts.append(samples)
    joined = b"".join(b"".join(parts) for parts in families.values())
    return joined + _EOF if openmetrics else joined


async def fetch_exposition(
    session: aiohttp.ClientSession, url: str, accept: str, content_type: str, timeout_s: float
) -> bytes | None:
    """One worker's /metrics body in `content_type`; None when it does not answer in time or in that format."""
    try:
        async with session.get(
            url, headers={"Accept": accept}, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as response:
            if response.status != 200:
                return None
            answered = response.headers.get("Content-Type", "").split(";")[0].strip()
            if answered != content_type.split(";")[0].strip():
                log.warning("metrics of %s came as %s, not %s; left out", url, answered, content_type)
                return None
            return await response.read()
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
        log.debug("metrics of %s unavailable: %s", url, exc)
        return None


async def joined_exposition(
    own: tuple[bytes, str],
    worker_metrics_urls: Sequence[str],
    session: aiohttp.ClientSession,
    accept_header: str | None,
    timeout_s: float = 2.0,
) -> bytes:
    """The router's own exposition `own` (body, content type) joined with every worker's, in its format."""
    body, content_type = own
    fetched = await asyncio.gather(
        *(fetch_exposition(session, url, accept_header or "", content_type, timeout_s) for url in worker_metrics_urls)
    )
    bodies = [body, *(b for b in fetched if b is not None)]
    return await asyncio.to_thread(join_expositions, bodies, content_type.startswith("application/openmetrics-text"))
