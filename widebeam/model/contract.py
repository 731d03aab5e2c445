"""The runtime model contract: what the engine, the runner and the warm-up call on a model.

Every builder in the family table (families/table.py) returns an object satisfying `CausalModel`;
encoder-decoder families satisfy `EncoderDecoderModel` too. The models are `torch.nn.Module`s, so
`model(...)` runs `forward`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from widebeam.model.attention.cross import CrossAttentionMetadata
from widebeam.model.attention.metadata import AttentionMetadata
from widebeam.model.families.arch import ModelArch

KVCacheView = tuple[torch.Tensor, torch.Tensor]  # one layer's (K, V): [num_slots, kv_heads, head_dim] each


@runtime_checkable
class CausalModel(Protocol):
    arch: ModelArch
    """The shape the KV layer sizes pools from (one parse of config.json, families.parse_config)."""

    layer_pool_names: list[str]
    """The pool of each entry of `kv_caches`, in order; equal to `arch.layer_pool_names()`, so the
    runner's KV tensors (one per `arch.kv_pool_specs()` pool) and the model agree on layers."""

    lm_head: torch.nn.Linear
    """Its weight's dtype is the dtype the runner allocates KV in and the warm-up measures with."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCacheView],
                metadata: dict[str, AttentionMetadata | CrossAttentionMetadata]) -> torch.Tensor:
        """Run the new tokens of many sequences flattened into one batch.

        input_ids, positions: [num_tokens] (long); positions are each token's index in its sequence.
        kv_caches: one (K, V) view per entry of `layer_pool_names`; this step's K/V are written at
        `metadata[pool].slot_mapping` before attention reads them.
        metadata: per pool name, where each sequence's queries and blocks are (the window, if any,
        is the pool's: `AttentionMetadata.sliding_window`).
        Returns the final hidden states [num_tokens, hidden_size] (after the final norm)."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] -> float32 logits [n, vocab_size], soft-cap and bias included."""
        ...

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Fill every parameter from a checkpoint's tensors (Hugging Face names, mapped by the
        family's checkpoint layout); refuse a checkpoint with missing or unexpected tensors."""
        ...

    def tie_weights(self) -> None:
        """Re-tie shared parameters (tied LM head and embeddings); run after `to_empty`, which
        gives each module its own storage."""
        ...


@runtime_checkable
class EncoderDecoderModel(CausalModel, Protocol):
    decoder_start_token_id: int
    """The decoder's first token when the generation config names none."""

    def encode(self, input_ids: torch.Tensor, positions: torch.Tensor, query_start_loc: list[int],
               cross_kv_caches: list[KVCacheView], slot_mapping: torch.Tensor) -> None:
        """Run the encoder once over a padding-free batch of sources (input_ids, positions:
        [num_source_tokens]; source i is rows query_start_loc[i]:query_start_loc[i + 1]) and write
        every decoder layer's cross-attention K/V at `slot_mapping` (one slot per source token) in
        `cross_kv_caches` (the cross pool's layers, in order). `forward` then reads them through
        `metadata["cross"]`; the decoder's self-attention pools come first in `kv_caches`."""
        ...
