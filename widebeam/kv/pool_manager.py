"""The contract every pool kind's block manager keeps: how a request's beams take, share and give back
blocks in one pool (the kinds: full_attention.py, sliding_window.py, cross_attention.py).

A beam's `BlockTable` lists its blocks in order; slot `block_id * T + offset` holds one token's K/V.
Beams of one request share blocks by reference count:
- the prompt is allocated once; `fork` gives every beam the same blocks;
- a full block is never written again, so it stays shared for good;
- a shared partial block is copied before a beam writes into it (copy-on-write); the copy is queued
  in `pending_copies` for the model runner, which must run it before the step's forward pass;
- `release` drops a beam's references at once (pruned, finished, aborted).

Within a beam-search step the caller releases pruned beams first, then forks, then appends, so the
distinct blocks a request holds never exceed `required_blocks` at any instant.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import replace

from widebeam.errors import BlockStateError
from widebeam.kv.block_pool import BlockPool
from widebeam.kv.budget import KVRequest
from widebeam.kv.spec import PoolSpec
from widebeam.kv.tables import DROPPED, BlockCopy, BlockTable, Holding


class PoolManager(ABC):
    """One pool kind's contract: `required_blocks` and `capacity_blocks`, in blocks of this pool."""

    def __init__(self, spec: PoolSpec, pool: BlockPool, tokens_per_block: int,
                 prefill_chunk_tokens: int | None = None):
        """`prefill_chunk_tokens`: the largest prompt chunk one step writes (the sliding-window
        bound depends on it); None means whole prompts."""
        if tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
        self.spec = spec
        self.pool = pool
        self.tokens_per_block = tokens_per_block
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.pending_copies: list[BlockCopy] = []

    @property
    def name(self) -> str:
        return self.spec.name

    @abstractmethod
    def required_blocks(self, request: KVRequest) -> int:
        """The most blocks `request` can ever hold in this pool, from admission to finish."""

    # Whether a prefix hit on a block in use is shared (it costs no free block). A kind that would
    # release a shared block before the request ends copies such hits instead: a release that
    # frees nothing would let the request's reservation grow while no block came back.
    shares_hits = True

    def capacity_blocks(self) -> int:
        """Blocks any one request can ever use: the pool minus pinned prefixes."""
        return self.pool.num_blocks - self.pool.num_pinned_blocks

    def hit_block_range(self, num_blocks: int) -> range:
        """The prompt blocks a request must find cached to skip its first `num_blocks` full blocks."""
        return range(num_blocks)

    def hit_credit(self, block_ids: list[int]) -> int:
        """Hit blocks already in use that a request would share rather than take."""
        if not self.shares_hits:
            return 0
        return sum(1 for b in block_ids if b != DROPPED and self.pool.ref_count(b) > 0)

    def take_hit(self, holding: Holding, entries: list[int]) -> BlockTable:
        """A prompt table made of cached blocks (`DROPPED` entries stay dropped): each is touched,
        or copied where this kind does not share in-use blocks (the copy queued for the runner)."""
        table = BlockTable(holding, list(entries), len(entries) * self.tokens_per_block)
        to_copy = []
        for i, block_id in enumerate(entries):  # touch every hit first: a copy's allocation may evict
            if block_id == DROPPED:
                continue
            if not self.shares_hits and self.pool.ref_count(block_id) > 0:
                to_copy.append(i)
            else:
                self.pool.touch(block_id)
                holding._add(1)
        for i in to_copy:  # in-use sources: their holders keep them through the step's copies
            table.block_ids[i] = self._allocate(holding)
            self.pending_copies.append(BlockCopy(entries[i], table.block_ids[i], self.tokens_per_block))
        return table

    def register(self, table: BlockTable, block_hashes: tuple[bytes, ...], num_computed_tokens: int,
                 first_block: int = 0) -> int:
        """Name the table's computed full blocks from `first_block` on; returns the next block to
        name. A block whose name another block already holds stays unnamed (freed as usual)."""
        last = min(num_computed_tokens // self.tokens_per_block, len(block_hashes), len(table.block_ids))
        for i in range(first_block, last):
            if table.block_ids[i] != DROPPED:
                self.pool.register(table.block_ids[i], block_hashes[i])
        return max(first_block, last)

    def new_table(self, holding: Holding) -> BlockTable:
        """An empty table whose blocks count toward `holding` (one request's, in this pool)."""
        return BlockTable(holding)

    @abstractmethod
    def append_slots(self, table: BlockTable, num_tokens: int = 1) -> list[int]:
        """Reserve slots for `num_tokens` more tokens of the table and return them in order."""

    @abstractmethod
    def append_blocks(self, tables: list[BlockTable], num_tokens: int) -> int:
        """Free blocks that trimming every one of `tables` (one request's) and then appending
        `num_tokens` to each with `append_slots` takes, net of what the trims give back (may be
        negative). Nothing changes: this is the question `append_slots` answers by doing it."""

    def trimmed_blocks(self, tables: list[BlockTable]) -> int:
        """Blocks `trim` on every one of `tables` would give back to the pool: none for kinds that
        keep every token."""
        return 0

    # The most tokens per sequence one step may re-feed after a preemption (None: any number).
    # A kind whose bound assumes fewer writes per step from one trim says so (a sliding window).
    max_refeed_tokens_per_sequence: int | None = None

    def uses(self, request: KVRequest) -> bool:
        """Whether `request` takes any blocks from this pool."""
        return True

    def fit_hints(self, request: KVRequest) -> dict[str, int | None]:
        """What would fit instead: keyword arguments for `RequestTooLargeError`."""
        return {"max_new_tokens_that_fit": None, "beam_width_that_fits": None}

    def fit_detail(self, request: KVRequest) -> str:
        """A sentence on why `request` cannot fit, where the kind has more to say than the numbers."""
        return ""

    def trim(self, table: BlockTable) -> None:
        """Release blocks no future query can see; nothing for kinds that keep every token."""

    def check_truncate(self, table: BlockTable, num_tokens: int) -> None:
        """Raise `BlockStateError` if `truncate(table, num_tokens)` is not possible; changes nothing."""
        self._check_live(table)
        if not 0 <= num_tokens <= table.num_tokens:
            raise BlockStateError(f"cannot truncate a table of {table.num_tokens} tokens to {num_tokens}")

    def truncate(self, table: BlockTable, num_tokens: int) -> None:
        """Roll a table back to its first `num_tokens` tokens (speculative tokens not accepted):
        the blocks past them are dropped. A shared last block stays shared; the next append
        copies it before writing, as for any shared partial block."""
        self.check_truncate(table, num_tokens)
        num_kept_blocks = -(-num_tokens // self.tokens_per_block)
        for block_id in table.block_ids[num_kept_blocks:]:
            if block_id != DROPPED and self.pool.dec_ref(block_id):
                table.holding._sub(1)
        del table.block_ids[num_kept_blocks:]
        table.num_tokens = num_tokens

    def take_copies(self) -> list[BlockCopy]:
        """Hand the queued copies to the runner and forget them."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def release(self, table: BlockTable, num_passed_blocks: int = 0) -> None:
        """Drop the table's references; blocks no other table holds go back to the pool. The first
        `num_passed_blocks` keep their references: `reorder` passes them on to a fork that shares them."""
        self._check_live(table)
        # Last block first: cached blocks are evicted least recently released first, so a prefix's
        # tail goes before its head, which more prompts share.
        block_ids = table.block_ids[num_passed_blocks:]
        table.holding._sub(self.pool.free(reversed(block_ids) if DROPPED not in block_ids else
                                          [b for b in reversed(block_ids) if b != DROPPED]))
        table.block_ids = []
        table.released = True

    def _allocate(self, holding: Holding) -> int:
        block_id = self.pool.allocate()
        holding._add(1)
        return block_id

    @staticmethod
    def _check_live(table: BlockTable) -> None:
        if table.released:
            raise BlockStateError("block table used after release")


def schedule_fit_hints(manager: PoolManager, request: KVRequest, capacity: int) -> dict[str, int | None]:
    """A schedule's hints: the largest N below the one asked for (the bound grows with N: every step's
    term is kept, and it costs O(N), so the search stays below the request's); no single width answers
    for a schedule."""
    def fits_new_tokens(n: int) -> bool:
        return manager.required_blocks(replace(request, max_new_tokens=n)) <= capacity

    return {"max_new_tokens_that_fit": largest_that_fits(fits_new_tokens, 0, request.max_new_tokens),
            "beam_width_that_fits": None}


def largest_that_fits(fits: Callable[[int], bool], lo: int, hi: int) -> int:
    """The largest value in [lo, hi] for which the monotone predicate holds; 0 when none does (so
    callers start at lo = 0, where 0 means none)."""
    if not fits(max(lo, 1)):
        return 0
    lo = max(lo, 1)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo
