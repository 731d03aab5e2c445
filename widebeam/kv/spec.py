"""Pool kinds: what one pool of KV blocks stores, and how many bytes one token costs in it.

A pool holds the K and V of a group of layers that share an allocation policy: all full-attention
layers, all layers of one sliding window, or all cross-attention layers. One token in a pool costs
K and V for every layer of the group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

# Weight-only dtypes: a model's linear weights in that type, its activations and KV in a float type.
WEIGHT_ONLY_DTYPES = {"int8": "float32"}

def kv_dtype(dtype: str, kv_cache_dtype: str = "auto") -> str:
    """The KV dtype of a model `dtype` (int8 weights keep float32 KV), unless `kv_cache_dtype` names one."""
    if kv_cache_dtype != "auto":
        return kv_cache_dtype
    return WEIGHT_ONLY_DTYPES.get(dtype, dtype)


DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "fp8": 1,
    "int8": 1,  # int8 weights, or an int8 pool (with its scales: scale_bytes_per_head)
}

# An int8 pool stores one float16 scale per group of at least INT8_GROUP_VALUES values of a token's K (or V)
# in one KV head: llama.cpp's q8_0 layout (blocks of 32 with a float16 scale). Measured on SmolLM2-135M
# over 4,096 held tokens (benchmarks/kv_quality.py), mean KL against float32 KV: one float32 scale per
# head 8.9e-4, groups of 32 with float16 scales 4.7e-4 at the same bytes (4 a head at head_dim 64),
# groups of 16 2.6e-4 for 4 bytes more. Counted in `bytes_per_token`, so the plan, the layout and the
# engine agree on blocks per byte to the block.
INT8_GROUP_VALUES = 32
INT8_SCALE_BYTES = 2


def int8_scale_groups(head_dim: int) -> int:
    """Scale groups per KV head: as many as divide `head_dim` evenly with at least INT8_GROUP_VALUES
    values each (64 -> 2, 128 -> 4, 80 -> 2 of 40), one below that."""
    groups = max(head_dim // INT8_GROUP_VALUES, 1)
    while head_dim % groups:
        groups -= 1
    return groups


def scale_bytes_per_head(dtype: str, head_dim: int) -> int:
    """Bytes a pool stores per token and KV head beside the values (K or V): an int8 pool's scales."""
    return int8_scale_groups(head_dim) * INT8_SCALE_BYTES if dtype == "int8" else 0


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown KV dtype {dtype!r}; allowed: {', '.join(DTYPE_BYTES)}") from None


@dataclass(frozen=True, kw_only=True)
class PoolSpec:
    """The layers one pool serves. `name` is how errors, stats and metrics refer to the pool."""

    kind: ClassVar[str] = "abstract"
    # False for pools whose one table serves every sequence of a request (the encoder output).
    per_sequence: ClassVar[bool] = True
    # Whether the pool's token capacity bounds one sequence's length (`max_seq_len`).
    bounds_length: ClassVar[bool] = True

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        dtype_bytes(self.dtype)

    @property
    def bytes_per_token(self) -> int:
        """K and V of every layer in the pool, for one token (with an int8 pool's scales)."""
        per_head = self.head_dim * dtype_bytes(self.dtype) + scale_bytes_per_head(self.dtype, self.head_dim)
        return 2 * self.num_layers * self.num_kv_heads * per_head

    def bytes_per_block(self, tokens_per_block: int) -> int:
        return self.bytes_per_token * tokens_per_block

    def tokens_per_sequence(self, max_seq_len: int, max_encoder_tokens: int = 0,
                            prefill_chunk_tokens: int | None = None) -> int:
        """How many tokens one sequence can hold in a pool of this kind at once (sizing weight)."""
        return max_seq_len


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(PoolSpec):
    """Self-attention over the whole sequence: every token stays until the sequence finishes."""

    kind: ClassVar[str] = "full"


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(PoolSpec):
    """Self-attention over the last `window_tokens` positions only."""

    kind: ClassVar[str] = "sliding"
    # What falls behind the window is released, so the need saturates instead of growing.
    bounds_length: ClassVar[bool] = False
    window_tokens: int

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window_tokens < 1:
            raise ValueError(f"window_tokens must be >= 1, got {self.window_tokens}")

    def tokens_per_sequence(self, max_seq_len: int, max_encoder_tokens: int = 0,
                            prefill_chunk_tokens: int | None = None) -> int:
        # a prefill chunk of C tokens still sees w - 1 tokens before it
        chunk = max_seq_len if prefill_chunk_tokens is None else prefill_chunk_tokens
        return min(self.window_tokens - 1 + chunk, max_seq_len)


@dataclass(frozen=True, kw_only=True)
class CrossAttentionSpec(PoolSpec):
    """Decoder-to-encoder attention: the encoder output's K/V, computed once, shared by all beams."""

    kind: ClassVar[str] = "cross"
    per_sequence: ClassVar[bool] = False
    bounds_length: ClassVar[bool] = False

    def tokens_per_sequence(self, max_seq_len: int, max_encoder_tokens: int = 0,
                            prefill_chunk_tokens: int | None = None) -> int:
        return max_encoder_tokens
