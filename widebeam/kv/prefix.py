"""Prefix reuse across requests: how a prompt's blocks are named, and what a cache hit hands over.

A full prompt block is named by a hash chain: block i's hash covers its own T token ids and the
hash of block i - 1, so equal hashes mean equal tokens from position 0 to the block's end (and, for
an encoder-decoder, the same encoder input: the chain starts from the encoder input's digest,
because the decoder's K/V depend on it through cross-attention). The encoder output's blocks are
named by the encoder input's digest and their index; they are reused all or nothing (every output
position depends on the whole input). BLAKE2b keeps names collision-proof across users.

Only prompt blocks are named: generated tokens differ per beam and per request, and a partial last
block is still being written.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

_DIGEST_BYTES = 16


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    return array("q", token_ids).tobytes()


@dataclass(frozen=True)
class PrefixKey:
    """A request's names for its blocks, computed once when it arrives."""

    prompt_tokens: int
    block_hashes: tuple[bytes, ...]  # one per full prompt block, a chain
    encoder_tokens: int = 0
    encoder_block_hashes: tuple[bytes, ...] = ()  # one per block of the encoder output


def prefix_key(token_ids: Sequence[int], tokens_per_block: int,
               encoder_token_ids: Sequence[int] | None = None) -> PrefixKey:
    """Name every full block of the prompt `token_ids` (and the encoder output's blocks)."""
    t = tokens_per_block
    root = b"decoder-only"
    encoder_hashes: tuple[bytes, ...] = ()
    if encoder_token_ids is not None:
        root = _digest(b"encoder", _token_bytes(encoder_token_ids))
        num_encoder_blocks = -(-len(encoder_token_ids) // t)
        encoder_hashes = tuple(_digest(root, i.to_bytes(8, "little")) for i in range(num_encoder_blocks))
    hashes = []
    parent = root
    for start in range(0, len(token_ids) // t * t, t):
        parent = _digest(parent, _token_bytes(token_ids[start:start + t]))
        hashes.append(parent)
    return PrefixKey(len(token_ids), tuple(hashes), len(encoder_token_ids or ()), encoder_hashes)


@dataclass
class PrefixHit:
    """What the cache holds of one request's prompt right now (found without side effects).

    `block_ids`: per per-sequence pool, the entries of the prompt table up to `num_tokens` (DROPPED
    before a sliding window's reach: a hit needs only the blocks its next query can see).
    `shared_block_ids`: per per-request pool (the encoder output), its whole table, or absent.
    `credit_blocks`: per pool, hit blocks already in use that the request shares rather than takes
    (it holds them, but they cost no free block); pools that copy in-use hits give none.
    """

    num_tokens: int = 0
    num_encoder_tokens: int = 0
    block_ids: dict[str, list[int]] = field(default_factory=dict)
    shared_block_ids: dict[str, list[int]] = field(default_factory=dict)
    credit_blocks: dict[str, int] = field(default_factory=dict)
    evictable_blocks: dict[str, int] = field(default_factory=dict)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens (and encoder input tokens) that need no computing."""
        return self.num_tokens + self.num_encoder_tokens

    def __bool__(self) -> bool:
        return bool(self.num_tokens or self.num_encoder_tokens)
