"""Beam-aware paged KV-cache accounting. Knows nothing of models, schedulers or servers."""

from widebeam.kv.block_pool import BlockPool
from widebeam.kv.budget import KVRequest, cross_attention_blocks, full_attention_blocks
from widebeam.kv.cache import KVCache, PoolBudget
from widebeam.kv.cross_attention import CrossAttentionManager
from widebeam.kv.full_attention import FullAttentionManager
from widebeam.kv.pool_manager import PoolManager
from widebeam.kv.request_kv import RequestKV
from widebeam.kv.sliding_window import SlidingWindowManager
from widebeam.kv.spec import CrossAttentionSpec, FullAttentionSpec, PoolSpec, SlidingWindowSpec
from widebeam.kv.tables import BlockCopy, BlockTable, Holding

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
