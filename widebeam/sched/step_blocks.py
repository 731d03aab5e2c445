"""The blocks one request's next step takes from the free pool: what `max_utilization` admits on.

A step appends `num_tokens` tokens to every live sequence of a request (a prefill chunk: one
sequence; a decode: one token per beam, or a chunk of tokens re-fed after a preemption). Per pool,
the free blocks it takes are the new blocks the tokens spill into, plus one copy per shared partial
last block (copy-on-write: the last sharer keeps the original), less what a sliding window's trim
gives back first (blocks every sharer drops, that no other request holds). The encoder output's
table is written once, with the request's first step. Nothing is allocated here; kv/managers.py
does the same walk when it appends.
"""

from __future__ import annotations

from collections import Counter

from widebeam.kv.budget import cross_attention_blocks
from widebeam.kv.managers import DROPPED, BlockTable, PoolManager
from widebeam.kv.prefix import PrefixHit
from widebeam.kv.request_kv import RequestKV


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def append_blocks(manager: PoolManager, tables: list[BlockTable], num_tokens: int) -> int:
    """Free blocks taken by appending `num_tokens` to each of `tables` (one request's sequences,
    all trimmed before any appends), net of the blocks the trims free; may be negative."""
    t = manager.tokens_per_block
    taken = 0
    sharers: Counter[int] = Counter()
    for table in tables:
        offset = table.num_tokens % t
        if offset:
            sharers[table.block_ids[-1]] += 1
        taken += _ceil_div(max(num_tokens - (t - offset if offset else 0), 0), t)
    for block_id, count in sharers.items():
        # the first `count - 1` writers copy; the last copies too if another request still holds it
        taken += count - 1 if manager.pool.ref_count(block_id) <= count else count
    return taken - _trimmed_blocks(manager, tables)


def _trimmed_blocks(manager: PoolManager, tables: list[BlockTable]) -> int:
    """Blocks a sliding window's trims give back to the pool (0 for kinds that keep every token)."""
    window = getattr(manager, "window_tokens", None)
    if window is None:
        return 0
    t = manager.tokens_per_block
    dropped: Counter[int] = Counter()
    for table in tables:
        num_dropped_blocks = max(table.num_tokens - window + 1, 0) // t
        dropped.update(b for b in table.block_ids[:num_dropped_blocks] if b != DROPPED)
    return sum(1 for block_id, count in dropped.items() if manager.pool.ref_count(block_id) == count)


def step_blocks(kv: RequestKV, num_tokens: int, encoder_tokens: int = 0) -> dict[str, int]:
    """Per pool, the free blocks the request's next step takes (at least 0): `num_tokens` more for
    each live sequence (the prompt's one before the fork), and `encoder_tokens` of encoder output
    when its table is still to write."""
    need = {}
    for name, manager in kv.cache.managers.items():
        if manager.spec.per_sequence:
            tables = kv.tables.get(name) or [BlockTable(kv.holdings[name])]  # before the prompt's first chunk
            need[name] = max(append_blocks(manager, tables, num_tokens), 0)
        elif encoder_tokens and name not in kv.shared_tables:
            need[name] = cross_attention_blocks(encoder_tokens, manager.tokens_per_block)
    return need


def first_step_blocks(kv: RequestKV, hit: PrefixHit, num_tokens: int, encoder_tokens: int = 0) -> dict[str, int]:
    """Per pool, the free blocks a waiting request takes if admitted now with prefix `hit` and a
    first prompt chunk of `num_tokens`: the hit blocks it does not share (cached-evictable ones, or
    in-use ones a kind copies), the chunk's blocks (the hit ends on a block boundary), and the
    encoder output's unless the hit holds it."""
    need = {}
    for name, manager in kv.cache.managers.items():
        entries = hit.block_ids.get(name) or hit.shared_block_ids.get(name) or []
        taken = sum(1 for b in entries if b != DROPPED) - hit.credit_blocks.get(name, 0)
        if manager.spec.per_sequence:
            need[name] = taken + _ceil_div(num_tokens, manager.tokens_per_block)
        elif encoder_tokens:
            need[name] = taken if name in hit.shared_block_ids else cross_attention_blocks(
                encoder_tokens, manager.tokens_per_block)
    return need
