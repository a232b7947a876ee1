"""What follows a request's output beside the scheduler: its text as it streams, stop strings
held back (text/stream.py), and its grammar's matcher (model/grammar.py). It travels with the
request (Request.follower): the scheduler asks it at each committed token whether the request
must finish, and the engine reads the new text from it."""
from __future__ import annotations

from tollway.text.stream import TextStream


class TextAndGrammar:
    __slots__ = ("stream", "grammar")

    def __init__(self, stream: TextStream | None, grammar=None):
        """`grammar`: a GrammarState, or None."""
        self.stream, self.grammar = stream, grammar

    def push(self, token_id: int) -> str | None:
        stopped = self.stream is not None and self.stream.push(token_id)
        completed = self.grammar.consume(token_id) if self.grammar is not None else None
        return "stop" if stopped else completed
