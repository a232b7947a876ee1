"""Whether a stream the ingress relays ended whole, and the event that ends one whose replica
failed mid-way, in the stream's own shape: a completions or chat stream ends with
`data: [DONE]` and takes an error chunk then [DONE]; a Responses API stream ends with its last
event (response.completed, response.incomplete, response.failed or error) and takes a Responses
`error` event, numbered after the events before it, as the openai client parses it."""
from __future__ import annotations

import json

from tollway.server import errors
from tollway.server.responses_output import named_event

_FAILED = "replica_failed"


class ChatStreamEnd:
    def __init__(self):
        self._tail = b""

    def feed(self, chunk: bytes) -> None:
        self._tail = (self._tail + chunk)[-64:]

    @property
    def whole(self) -> bool:
        return b"data: [DONE]" in self._tail

    def error(self, message: str) -> bytes:
        body = errors.error_body(500, message, code=_FAILED)
        return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


class ResponsesStreamEnd:
    _LAST = (b"response.completed", b"response.incomplete", b"response.failed", b"error")

    def __init__(self):
        self.events = 0  # the stream's events so far: the next one's sequence_number
        self._last = b""  # the latest event's type
        self._partial = b""  # the unfinished line, if it may be an `event:` line

    def feed(self, chunk: bytes) -> None:
        *lines, rest = (self._partial + chunk).split(b"\n")
        for line in lines:
            if line.startswith(b"event:"):
                self.events += 1
                self._last = line[6:].strip()
        # Only event lines are read: the rest of a data line (a whole Response, perhaps) is not kept.
        self._partial = rest if rest.startswith(b"event:") or b"event:".startswith(rest) else b"-"

    @property
    def whole(self) -> bool:
        return self._last in self._LAST

    def error(self, message: str) -> bytes:
        return named_event({"type": "error", "code": _FAILED, "message": message, "param": None,
                            "sequence_number": self.events}).encode()

