"""Structured output: a request with a grammar (SamplingParams.grammar, in llguidance's format)
may only take the tokens its grammar allows next. Each step, every constrained row gets the
grammar's mask of the vocabulary (llguidance computes it from the tokens so far, in tens of
microseconds for a JSON schema); each committed token advances the request's matcher; when the
grammar is complete the request stops.

A reply must also be complete when max_tokens ends it. Within CLOSING_ZONE tokens of that end,
each sampled token is checked: if no completion found from after it fits in the tokens left, the
next token of one found from before it is taken instead (a completion is found greedily: the
grammar's forced tokens, else a quote inside a string, else the first of a few closing tokens it
allows). The reply then ends
complete, with finish_reason "length": it was cut short to fit.

llguidance was chosen over xgrammar because it installs from PyPI with no dependencies (xgrammar
pulls torch's triton build on Linux) and computes a mask lazily over a token trie, with no
precompilation per schema (benchmarks/grammar.py measures its cost on this model).

Masks and checks are the request's own work: the step reports their seconds per request, and the
meter charges them to that request alone."""
from __future__ import annotations

import time
from dataclasses import dataclass

import llguidance
import numpy as np
import torch

from tollway.request import InvalidRequest
from tollway.scheduler.plan import SampledToken, ScheduledSeq
from tollway.text.tokenizer import Tokenizer

CLOSING_ZONE = 64  # tokens before max_tokens from which every sampled token is checked to leave room
# Outside a string, tokens that end what is open (an object, an array), move past a value that
# could grow (a number), or are the shortest value, most closing first: what a completion takes
# where the grammar forces nothing. Inside a string
# every one of them is text, so there a completion takes the quote that ends it.
_CLOSERS = ("}", "]", ",", "0", "false", "null", "[]", "{}", '"', ":")
_QUOTE, _LETTER = '"', "a"  # a grammar that allows a letter is inside a string


@dataclass
class GrammarState:
    """One request's grammar: its matcher, as of the tokens committed. It travels with the
    request (Request.grammar, and each step's ScheduledSeq), so it ends when the request does."""

    matcher: llguidance.LLMatcher
    consumed: int = 0  # tokens committed
    cut: bool = False  # a token was replaced to make the reply fit: it ends for length

    def consume(self, token_id: int) -> str | None:
        """Advance by a committed token. The grammar complete (nothing but the end may follow),
        the reason to finish: "stop", or "length" where it was cut to fit."""
        self.matcher.consume_token(token_id)
        self.consumed += 1
        if not self.matcher.is_stopped():
            return None
        return "length" if self.cut else "stop"


class Grammars:
    """What every grammar of one model shares: the vocabulary as llguidance reads it, and the
    tokens a completion closes with."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        self._ll: llguidance.LLTokenizer | None = None  # built at the first grammar: about a second
        self._closers: list[int] = []
        self._quote = self._letter = -1

    def start(self, grammar: str) -> GrammarState:
        """A request's matcher; InvalidRequest if the grammar cannot run."""
        matcher = llguidance.LLMatcher(self._lltokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"the grammar cannot be used: {matcher.get_error()}", "response_format")
        return GrammarState(matcher)

    def masks(self, seqs: list[ScheduledSeq]) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """For each of the sampled `seqs` with a grammar: the tokens it may take (a bool per token of the
        vocabulary), and the seconds that took."""
        masks, seconds = {}, {}
        for seq in seqs:
            state = seq.grammar
            if state is None:
                continue
            start = time.perf_counter()
            words = np.empty((self._vocab_size + 31) // 32, dtype=np.int32)
            state.matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
            bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:self._vocab_size]
            masks[seq.request_id] = torch.from_numpy(bits).bool()
            seconds[seq.request_id] = time.perf_counter() - start
        return masks, seconds

    def fit(self, seqs: list[ScheduledSeq], picked: list[list[SampledToken]], logits: torch.Tensor,
            seconds: dict[str, float]) -> None:
        """Near max_tokens, replace in `picked` each constrained token after which the reply could
        not be completed in the tokens left (`logits`: the step's rows, for a replaced token's
        logprob); the time it takes is added to `seconds`."""
        row = 0
        for seq, tokens in zip(seqs, picked):
            state = seq.grammar
            left = seq.params.max_tokens - state.consumed if state is not None else None
            if left is not None and left <= CLOSING_ZONE and tokens:
                start = time.perf_counter()
                after = state.matcher.deep_copy()
                if not after.consume_token(tokens[0].token_id) or self._completion(after, left - 1) is None:
                    path = self._completion(state.matcher, left)
                    if path:
                        tokens[0] = _replaced(tokens[0], path[0], logits[row])
                        state.cut = True
                seconds[seq.request_id] = seconds.get(seq.request_id, 0.0) + time.perf_counter() - start
            row += seq.num_logit_rows

    def _completion(self, matcher: llguidance.LLMatcher, limit: int) -> list[int] | None:
        """Tokens that complete the grammar from `matcher`'s state, at most `limit` of them
        (None if none found): forced tokens where the grammar forces them, else the first
        closer it allows, else the first token it allows."""
        m, path = matcher.deep_copy(), []
        while not m.is_accepting():
            if len(path) >= limit or m.is_error():
                return None
            forced = m.compute_ff_tokens()
            if forced:
                forced = forced[:limit - len(path)]
                m.consume_tokens(forced)
                path += forced
                continue
            allowed = m.compute_bitmask()
            if _allows(allowed, self._letter) and _allows(allowed, self._quote):
                token = self._quote
            else:
                token = next((t for t in self._closers if _allows(allowed, t)), None)
            if token is None:
                first = np.flatnonzero(np.frombuffer(allowed, dtype=np.uint8))
                if not first.size:
                    return None
                byte = allowed[first[0]]
                token = 8 * int(first[0]) + (byte & -byte).bit_length() - 1
            m.consume_token(token)
            path.append(token)
        return path

    def _lltokenizer(self) -> llguidance.LLTokenizer:
        if self._ll is None:
            self._ll = self._tokenizer.lltokenizer(self._vocab_size)
            self._closers = [t for t in map(self._token, _CLOSERS) if t >= 0]
            self._quote, self._letter = self._token(_QUOTE), self._token(_LETTER)
        return self._ll

    def _token(self, text: str) -> int:
        """`text`'s token id if it is one token, else -1."""
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 and ids[0] < self._vocab_size else -1


def _allows(mask: bytes, token_id: int) -> bool:
    return token_id >= 0 and bool(mask[token_id >> 3] >> (token_id & 7) & 1)


def _replaced(token: SampledToken, token_id: int, row: torch.Tensor) -> SampledToken:
    """`token_id` in place of `token`, with its logprob in `row` where one was asked for."""
    if token.logprob is None:
        return SampledToken(token_id)
    return SampledToken(token_id, float(torch.log_softmax(row.float(), dim=-1)[token_id]), token.top_logprobs)
