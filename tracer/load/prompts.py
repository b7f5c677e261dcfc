"""Synthetic prompt text of a requested token length, deterministic per (seed, request).

Length model: a prompt of N tokens is round(N * chars_per_token) ASCII characters. With a byte-level
tokenizer (the reference server: 1 token = 1 byte) use chars_per_token = 1 and the length is exact;
for BPE tokenizers of real models, English-like text of common words runs about 4 characters per token,
so `--tokenizer chars-per-token=4` lands near the asked length (check `usage.prompt_tokens` in results).

Sessions: every prompt of a session starts with the same literal prefix (the session's first
`shared_prefix_tokens` tokens), so servers with prefix caching or sticky routing can reuse it; the rest of
the prompt is drawn per request, so unrelated prompts share no more than a word or two by chance.
"""

from __future__ import annotations

import functools
import zlib

import numpy as np

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

    def chars_for(self, tokens: int) -> int:
        return max(0, round(tokens * self._chars_per_token))

    def prompt(self, planned: PlannedRequest) -> str:
        """The prompt for `planned`: its session's shared prefix (clipped to the prompt), then unique text."""
        total_chars = self.chars_for(planned.prompt_tokens)
        prefix = ""
        if planned.session is not None and self._shared_prefix_tokens:
            prefix = self._session_prefix(planned.session)[:total_chars]
        rng = np.random.default_rng([self._seed, _REQUEST_STREAM, planned.index])
        return prefix + synth_text(total_chars - len(prefix), rng)

    def _make_session_prefix(self, session: str) -> str:
        rng = np.random.default_rng([self._seed, _PREFIX_STREAM, zlib.crc32(session.encode())])
        return synth_text(self.chars_for(self._shared_prefix_tokens), rng)
