"""Beam-aware paged KV-cache accounting. Knows nothing of models, schedulers or servers."""

from widebeam.kv.block_pool import BlockPool
from widebeam.kv.budget import KVRequest, cross_attention_blocks, full_attention_blocks
from widebeam.kv.cache import KVCache, PoolBudget
from widebeam.kv.managers import (
    BlockCopy,
    BlockTable,
    CrossAttentionManager,
    FullAttentionManager,
    Holding,
    PoolManager,
    SlidingWindowManager,
)
from widebeam.kv.request_kv import RequestKV
from widebeam.kv.spec import CrossAttentionSpec, FullAttentionSpec, PoolSpec, SlidingWindowSpec

__all__ = [
    "BlockCopy",
    "BlockPool",
    "BlockTable",
    "CrossAttentionManager",
    "CrossAttentionSpec",
    "FullAttentionManager",
    "FullAttentionSpec",
    "Holding",
    "KVCache",
    "KVRequest",
    "PoolBudget",
    "PoolManager",
    "PoolSpec",
    "RequestKV",
    "SlidingWindowManager",
    "SlidingWindowSpec",
    "cross_attention_blocks",
    "full_attention_blocks",
]
