"""BlockPool: allocation, ref counts, the prefix cache and its LRU eviction."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from block_checks import assert_ref_counts
from tollway.scheduler.blocks import BlockPool, chain_hash


def check_pool(pool: BlockPool, owners) -> None:
    """Every block is exactly one of free / evictable / in use, and each ref count equals the
    number of `owners`' tables that hold the block."""
    holders = assert_ref_counts(pool, owners)
    free, evictable = list(pool._free), list(pool._evictable)
    assert len(set(free)) == len(free), "double free"
    assert not set(free) & set(evictable)
    assert not (set(free) | set(evictable)) & set(holders), "a held block is also free"
    assert len(free) + len(evictable) + len(holders) == pool.num_blocks, "leaked block"
    assert pool.num_free == len(free) + len(evictable)
    assert pool.num_used == len(holders)
    for block in evictable:
        assert pool._cached[pool._hash_of[block]] == block
    for h, block in pool._cached.items():
        assert pool._hash_of[block] == h
        assert block not in free


def fill(pool: BlockPool, owner: str, tokens: list[int]) -> tuple[int, ...]:
    """A request's life up to full KV: match its prefix, allocate the rest, cache what is full."""
    pool.match_prefix(owner, tokens, len(tokens) - 1)
    assert pool.allocate(owner, len(tokens))
    pool.cache_full_blocks(owner, tokens, len(tokens))
    return pool.table(owner)


def test_allocate_grows_table_and_is_all_or_nothing():
    pool = BlockPool(num_blocks=4, block_size=4)
    assert pool.allocate("a", 5)
    assert len(pool.table("a")) == 2
    assert pool.allocate("a", 8)  # still fits in two blocks
    assert len(pool.table("a")) == 2
    assert not pool.allocate("b", 12)  # needs 3, only 2 left: takes nothing
    assert pool.table("b") == () and pool.num_free == 2
    assert pool.allocate("b", 8)
    assert pool.num_free == 0
    assert len(set(pool.table("a") + pool.table("b"))) == 4
    check_pool(pool, ["a", "b"])
    pool.free("a")
    assert pool.num_free == 2
    check_pool(pool, ["b"])


def test_reserve_keeps_blocks_back():
    pool = BlockPool(num_blocks=4, block_size=4)
    assert not pool.allocate("a", 12, reserve=2)
    assert pool.allocate("a", 8, reserve=2)
    assert not pool.allocate("b", 1, reserve=2)
    assert pool.allocate("b", 1)


def test_prefix_hit_shares_blocks_and_counts_refs():
    pool = BlockPool(num_blocks=10, block_size=4)
    shared = list(range(100, 112))  # three full blocks
    a = fill(pool, "a", shared + [1, 2])
    assert pool.num_cached_blocks == 3  # the partial fourth block is not cached
    assert pool.match_prefix("b", shared + [3, 4, 5], max_tokens=14) == 12
    assert pool.table("b") == a[:3]
    assert [pool.ref_count(x) for x in a] == [2, 2, 2, 1]
    check_pool(pool, ["a", "b"])
    pool.free("a")
    assert [pool.ref_count(x) for x in a] == [1, 1, 1, 0]
    check_pool(pool, ["b"])
    pool.free("b")
    assert pool.num_evictable == 3 and pool.num_free == 10
    check_pool(pool, [])
    # Evictable blocks are still found, and a hit takes them out of the evictable set.
    assert pool.match_prefix("c", shared + [9], max_tokens=12) == 12
    assert pool.table("c") == a[:3] and pool.num_evictable == 0
    check_pool(pool, ["c"])


def test_match_respects_max_tokens_and_the_chain():
    pool = BlockPool(num_blocks=10, block_size=4)
    tokens = list(range(12))
    fill(pool, "a", tokens)
    pool.free("a")
    assert pool.match_prefix("b", tokens, max_tokens=11) == 8  # block 3 would reach token 12
    pool.free("b")
    # Same second block, different first block: the chain hash differs, so no hit at all.
    assert pool.match_prefix("c", [7, 7, 7, 7] + tokens[4:], max_tokens=12) == 0
    pool.free("c")
    check_pool(pool, [])


def test_match_requires_an_empty_holding():
    pool = BlockPool(num_blocks=4, block_size=4)
    pool.allocate("a", 4)
    with pytest.raises(ValueError, match="already holds"):
        pool.match_prefix("a", [1, 2, 3, 4], 4)


def test_fresh_allocation_prefers_free_then_evicts_lru_tail_first():
    pool = BlockPool(num_blocks=6, block_size=2)
    old = fill(pool, "old", [1, 2, 3, 4, 5, 6])
    pool.free("old")
    new = fill(pool, "new", [7, 8, 9, 10])
    assert not set(new) & set(old)  # free blocks go first; the cache survives
    pool.free("new")
    assert pool.num_evictable == 5
    assert pool.allocate("x", 2)  # one free block left
    assert pool.allocate("y", 2)  # evicts the least recently freed: old's tail
    assert pool.table("y") == (old[2],)
    assert pool.match_prefix("z", [1, 2, 3, 4, 5, 6], 6) == 4
    assert pool.table("z") == old[:2]
    check_pool(pool, ["x", "y", "z"])


def test_duplicate_content_keeps_first_copy_cached():
    pool = BlockPool(num_blocks=4, block_size=2)
    for owner in ("a", "b"):  # both miss, then both compute the same block
        assert pool.match_prefix(owner, [1, 2, 3], 2) == 0
        assert pool.allocate(owner, 3)
    pool.cache_full_blocks("a", [1, 2, 3], 2)
    pool.cache_full_blocks("b", [1, 2, 3], 2)
    assert pool.num_cached_blocks == 1
    b_first = pool.table("b")[0]
    pool.free("b")
    assert pool.num_evictable == 0 and b_first in pool._free
    check_pool(pool, ["a"])


def test_hashes_list_is_reused_and_extended():
    pool = BlockPool(num_blocks=4, block_size=2)
    hashes: list[bytes] = []
    pool.match_prefix("a", [1, 2, 3, 4, 5], 4, hashes)
    assert hashes == [chain_hash(b"", [1, 2])]  # hashed up to the first miss
    pool.allocate("a", 5)
    pool.cache_full_blocks("a", [1, 2, 3, 4, 5], 4)
    assert hashes == [chain_hash(b"", [1, 2]), chain_hash(hashes[0], [3, 4])]
    pool.free("a")
    # A later match trusts the list (so a stale list would show): garbage hashes miss.
    assert pool.match_prefix("a", [1, 2, 3, 4, 5], 4, [b"x", b"y"]) == 0
    pool.free("a")
    assert pool.match_prefix("a", [1, 2, 3, 4, 5], 4, hashes) == 4


def test_disabled_prefix_caching_caches_nothing():
    pool = BlockPool(num_blocks=4, block_size=2, enable_prefix_caching=False)
    fill(pool, "a", [1, 2, 3, 4])
    pool.free("a")
    assert pool.num_cached_blocks == 0 and pool.num_evictable == 0
    assert pool.match_prefix("b", [1, 2, 3, 4, 5], 4) == 0


def test_free_unknown_owner_is_noop():
    pool = BlockPool(num_blocks=2, block_size=2)
    pool.free("nobody")
    check_pool(pool, [])


class PoolMachine(RuleBasedStateMachine):
    """Random request lives over a tiny pool, with KV contents simulated per slot, so a
    prefix hit that hands out wrong or overwritten KV shows up."""

    @initialize(num_blocks=st.integers(1, 8), block_size=st.integers(1, 3), caching=st.booleans())
    def setup(self, num_blocks, block_size, caching):
        self.pool = BlockPool(num_blocks, block_size, caching)
        self.tokens: dict[str, list[int]] = {}  # owner -> its tokens
        self.computed: dict[str, int] = {}  # owner -> tokens whose KV is written
        self.kv: dict[tuple[int, int], tuple] = {}  # (block, slot) -> the prefix it encodes
        self.next_id = 0

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=12))
    def admit(self, tokens):
        owner = f"r{self.next_id}"
        self.next_id += 1
        cached = self.pool.match_prefix(owner, tokens, len(tokens) - 1)
        assert cached % self.pool.block_size == 0 and cached < len(tokens)
        self.tokens[owner] = tokens
        self.computed[owner] = cached
        self._check_kv(owner)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def compute(self, data):
        owner = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens, done = self.tokens[owner], self.computed[owner]
        if done == len(tokens):
            tokens.append(data.draw(st.integers(0, 2)))
        n = data.draw(st.integers(1, len(tokens) - done))
        if not self.pool.allocate(owner, done + n):
            return
        table, bs = self.pool.table(owner), self.pool.block_size
        for pos in range(done, done + n):
            self.kv[(table[pos // bs], pos % bs)] = tuple(tokens[:pos + 1])
        self.computed[owner] = done + n
        self.pool.cache_full_blocks(owner, tokens, done + n)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        owner = data.draw(st.sampled_from(sorted(self.tokens)))
        self.pool.free(owner)
        del self.tokens[owner], self.computed[owner]

    def _check_kv(self, owner):
        table, bs = self.pool.table(owner), self.pool.block_size
        for pos in range(self.computed[owner]):
            assert self.kv.get((table[pos // bs], pos % bs)) == tuple(self.tokens[owner][:pos + 1])

    @invariant()
    def consistent(self):
        check_pool(self.pool, self.tokens)
        for owner in self.tokens:
            self._check_kv(owner)


PoolMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=30, deadline=None, derandomize=True)
test_pool_machine = PoolMachine.TestCase
