"""Turning emitted token pieces into text: incremental UTF-8 decoding and exact stop sequences.

Tokens arrive as raw bytes (a multi-byte character may span tokens). Stop sequences must be honoured exactly even
when they fall inside an accepted draft of several tokens, and a streamed response must never show text that a
later stop sequence would cut: text that could still be the start of a stop string is held back.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence


class TextAssembler:
    """Feed pieces in; read back the text that is safe to show and whether a stop sequence ended it."""

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.stop = [s for s in stop if s]
        self.text = ""  # all decoded text so far (cut at the stop sequence once one is found)
        self.emitted = 0  # characters of `text` already handed out
        self.stopped = False

    def feed(self, piece: bytes) -> None:
        if self.stopped:
            return
        scan_from = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        self.text += self._decoder.decode(piece)
        self._find_stop(scan_from)

    def finish(self) -> None:
        """Flush a trailing partial character (as U+FFFD) at the end of generation."""
        if not self.stopped:
            scan_from = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
            self.text += self._decoder.decode(b"", final=True)
            self._find_stop(scan_from)

    def _find_stop(self, scan_from: int) -> None:
        hits = [i for i in (self.text.find(s, scan_from) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def _held_back(self) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        if self.stopped:
            return 0
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best

    def take(self, final: bool = False) -> str:
        """Text not yet handed out; at the end (final) everything, otherwise what no stop string could still cut."""
        end = len(self.text) if final else len(self.text) - self._held_back()
        if end <= self.emitted:
            return ""
        chunk = self.text[self.emitted : end]
        self.emitted = end
        return chunk
