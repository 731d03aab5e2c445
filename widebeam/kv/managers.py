"""The block manager of each pool kind (pool_manager.py holds the contract they keep)."""

from __future__ import annotations

from widebeam.kv.block_pool import BlockPool
from widebeam.kv.cross_attention import CrossAttentionManager
from widebeam.kv.full_attention import FullAttentionManager
from widebeam.kv.pool_manager import PoolManager
from widebeam.kv.sliding_window import SlidingWindowManager
from widebeam.kv.spec import CrossAttentionSpec, FullAttentionSpec, PoolSpec, SlidingWindowSpec

# One manager per pool kind: no kind opts out of the cost model.
MANAGER_BY_KIND: dict[str, type[PoolManager]] = {
    FullAttentionSpec.kind: FullAttentionManager,
    SlidingWindowSpec.kind: SlidingWindowManager,
    CrossAttentionSpec.kind: CrossAttentionManager,
}


def make_manager(spec: PoolSpec, pool: BlockPool, tokens_per_block: int,
                 prefill_chunk_tokens: int | None = None) -> PoolManager:
    """The manager for a pool's kind."""
    manager_class = MANAGER_BY_KIND.get(spec.kind)
    if manager_class is None:
        raise TypeError(f"no manager for pool kind {spec.kind!r}")
    return manager_class(spec, pool, tokens_per_block, prefill_chunk_tokens)
