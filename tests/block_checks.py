"""Assertions on a BlockPool shared by the pool's and the scheduler's tests."""
from collections import Counter


def assert_ref_counts(pool, owners) -> Counter:
    """Each ref count equals the number of `owners`' tables holding the block, and no table
    holds a block twice. Returns how many tables hold each block."""
    holders = Counter()
    for owner in owners:
        table = pool.table(owner)
        assert len(set(table)) == len(table), f"{owner} holds a block twice: {table}"
        holders.update(table)
    for block in range(pool.num_blocks):
        assert pool.ref_count(block) == holders[block], f"block {block}"
    return holders
