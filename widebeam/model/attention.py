"""Paged attention: K/V written through a slot mapping, read back through block tables.

The pieces live in two modules: `attention_metadata` (what one step looks like in one pool, built
once per step by the runner) and `attention_backends` (the backends that build it and attend
through it: "reference", the definition of correct, and "sdpa", the default). Model code uses the
`PagedAttention` layer (`paged_attention.py`), which writes the step's K/V with `write_kv` and
attends through the backend the metadata carries.
"""

from __future__ import annotations

import torch

from widebeam.model.attention_backends import (
    ATTENTION_BACKEND_ENV,
    DEFAULT_ATTENTION_BACKEND,
    AttentionBackend,
    attention_backend_names,
    get_attention_backend,
    register_attention_backend,
)
from widebeam.model.attention_metadata import AttentionMetadata, DecodeGroup, SequenceKeys

__all__ = [
    "ATTENTION_BACKEND_ENV", "DEFAULT_ATTENTION_BACKEND", "AttentionBackend", "AttentionMetadata", "DecodeGroup",
    "SequenceKeys", "attention_backend_names", "get_attention_backend", "register_attention_backend", "write_kv",
]


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V ([num_tokens, kv_heads, head_dim]) at their slots."""
    k_cache.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))

