"""What a request holds in one pool: its beams' block tables, the count of distinct blocks they hold,
and the copy-on-write copies queued for the runner (the pool managers change them: kv/pool_manager.py
and its kinds)."""

from __future__ import annotations

from typing import NamedTuple

# A block table entry whose block was released because no query can see it any more (sliding window).
# Entries stay aligned with positions: block i of a table always covers positions [i*T, (i+1)*T).
DROPPED = -1


class Holding:
    """The distinct blocks one request holds in one pool (shared blocks count once)."""

    __slots__ = ("num_held_blocks", "peak_held_blocks")

    def __init__(self) -> None:
        self.num_held_blocks = 0
        self.peak_held_blocks = 0

    def _add(self, num_blocks: int) -> None:
        self.num_held_blocks += num_blocks
        self.peak_held_blocks = max(self.peak_held_blocks, self.num_held_blocks)

    def _sub(self, num_blocks: int) -> None:
        self.num_held_blocks -= num_blocks


class BlockTable:
    """One sequence's (one beam's) ordered blocks and how many tokens they hold."""

    __slots__ = ("block_ids", "holding", "num_tokens", "released")

    def __init__(self, holding: Holding, block_ids: list[int] | None = None, num_tokens: int = 0):
        self.holding = holding
        self.block_ids = block_ids if block_ids is not None else []
        self.num_tokens = num_tokens
        self.released = False

    def __repr__(self) -> str:
        return f"BlockTable(block_ids={self.block_ids}, num_tokens={self.num_tokens})"


class BlockCopy(NamedTuple):
    """A queued copy-on-write: the first `num_tokens` slots of `src_block_id` into `dst_block_id`.

    Only the slots the copying table has written: a beam's shared partial last block holds a few
    tokens at a wide step, and copying the block's unwritten rest was most of the step's copy bytes."""

    src_block_id: int
    dst_block_id: int
    num_tokens: int


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """How many leading entries `a` and `b` share: slice compares (C loops), halving the range."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if a[low:middle] == b[low:middle]:
            low = middle
        else:
            high = middle
    return low
