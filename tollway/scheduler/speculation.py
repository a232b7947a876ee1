"""Speculative decoding for the fast lane: n-gram prompt lookup proposes, the model verifies.

The draft for a sequence is what followed the most recent earlier occurrence of its last
n tokens (longest n first), as in prompt-lookup decoding: free to compute, and right often
for code, extraction, summaries and chat that quotes its context. A step then feeds the
last token plus k drafts and samples at all k + 1 positions; drafts up to the first
disagreement are kept (greedy: identical output; sampled: rejection sampling keeps the
distribution), so a step yields between 1 and k + 1 tokens.

How many drafts to send is decided per step from the request's measured acceptance rate and
the step-time model: k maximises expected tokens per second for that request.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


class NgramIndex:
    """Where each n-gram (n = 1..max_n) of a token sequence last occurred, kept up to date as
    tokens are appended, so a proposal costs O(new tokens) rather than a scan."""

    def __init__(self, max_n: int = 3):
        self.max_n = max_n
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> position right after its latest occurrence
        self._indexed = 0  # n-grams ending before this position are in _next

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the sequence's tail."""
        # Index every n-gram except those ending at the last token: the tail must match an
        # earlier occurrence, not itself.
        for end in range(self._indexed, len(tokens) - 1):
            for n in range(1, min(self.max_n, end + 1) + 1):
                self._next[tuple(tokens[end + 1 - n:end + 1])] = end + 1
        self._indexed = max(self._indexed, len(tokens) - 1)
        for n in range(min(self.max_n, len(tokens)), 0, -1):
            at = self._next.get(tuple(tokens[len(tokens) - n:]))
            if at is not None:
                return tokens[at:at + k]
        return []


@dataclass
class Acceptance:
    """Drafts proposed and accepted; the rate starts from a Beta(1, 1) prior."""

    proposed: int = 0
    accepted: int = 0

    @property
    def rate(self) -> float:
        return (self.accepted + 1) / (self.proposed + 2)

    def add(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted


class Drafter:
    """One request's drafting: its n-gram index, and its record of drafts accepted."""

    def __init__(self):
        self.ngrams = NgramIndex()
        self.acceptance = Acceptance()

    def drafts(self, tokens, k_max: int, fits: Callable[[int], bool], step_seconds: Callable[[int], float],
               min_rate: float) -> list[int]:
        """Up to k_max drafts after `tokens`, as many as pay off (best_draft_count) among those
        that still `fit` the step: drafts are extra work for it."""
        drafts = self.ngrams.propose(tokens, k_max)
        while drafts and not fits(len(drafts)):
            drafts.pop()
        return drafts[:best_draft_count(len(drafts), self.acceptance.rate, step_seconds, min_rate)]


def best_draft_count(available: int, rate: float, step_seconds: Callable[[int], float], min_rate: float) -> int:
    """The k in 0..available that maximises expected tokens per second for one sequence,
    where draft i is accepted with probability rate^i (all before it were) and a step with k
    drafts takes step_seconds(k). Below `min_rate` it is not worth the other lanes' room."""
    if available <= 0 or rate < min_rate:
        return 0
    best, best_value, expected = 0, 1.0 / step_seconds(0), 1.0
    for k in range(1, available + 1):
        expected += rate ** k
        value = expected / step_seconds(k)
        if value > best_value:
            best, best_value = k, value
    return best
