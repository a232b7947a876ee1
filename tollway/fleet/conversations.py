"""The conversation each response the ingress placed stands for, as routing text: a Responses
API call that continues one (previous_response_id) sends only its new input, but its prompt is
the whole conversation, whose prefix is cached on the replica that made the response before. So
the ingress routes it by that response's text followed by its own, and prefix affinity finds
that replica (router.py weighs the cache hit against its load), as it does for a chat client
that sends the whole conversation again.

Only the first characters that prefix affinity reads are kept, for the most recent responses.
"""
from __future__ import annotations

from collections import OrderedDict


class Conversations:
    def __init__(self, kept_chars: int, max_entries: int = 4096):
        self.kept_chars, self.max_entries = kept_chars, max_entries
        self._text: OrderedDict[str, str] = OrderedDict()  # response id -> its routing text's start

    def before(self, response_id) -> str:
        """The routing text of the conversation `response_id` ended ("" if unknown)."""
        if not isinstance(response_id, str) or response_id not in self._text:
            return ""
        self._text.move_to_end(response_id)
        return self._text[response_id]

    def made(self, response_id: str | None, text: str) -> None:
        """The response `response_id` was placed with routing text `text`."""
        if response_id is None or not text:
            return
        self._text[response_id] = text[:self.kept_chars]
        self._text.move_to_end(response_id)
        while len(self._text) > self.max_entries:
            self._text.popitem(last=False)
