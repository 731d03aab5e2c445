from __future__ import annotations

import pytest

from widebeam.errors import BlockStateError, OutOfBlocksError
from widebeam.kv.block_pool import BlockPool


def test_allocate_share_and_free():
    pool = BlockPool(3)
    a, b = pool.allocate_many(2)
    assert pool.num_free_blocks == 1 and pool.num_used_blocks == 2
    pool.inc_ref(a)
    assert pool.ref_count(a) == 2
    assert pool.dec_ref(a) is False  # still shared
    assert pool.free([a, b]) == 2
    assert pool.num_free_blocks == 3


def test_out_of_blocks_raises_and_keeps_state():
    pool = BlockPool(2)
    pool.allocate_many(2)
    with pytest.raises(OutOfBlocksError):
        pool.allocate()
    with pytest.raises(OutOfBlocksError):
        BlockPool(1).allocate_many(2)
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
