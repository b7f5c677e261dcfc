"""Byte-level tokenizer: ids 0..255 are the bytes of UTF-8 text, then two specials.

No vocabulary file, no merges: every process (router, prefill worker, decode worker) agrees on the ids
by construction. Decoding replaces invalid UTF-8; `StreamingDecoder` holds back an incomplete multi-byte
character until its last byte arrives, so streamed text never shows a stray U+FFFD mid-character.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable

NUM_BYTE_TOKENS = 256
BOS_ID = 256
EOS_ID = 257
VOCAB_SIZE = 258  # the model's vocab must be at least this
SPECIAL_IDS = frozenset({BOS_ID, EOS_ID})


def encode(text: str, *, add_bos: bool = False) -> list[int]:
    """UTF-8 bytes of `text` as token ids, optionally preceded by BOS."""
    if not isinstance(text, str):
        raise TypeError(f"encode() takes str, got {type(text).__name__}")
    ids = list(text.encode("utf-8"))
    return [BOS_ID, *ids] if add_bos else ids


def _byte_values(token_ids: Iterable[int]) -> bytes:
    """Bytes of the byte tokens; specials are dropped, anything else outside the vocab is an error."""
    kept = []
    for token_id in token_ids:
        if 0 <= token_id < NUM_BYTE_TOKENS:
            kept.append(token_id)
        elif token_id not in SPECIAL_IDS:
            raise ValueError(f"token id {token_id} is outside the byte tokenizer's vocab (0..{VOCAB_SIZE - 1})")
    return bytes(kept)


def decode(token_ids: Iterable[int]) -> str:
    """Text of `token_ids`; specials are skipped, invalid UTF-8 becomes U+FFFD."""
    return _byte_values(token_ids).decode("utf-8", errors="replace")


class StreamingDecoder:
    """Turns token ids into text as they arrive, one request at a time (not thread-safe).

    `push` returns only complete characters; the bytes of a character split across pushes are held back
    until it completes. `flush` returns whatever is held (invalid leftovers as U+FFFD) and resets.
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_ids: Iterable[int]) -> str:
        return self._decoder.decode(_byte_values(token_ids), final=False)

    def flush(self) -> str:
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text
