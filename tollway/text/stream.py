"""A request's generated text as it streams: incremental detokenizing plus stop strings.

Text that might be the start of a stop string is held back until it cannot be,
so a streamed reply never shows part of a stop string (OpenAI leaves it out; vLLM's
include_stop_str_in_output keeps the one that ended it).
"""
from __future__ import annotations


class TextStream:
    def __init__(self, detokenizer, stop: list[str], include_stop: bool = False):
        self.detokenizer = detokenizer
        self.stop = stop
        self.include_stop = include_stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # everything decoded so far
        self.released = 0  # chars of self.text already handed out
        self.stopped = False

    def push(self, token_id: int) -> bool:
        """Add a token; True when a stop string completed (the text is cut before it)."""
        before = len(self.text)
        self.text += self.detokenizer.push(token_id)
        search_from = max(0, before - self.holdback)
        hits = [(i, len(s)) for i, s in ((self.text.find(s, search_from), s) for s in self.stop) if i >= 0]
        if hits:
            at, length = min(hits)
            self.text = self.text[: at + length if self.include_stop else at]
            self.stopped = True
        return self.stopped

    def release(self, finished: bool) -> str:
        if finished and not self.stopped:
            self.text += self.detokenizer.flush()
        end = len(self.text) if finished else max(self.released, len(self.text) - self.holdback)
        delta = self.text[self.released:end]
        self.released = end
        return delta
