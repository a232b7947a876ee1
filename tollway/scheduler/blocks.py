"""Paged-KV bookkeeping: which KV blocks each request holds, and a prefix cache over full blocks.

A block is in exactly one of three places:
  - the free list (ref 0, no cached content),
  - in use (ref > 0: held by that many requests' block tables),
  - evictable (ref 0, but its content is still named by a prefix hash; reused on a cache hit,
    or taken in least-recently-freed order when a fresh block is needed).

Full blocks are named by a chain hash, h_i = H(h_{i-1}, tokens of block i), so a hash names
the whole prefix up to and including that block, and equal hashes mean equal KV contents.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

_ROOT_HASH = b""


def chain_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Hash of a full block given its parent's hash.

    A cryptographic digest rather than Python's hash(): a collision would silently hand one
    request another request's KV, so 128 bits it is.
    """
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


@dataclass
class _Holding:
    """One request's share of the pool."""

    blocks: list[int] = field(default_factory=list)
    # Chain hashes of this request's leading full blocks, as far as they have been computed.
    hashes: list[bytes] = field(default_factory=list)
    # How many leading blocks of `blocks` have been offered to the prefix cache.
    num_cached: int = 0
    # `blocks` as a tuple, rebuilt only when it grows: the scheduler reads it for every
    # sequence of every step, and it changes once per block_size tokens.
    table: tuple[int, ...] = ()


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._cached: dict[bytes, int] = {}
        self._holdings: dict[str, _Holding] = {}

    # ---- counts -------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks a fresh allocation could take right now (free list + evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose content is findable by prefix hash (in use or evictable)."""
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def table(self, owner: str) -> tuple[int, ...]:
        """The owner's block table; empty when it holds nothing."""
        holding = self._holdings.get(owner)
        return holding.table if holding else ()

    # ---- operations ---------------------------------------------------------------------

    def match_prefix(self, owner: str, token_ids: Sequence[int], max_tokens: int,
                     hashes: list[bytes] | None = None) -> int:
        """Give `owner` (which must hold nothing) the longest run of cached blocks that prefixes
        `token_ids` and covers at most `max_tokens` tokens. Takes a ref on each. Returns the
        number of tokens covered (a multiple of block_size).

        `hashes` holds the chain hashes already known for token_ids' leading full blocks; it is
        extended in place (here and by cache_full_blocks), so a caller that keeps it across
        attempts and preemptions hashes each block of a request once."""
        if owner in self._holdings:
            raise ValueError(f"{owner} already holds blocks; free it before matching a prefix")
        holding = self._holdings[owner] = _Holding(hashes=[] if hashes is None else hashes)
        if not self.enable_prefix_caching:
            return 0
        for i in range(min(max_tokens, len(token_ids)) // self.block_size):
            block = self._cached.get(self._block_hash(holding, i, token_ids))
            if block is None:
                break
            if self._ref[block] == 0:
                del self._evictable[block]
            self._ref[block] += 1
            holding.blocks.append(block)
        holding.table = tuple(holding.blocks)
        holding.num_cached = len(holding.blocks)
        return len(holding.blocks) * self.block_size

    def allocate(self, owner: str, num_tokens: int, reserve: int = 0) -> bool:
        """Grow `owner`'s table so it can hold `num_tokens` tokens. All or nothing: returns False,
        taking nothing, unless at least `reserve` blocks would still be free afterwards
        (`reserve` is how a caller keeps blocks back for others, e.g. a reserved tier)."""
        holding = self._holdings.get(owner)
        if holding is None:
            holding = self._holdings[owner] = _Holding()
        need = self.blocks_for(num_tokens) - len(holding.blocks)
        if need <= 0:
            return True
        if need > self.num_free - reserve:
            return False
        for _ in range(need):
            block = self._free.popleft() if self._free else self._evict()
            self._ref[block] = 1
            holding.blocks.append(block)
        holding.table = tuple(holding.blocks)
        return True

    def cache_full_blocks(self, owner: str, token_ids: Sequence[int], num_tokens: int) -> None:
        """Offer `owner`'s blocks that the first `num_tokens` of `token_ids` fill completely
        (their KV computed) to the prefix cache. Cheap when no new block filled up."""
        holding = self._holdings.get(owner)
        if holding is None or not self.enable_prefix_caching:
            return
        full = min(num_tokens // self.block_size, len(holding.blocks))
        for i in range(holding.num_cached, full):
            h = self._block_hash(holding, i, token_ids)
            block = holding.blocks[i]
            # Another request may have computed the same content into its own block in the same
            # step; the first one registered stays the cached copy, this one is freed plainly.
            if h not in self._cached:
                self._cached[h] = block
                self._hash_of[block] = h
        holding.num_cached = max(holding.num_cached, full)

    def free(self, owner: str) -> None:
        """Drop `owner`'s refs. Blocks reaching ref 0 stay findable if cached, else go free."""
        holding = self._holdings.pop(owner, None)
        if holding is None:
            return
        # Tail blocks first, so LRU eviction takes a prefix's tail before its head: a head
        # evicted first would strand the tail blocks that only it leads to.
        for block in reversed(holding.blocks):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                if self._hash_of[block] is not None:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def _block_hash(self, holding: _Holding, i: int, token_ids: Sequence[int]) -> bytes:
        """Chain hash of the holder's block i; hashes[:i] must be known already."""
        hashes = holding.hashes
        if i == len(hashes):
            bs = self.block_size
            hashes.append(chain_hash(hashes[i - 1] if i else _ROOT_HASH, token_ids[i * bs:(i + 1) * bs]))
        return hashes[i]

    def _evict(self) -> int:
        block, _ = self._evictable.popitem(last=False)
        del self._cached[self._hash_of[block]]
        self._hash_of[block] = None
        return block
