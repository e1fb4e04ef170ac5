"""Incremental detokenisation with stop strings (pure).

Text is released only when it can no longer change: not while the tail might still grow
into a stop string, and not while the last token ends inside a multi-byte character.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, decode, stop: tuple[str, ...]) -> None:
        self._decode = decode  # list[int] -> str
        self.stop = stop
        self.ids: list[int] = []
        self.emitted = 0  # characters of the text already released
        self.stopped = False

    def push(self, ids: list[int]) -> str:
        """Add committed tokens; returns newly releasable text."""
        if self.stopped:
            return ""
        self.ids.extend(ids)
        text = self._decode(self.ids)
        for s in self.stop:
            at = text.find(s, max(0, self.emitted - len(s) + 1))
            if at != -1:
                self.stopped = True
                return self._release(text[:at])
        safe = len(text)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its rest
            safe = len(text.rstrip("\ufffd"))
        for s in self.stop:  # hold back a tail that could still become a stop string
            for n in range(min(len(s) - 1, safe), 0, -1):
                if text[safe - n : safe] == s[:n]:
                    safe -= n
                    break
        return self._release(text[:safe])

    def flush(self) -> str:
        """At the end: whatever is held back is final now."""
        if self.stopped:
            return ""
        return self._release(self._decode(self.ids))

    def _release(self, text: str) -> str:
        if len(text) <= self.emitted:
            return ""
        new = text[self.emitted :]
        self.emitted = len(text)
        return new
