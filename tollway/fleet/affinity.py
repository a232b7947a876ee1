"""Prefix affinity: which replica last served each prompt prefix.

A replica's prefix cache holds the KV of prompts it has prefilled, block by block. The router
sees request bodies, not tokens, so it keys prefixes by text: a chain of hashes over the
prompt's first CHUNK-character pieces (each hash covers everything before it, as the engine's
block hashes do). A new prompt's longest known chain names the replica likely to hold that
prefix, and how long the shared prefix is. The table is bounded (least recently used out):
prefixes that old are likely evicted from the replicas' caches too.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

CHUNK = 256  # characters, about 64 tokens: 4 KV blocks of 16
CHARS_PER_TOKEN = 4  # rough, for turning a text match into prefill tokens saved


class PrefixAffinity:
    def __init__(self, max_entries: int = 65536, max_chunks: int = 32):
        self.max_entries, self.max_chunks = max_entries, max_chunks
        self._owner: OrderedDict[bytes, int] = OrderedDict()  # chain hash -> replica index

    def _chain(self, text: str) -> list[bytes]:
        hashes, h = [], b""
        for i in range(min(len(text) // CHUNK, self.max_chunks)):
            h = hashlib.blake2b(h + text[i * CHUNK:(i + 1) * CHUNK].encode(), digest_size=16).digest()
            hashes.append(h)
        return hashes

    def lookup(self, text: str) -> tuple[int | None, int]:
        """The replica that last served the longest known prefix of `text`, and that prefix's
        length in (estimated) tokens; (None, 0) when no whole chunk is known."""
        owner, matched = None, 0
        for i, h in enumerate(self._chain(text)):
            replica = self._owner.get(h)
            if replica is None:
                break
            owner, matched = replica, (i + 1) * CHUNK // CHARS_PER_TOKEN
        return owner, matched

    def record(self, text: str, replica: int) -> None:
        for h in self._chain(text):
            self._owner[h] = replica
            self._owner.move_to_end(h)
        while len(self._owner) > self.max_entries:
            self._owner.popitem(last=False)

    def forget(self, replica: int) -> None:
        """A replica that died took its cache with it."""
        for h in [h for h, r in self._owner.items() if r == replica]:
            del self._owner[h]
