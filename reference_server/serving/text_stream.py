"""Token ids -> the text a client may see now: whole UTF-8 characters only, cut before any stop string.

`TextStream.push(token_ids)` returns the text that is safe to send (possibly ""), holding back
  - the bytes of a character split across tokens (the byte tokenizer emits one byte a token), and
  - a tail that could still grow into a stop string,
so a streamed answer never shows half a character or the start of a stop string it later cuts. Once a
stop string is complete, `stopped` is True and the text ends just before it (the stop string itself is
never returned, as OpenAI answers). `flush()` returns what is held when the stream ends without a stop.

One request, one thread (the router's event loop); no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

from reference_server.tokenizer import StreamingDecoder


class TextStream:
    """Incremental decoding with stop strings; see the module docstring for the contract."""

    def __init__(self, stop: Iterable[str] = ()) -> None:
        self._stops = tuple(s for s in stop if s)
        self._decoder = StreamingDecoder()
        self._held = ""  # decoded text that may be the start of a stop string
        self.stopped = False

    def push(self, token_ids: Iterable[int]) -> str:
        """Text to send for these tokens; "" while everything is held. Nothing after a stop."""
        if self.stopped:
            return ""
        return self._release(self._held + self._decoder.push(token_ids))

    def flush(self) -> str:
        """The stream ended: everything still held (an unfinished character as U+FFFD), unless stopped."""
        if self.stopped:
            return ""
        text = self._release(self._held + self._decoder.flush(), final=True)
        return text

    def _release(self, text: str, final: bool = False) -> str:
        if not self._stops:
            self._held = ""
            return text
        cut = min((i for i in (text.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return text[:cut]
        # Keep the longest tail that is a proper prefix of a stop string: it may complete later.
        keep = 0 if final else max((self._prefix_tail(text, s) for s in self._stops), default=0)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep]

    @staticmethod
    def _prefix_tail(text: str, stop: str) -> int:
        for length in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:length]):
                return length
        return 0
