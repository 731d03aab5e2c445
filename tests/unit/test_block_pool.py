from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kv_helpers import allocate_many, num_used_blocks

from widebeam.errors import BlockStateError, OutOfBlocksError
from widebeam.kv.block_pool import BlockPool


def test_allocate_share_and_free():
    pool = BlockPool(3)
    a, b = allocate_many(pool, 2)
    assert pool.num_free_blocks == 1 and num_used_blocks(pool) == 2
    pool.inc_ref(a)
    assert pool.ref_count(a) == 2
    assert pool.dec_ref(a) is False  # still shared
    assert pool.free([a, b]) == 2
    assert pool.num_free_blocks == 3


def test_out_of_blocks_raises_and_keeps_state():
    pool = BlockPool(2)
    allocate_many(pool, 2)
    with pytest.raises(OutOfBlocksError):
        pool.allocate()
    with pytest.raises(OutOfBlocksError):
        allocate_many(BlockPool(1), 2)
    assert pool.num_free_blocks == 0


@pytest.mark.parametrize("op", ["dec_ref", "inc_ref"])
def test_use_of_a_freed_block_raises(op):
    pool = BlockPool(2)
    block_id = pool.allocate()
    pool.dec_ref(block_id)
    with pytest.raises(BlockStateError, match="free"):
        getattr(pool, op)(block_id)
    assert pool.num_free_blocks == 2


def test_double_free_raises():
    pool = BlockPool(1)
    block_id = pool.allocate()
    pool.free([block_id])
    with pytest.raises(BlockStateError):
        pool.free([block_id])


def test_out_of_range_id_raises():
    with pytest.raises(BlockStateError, match="out of range"):
        BlockPool(2).ref_count(5)


def test_bulk_ref_counts_match_one_call_per_block_and_check_each_block():
    # `inc_ref_many` and `free` are the per-block calls in one loop (forks and releases of long
    # tables): the same counts, the same free order, and a free or unknown block still named.
    bulk, single = BlockPool(6), BlockPool(6)
    for pool in (bulk, single):
        allocate_many(pool, 4)
        pool.register(2, b"cached")
    bulk.inc_ref_many([0, 1, 1, 2])
    for block_id in (0, 1, 1, 2):
        single.inc_ref(block_id)
    counts = [bulk.ref_count(b) for b in range(6)]
    assert counts == [single.ref_count(b) for b in range(6)] == [2, 3, 2, 1, 0, 0]
    assert bulk.free([3, 2, 2, 0]) == sum(single.dec_ref(b) for b in (3, 2, 2, 0)) == 2
    assert [bulk.allocate() for _ in range(3)] == [single.allocate() for _ in range(3)] == [3, 4, 5]
    assert bulk.num_evictable_blocks == single.num_evictable_blocks == 1  # block 2: cached, not free
    with pytest.raises(BlockStateError, match="inc_ref on block 2, which is free"):
        bulk.inc_ref_many([0, 2])
    with pytest.raises(BlockStateError, match="dec_ref on block 2, which is free"):
        bulk.free([2])
    with pytest.raises(BlockStateError, match="out of range"):
        bulk.inc_ref_many([9])
    with pytest.raises(BlockStateError, match="out of range"):
        bulk.free([-1])


class EagerFreeList:
    """The pool's hand-out order as an explicit free list of every id (what the pool kept before issue 41):
    [n-1, ..., 1, 0] popped from the end, returned ids appended."""

    def __init__(self, num_blocks: int):
        self.free_ids = list(range(num_blocks - 1, -1, -1))

    def allocate(self) -> int:
        return self.free_ids.pop()

    def free(self, block_id: int) -> None:
        self.free_ids.append(block_id)


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 63)), max_size=200))
def test_lazy_ids_are_handed_out_in_the_eager_lists_order(ops):
    num_blocks = 8
    pool, reference, held = BlockPool(num_blocks), EagerFreeList(num_blocks), []
    for allocate, which in ops:
        if allocate and pool.num_free_blocks:
            block_id = pool.allocate()
            assert block_id == reference.allocate()
            held.append(block_id)
        elif held:
            block_id = held.pop(which % len(held))
            pool.free([block_id])
            reference.free(block_id)
        assert pool.num_free_blocks == len(reference.free_ids) == num_blocks - len(held)
        assert all(pool.ref_count(b) == (b in held) for b in range(num_blocks))


def test_a_huge_pool_costs_nothing_until_used():
    """`widebeam plan` builds the pools of 256 TiB (issue 41): no per-block state up front."""
    pool = BlockPool(2**40)
    assert pool.num_free_blocks == 2**40 and pool.ref_count(2**40 - 1) == 0
    assert [pool.allocate() for _ in range(3)] == [0, 1, 2]
    assert len(pool._ref_counts) == 3
    with pytest.raises(BlockStateError, match="which is free"):
        pool.dec_ref(2**39)  # never handed out: free
