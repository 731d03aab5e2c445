"""Test-side operations on the real KV allocator: what tests ask of pools, managers and coordinators
that the engine never does. Each is a plain function over the library's objects, built from their
public methods, so a test still drives the allocator the engine uses."""

from __future__ import annotations

from widebeam.errors import OutOfBlocksError
from widebeam.kv.block_pool import BlockPool
from widebeam.kv.pool_manager import PoolManager
from widebeam.kv.request_kv import RequestKV
from widebeam.kv.tables import BlockTable, Holding


def allocate_many(pool: BlockPool, num_blocks: int) -> list[int]:
    """`num_blocks` blocks at once, or `OutOfBlocksError` before taking any."""
    if num_blocks > pool.num_free_blocks:
        raise OutOfBlocksError(f"pool '{pool.name}' has {pool.num_free_blocks} free blocks, "
                               f"{num_blocks} requested")
    return [pool.allocate() for _ in range(num_blocks)]


def num_used_blocks(pool: BlockPool) -> int:
    """Blocks in use: neither free nor cached-evictable."""
    return pool.num_blocks - pool.num_free_blocks


def allocate_table(manager: PoolManager, holding: Holding, num_tokens: int) -> BlockTable:
    """A new table holding `num_tokens` tokens: a prompt's, which beams then `fork` (full attention),
    or the encoder output's (cross attention, written once)."""
    table = manager.new_table(holding)
    manager.append_slots(table, num_tokens)
    return table


def held_blocks(kv: RequestKV) -> dict[str, int]:
    """Distinct blocks the request holds now, per pool (blocks shared by several sequences count once)."""
    return {name: holding.num_held_blocks for name, holding in kv.holdings.items()}
