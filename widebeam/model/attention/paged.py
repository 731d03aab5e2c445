"""The attention layer every decoder uses: write this step's K/V, then attend through the backend.

Models own the projections, norms and rotary embedding; this module owns the KV write and the
attention read, so a model never names a backend: the metadata carries the one the runner chose
(and which built it). The window comes from the pool's metadata (one source: the pool the layer's
K/V live in), not from the model.
"""

from __future__ import annotations

import torch
from torch import nn

from widebeam.model import kernels
from widebeam.model.attention.metadata import AttentionMetadata, PositionBias
from widebeam.model.attention.quantized_kv import QuantizedKV, write_pair


def write_kv(k_cache: torch.Tensor | QuantizedKV, v_cache: torch.Tensor | QuantizedKV, k: torch.Tensor,
             v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V ([num_tokens, kv_heads, head_dim]) at their slots (an int8 cache
    quantizes them there)."""
    if isinstance(k_cache, QuantizedKV):
        write_pair(k_cache, v_cache, slot_mapping, k, v)
        return
    if (k_cache.device.type == "cpu" and kernels.copy_rows_enabled() and k.dtype == k_cache.dtype
            and v.dtype == v_cache.dtype and _rows_of(k) is not None and _rows_of(v) is not None
            and k_cache.is_contiguous() and v_cache.is_contiguous()):
        # one memcpy a token's heads, straight from the projection's output (k is a strided view of it)
        torch.ops.widebeam.copy_rows(k_cache.view(1, k_cache.shape[0], -1), slot_mapping, _rows_of(k), None)
        torch.ops.widebeam.copy_rows(v_cache.view(1, v_cache.shape[0], -1), slot_mapping, _rows_of(v), None)
        return
    k_cache.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _rows_of(x: torch.Tensor) -> torch.Tensor | None:
    """x [num_tokens, kv_heads, head_dim] as [1, num_tokens, kv_heads x head_dim] without a copy, when each
    token's heads are contiguous (a slice of the fused projection's output is); else None."""
    tokens, heads, head_dim = x.shape
    if x.stride(2) != 1 or (heads > 1 and x.stride(1) != head_dim):
        return None
    return x.as_strided((1, tokens, heads * head_dim), (0, x.stride(0), 1))


class PagedAttention(nn.Module):
    """q [num_tokens, heads, head_dim], k/v [num_tokens, kv_heads, head_dim] -> [num_tokens, heads,
    head_dim]."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                position_bias: PositionBias | None = None) -> torch.Tensor:
        """`position_bias`: an additive bias per head by (query, key) position (T5), or None."""
        write_kv(kv_cache[0], kv_cache[1], k, v, meta.slot_mapping)
        if position_bias is None:  # the call every other family makes, unchanged
            return meta.backend.forward(q, kv_cache[0], kv_cache[1], meta, self.scale)
        return meta.backend.forward(q, kv_cache[0], kv_cache[1], meta, self.scale, position_bias)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
