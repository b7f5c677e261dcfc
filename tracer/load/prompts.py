"""Synthetic prompt text of a requested token length, deterministic per (seed, request).

Length model: a prompt of N tokens is round(N * chars_per_token) ASCII characters. With a byte-level
tokenizer (the reference server: 1 token = 1 byte) use chars_per_token = 1 and the length is exact;
for BPE tokenizers of real models, English-like text of common words runs about 4 characters per token,
so `--tokenizer chars-per-token=4` lands near the asked length (check `usage.prompt_tokens` in results).

Sessions: every prompt of a session starts with the same literal prefix (the session's first
`shared_prefix_tokens` tokens), so servers with prefix caching or sticky routing can reuse it; the rest of
the prompt is drawn per request, so unrelated prompts share no more than a word or two by chance.

Hash blocks (Mooncake replays): a prompt with `block_hash_ids` starts with one block of HASH_BLOCK_TOKENS
tokens per id, its text a function of (seed, id) alone, so requests whose leading ids agree share exactly
that prefix (what the trace's prefix cache saw) and diverge at the first differing id.
"""

from __future__ import annotations

import functools
import math
import zlib

import numpy as np

from tracer.load.replay_formats import HASH_BLOCK_TOKENS
from tracer.load.workload import PlannedRequest

# Common short English words: ASCII only (so characters == bytes) and mostly one BPE token each.
_WORDS = np.array(
    "the of and to in is it that for on was with as be at by this have from or one had not but what all "
    "were when we there can an your which their said if do will each about how up out them then she many "
    "some so these would other into has more her two like him see time could no make than first been its "
    "who now people my made over did down only way find use may water long little very after words called "
    "just where most know get through back much go good new write our me man too any day same right look "
    "think also around another came come work three word must because does part even place well such".split()
)

_PREFIX_STREAM = 2  # seed-sequence tags keep prefix and per-request draws independent
_REQUEST_STREAM = 1
_BLOCK_STREAM = 3


def synth_text(n_chars: int, rng: np.random.Generator) -> str:
    """Exactly `n_chars` ASCII characters of space-separated common words."""
    if n_chars <= 0:
        return ""
    pieces: list[str] = []
    length = 0
    while length < n_chars:
        # Words average ~4.5 characters with their space; draw a batch big enough for the rest.
        words = _WORDS[rng.integers(len(_WORDS), size=(n_chars - length) // 3 + 8)]
        piece = " ".join(words) + " "
        pieces.append(piece)
        length += len(piece)
    return "".join(pieces)[:n_chars]


class PromptFactory:
    """Builds each request's prompt text. Call from one thread (the runner's event loop); not blocking I/O."""

    def __init__(self, *, seed: int, chars_per_token: float, shared_prefix_tokens: int) -> None:
        self._seed = seed
        self._chars_per_token = chars_per_token
        self._shared_prefix_tokens = shared_prefix_tokens
        # Bounded: replay files may name many sessions; a recomputed prefix is identical anyway.
        self._session_prefix = functools.lru_cache(maxsize=1024)(self._make_session_prefix)
        # Mooncake traces reuse hot blocks heavily; 4096 blocks of 512 tokens stay under ~8 MiB at 4 chars/token.
        self._block = functools.lru_cache(maxsize=4096)(self._make_block)

    def chars_for(self, tokens: int) -> int:
        return max(0, round(tokens * self._chars_per_token))

    def prompt(self, planned: PlannedRequest) -> str:
        """The prompt for `planned`: its hash blocks or else its session's shared prefix (either clipped to
        the prompt's length), then text unique to the request."""
        total_chars = self.chars_for(planned.prompt_tokens)
        prefix = ""
        if planned.block_hash_ids:
            block_chars = self.chars_for(HASH_BLOCK_TOKENS)
            needed = math.ceil(total_chars / block_chars) if block_chars else 0
            prefix = "".join(self._block(hash_id) for hash_id in planned.block_hash_ids[:needed])[:total_chars]
        elif planned.session is not None and self._shared_prefix_tokens:
            prefix = self._session_prefix(planned.session)[:total_chars]
        rng = np.random.default_rng([self._seed, _REQUEST_STREAM, planned.index])
        return prefix + synth_text(total_chars - len(prefix), rng)

    def _make_block(self, hash_id: int) -> str:
        rng = np.random.default_rng([self._seed, _BLOCK_STREAM, hash_id])
        return synth_text(self.chars_for(HASH_BLOCK_TOKENS), rng)

    def _make_session_prefix(self, session: str) -> str:
        rng = np.random.default_rng([self._seed, _PREFIX_STREAM, zlib.crc32(session.encode())])
        return synth_text(self.chars_for(self._shared_prefix_tokens), rng)
