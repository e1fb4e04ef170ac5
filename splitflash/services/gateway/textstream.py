"""Incremental detokenisation with stop strings (pure).

Text is released only when it can no longer change: not while the tail might still grow
into a stop string, and not while the last token ends inside a multi-byte character.

Each push decodes only a window of recent tokens, not the whole output: decoding everything
on every step made a response of n tokens cost O(n^2) tokenizer work on the gateway's event
loop (at 32k generated tokens, seconds of CPU). The window starts one decode back (the
tokens of the previous delta), which gives tokenizers that treat the first token specially
(SentencePiece's leading space) the context they need; the delta is the window's text past
the text of its first part.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, decode, stop: tuple[str, ...]) -> None:
        self._decode = decode  # list[int] -> str
        self.stop = stop
        self.ids: list[int] = []
        self._prefix = 0  # the decode window starts at this token
        self._read = 0  # tokens whose text has been appended to _held
        self._held = ""  # decoded text not yet released (released text is not kept ...)
        self._tail = ""  # ... but its last (longest stop - 1) characters: a stop may span
        self._tail_len = max((len(s) for s in stop), default=1) - 1
        self.stopped = False

    def push(self, ids: list[int]) -> str:
        """Add committed tokens; returns newly releasable text."""
        if self.stopped:
            return ""
        self.ids.extend(ids)
        self._take_new_text(final=False)
        text = self._held
        look = self._tail + text
        hits = [at for s in self.stop if (at := look.find(s)) != -1]
        if hits:  # cut at the earliest stop string, whichever it is
            self.stopped = True
            self._held = ""
            return text[: max(0, min(hits) - len(self._tail))]
        safe = len(text)
        for s in self.stop:  # hold back a tail that could still become a stop string
            for n in range(min(len(s) - 1, safe), 0, -1):
                if text[safe - n : safe] == s[:n]:
                    safe -= n
                    break
        self._held = text[safe:]
        if self._tail_len:
            self._tail = (self._tail + text[:safe])[-self._tail_len :]
        return text[:safe]

    def flush(self) -> str:
        """At the end: whatever is held back is final now."""
        if self.stopped:
            return ""
        self._take_new_text(final=True)
        text, self._held = self._held, ""
        return text

    def _take_new_text(self, final: bool) -> None:
        """Append the text of tokens [_read, len(ids)) to _held, unless it ends inside a
        multi-byte character (then wait for the rest, or take it as it is when final)."""
        if self._read == len(self.ids):
            return
        before = self._decode(self.ids[self._prefix : self._read])
        window = self._decode(self.ids[self._prefix :])
        if not final and (len(window) <= len(before) or window.endswith("\ufffd")):
            return
        self._held += window[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
