"""Start-up sizing: a memory budget in bytes becomes blocks per pool, and a `max_seq_len` bound.

The bound is a pool's token capacity (`blocks x T`). It is never divided by the beam width: beams
share their prompt's blocks, and whether a wide request fits is decided per request at admission.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from widebeam.errors import CacheTooSmallError
from widebeam.kv.spec import PoolSpec


@dataclass(frozen=True)
class PoolNeed:
    """A pool and how many tokens one sequence can hold in it (its share of memory follows this)."""

    spec: PoolSpec
    tokens_per_sequence: int


def tokens_per_sequence(spec: PoolSpec, max_seq_len: int, max_encoder_tokens: int = 0,
                        prefill_chunk_tokens: int | None = None) -> int:
    """How many tokens one sequence can hold in a pool of this kind at once."""
    return spec.tokens_per_sequence(max_seq_len, max_encoder_tokens, prefill_chunk_tokens)


def split_by_need(kv_cache_bytes: int, needs: Sequence[PoolNeed], tokens_per_block: int) -> list[int]:
    """Blocks per pool, memory shared in proportion to need (bytes per token x tokens held).

    A pool whose layers cost twice as much per token, or which holds twice as many tokens per
    sequence, gets twice the bytes. An equal split would starve full-attention layers in a model
    with five sliding layers to one full one.
    """
    if kv_cache_bytes < 0:
        raise ValueError(f"kv_cache_bytes must be >= 0, got {kv_cache_bytes}")
    weights = [need.spec.bytes_per_token * max(need.tokens_per_sequence, 1) for need in needs]
    total_weight = sum(weights)
    return [
        int(kv_cache_bytes * weight / total_weight) // need.spec.bytes_per_block(tokens_per_block)
        for need, weight in zip(needs, weights)
    ]


def resolve_max_seq_len(
    model_max_seq_len: int, capacity_tokens: int, requested_max_seq_len: int | None = None
) -> int:
    """The engine's `max_seq_len`: the model's limit bounded by the pool's token capacity.

    A requested value larger than either limit is a start-up error that names both numbers.
    """
    if requested_max_seq_len is not None:
        if requested_max_seq_len < 1:
            raise CacheTooSmallError(f"max_seq_len must be >= 1, got {requested_max_seq_len}")
        if requested_max_seq_len > model_max_seq_len:
            raise CacheTooSmallError(
                f"max_seq_len={requested_max_seq_len} exceeds the model's limit of {model_max_seq_len} "
                "tokens; lower max_seq_len"
            )
        if requested_max_seq_len > capacity_tokens:
            raise CacheTooSmallError(
                f"max_seq_len={requested_max_seq_len} exceeds the KV cache's token capacity of "
                f"{capacity_tokens} tokens; raise kv_cache_memory (--kv-cache-memory) or lower max_seq_len"
            )
        return requested_max_seq_len
    bound = min(model_max_seq_len, capacity_tokens)
    if bound < 1:
        raise CacheTooSmallError(
            f"the KV cache holds {capacity_tokens} tokens, not even one sequence; raise kv_cache_memory"
        )
    return bound


def capacity_tokens(specs: Sequence[PoolSpec], blocks_per_pool: Sequence[int],
                    tokens_per_block: int) -> int | None:
    """Token capacity that bounds one sequence's length: the smallest length-bounding pool's
    `blocks x T`. Sliding-window pools release what falls behind the window, so their need
    saturates and they do not bound the length (admission still checks their saturated need);
    cross pools hold encoder output. None when no pool bounds the length."""
    bounds = [n * tokens_per_block for spec, n in zip(specs, blocks_per_pool) if spec.bounds_length]
    return min(bounds) if bounds else None


@dataclass(frozen=True)
class PoolSizing:
    """What start-up sizing decided: blocks per pool (by pool name) and the length bound."""

    blocks_per_pool: dict[str, int]
    capacity_tokens: int | None  # None when no pool bounds a sequence's length
    model_max_seq_len: int

    def max_seq_len(self, requested_max_seq_len: int | None = None) -> int:
        """The engine's `max_seq_len` (raises `CacheTooSmallError` when nothing fits)."""
        bound = self.model_max_seq_len if self.capacity_tokens is None else self.capacity_tokens
        return resolve_max_seq_len(self.model_max_seq_len, bound, requested_max_seq_len)


def size_pools(specs: Sequence[PoolSpec], kv_cache_bytes: int, tokens_per_block: int, model_max_seq_len: int,
               max_encoder_tokens: int = 0, prefill_chunk_tokens: int | None = None) -> PoolSizing:
    """The one sizing chain the engine and `widebeam plan` share: memory -> blocks per pool (in
    proportion to need) -> the token capacity that bounds `max_seq_len`."""
    needs = [PoolNeed(s, tokens_per_sequence(s, model_max_seq_len, max_encoder_tokens, prefill_chunk_tokens))
             for s in specs]
    blocks = split_by_need(kv_cache_bytes, needs, tokens_per_block)
    return PoolSizing({s.name: n for s, n in zip(specs, blocks)},
                      capacity_tokens(specs, blocks, tokens_per_block), model_max_seq_len)
