"""Per-kind block managers: how a request's beams take, share and give back blocks in one pool.

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
from collections import Counter
from dataclasses import replace

from widebeam.errors import BlockStateError
from widebeam.kv.block_pool import BlockPool
from widebeam.kv.budget import (
    KVRequest,
    beam_width_that_fits,
    cross_attention_blocks,
    full_attention_blocks,
    max_new_tokens_that_fit,
    scheduled_blocks,
    scheduled_sliding_window_blocks,
    sliding_window_blocks,
)
from widebeam.kv.spec import CrossAttentionSpec, FullAttentionSpec, PoolSpec, SlidingWindowSpec
from widebeam.kv.tables import DROPPED, BlockCopy, BlockTable, Holding, common_prefix_length


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


class FullAttentionManager(PoolManager):
    """Self-attention over the whole sequence: blocks are kept until the beam is released."""

    def required_blocks(self, request: KVRequest) -> int:
        if request.beam_width_schedule:
            r = request
            return scheduled_blocks(r.prompt_tokens, r.max_new_tokens, r.beam_width_schedule,
                                    self.tokens_per_block, None, r.refeeds_after_preemption)
        return full_attention_blocks(
            request.prompt_tokens,
            request.max_new_tokens,
            request.beam_width,
            self.tokens_per_block,
            request.extra_tokens,
        )

    def fit_hints(self, request: KVRequest) -> dict[str, int | None]:
        capacity, t = self.capacity_blocks(), self.tokens_per_block
        p, d = request.prompt_tokens, request.extra_tokens
        if request.beam_width_schedule:
            return _schedule_hints(self, request, capacity)
        return {
            "max_new_tokens_that_fit": max_new_tokens_that_fit(capacity, p, request.beam_width, t, d),
            "beam_width_that_fits": beam_width_that_fits(capacity, p, request.max_new_tokens, t, d),
        }

    def allocate_prompt(self, holding: Holding, num_tokens: int) -> BlockTable:
        """The prompt's blocks, once for the whole request; beams `fork` from the returned table."""
        table = BlockTable(holding)
        self.append_slots(table, num_tokens)
        return table

    def fork(self, table: BlockTable, num_passed_blocks: int = 0) -> BlockTable:
        """A new beam that shares every block of `table` (ref counts go up, nothing is copied). The
        first `num_passed_blocks` already carry its references (passed on by a released table)."""
        self._check_live(table)
        block_ids = table.block_ids
        counted = block_ids[num_passed_blocks:] if num_passed_blocks else block_ids
        self.pool.inc_ref_many(counted if DROPPED not in counted else [b for b in counted if b != DROPPED])
        return BlockTable(table.holding, list(block_ids), table.num_tokens)

    def reorder(self, tables: list[BlockTable], parent_indices: list[int]) -> list[BlockTable]:
        """The next step's beams: beam i continues `tables[parent_indices[i]]`.

        Parents nobody continues are released first, then each chosen parent is kept by its first
        child and forked for the others; so the held count only falls here. Appending the new
        tokens (and any copy-on-write) comes after, in `append_slots`.

        The j-th released parent passes its references to the j-th fork on the blocks both tables
        start with (at a wide step, the prompt's): those counts would fall by one, never to zero (the
        fork's source holds them), and rise by one again. The counts, and the blocks freed and their
        order, are those of releasing every block and forking every block.
        """
        num_children = [0] * len(tables)
        for parent in parent_indices:
            num_children[parent] += 1
        kept = [False] * len(tables)
        fork_sources: list[int] = []
        for parent in parent_indices:
            if kept[parent]:
                fork_sources.append(parent)
            kept[parent] = True
        passed = [0] * len(fork_sources)
        released = [table for table, count in zip(tables, num_children) if count == 0]
        for j, table in enumerate(released):
            if j < len(fork_sources):
                source = tables[fork_sources[j]]
                self._check_live(source)
                passed[j] = common_prefix_length(table.block_ids, source.block_ids)
            self.release(table, passed[j] if j < len(passed) else 0)
        kept = [False] * len(tables)
        children: list[BlockTable] = []
        num_forks = 0
        for parent in parent_indices:
            if kept[parent]:
                children.append(self.fork(tables[parent], passed[num_forks]))
                num_forks += 1
            else:
                kept[parent] = True
                children.append(tables[parent])
        return children

    def append_slots(self, table: BlockTable, num_tokens: int = 1) -> list[int]:
        """Reserve slots for `num_tokens` more tokens of this beam and return them in order.

        A new block is taken when the last one is full; a shared partial last block is copied first.
        """
        self._check_live(table)
        t = self.tokens_per_block
        slots: list[int] = []
        remaining = num_tokens
        while remaining > 0:
            offset = table.num_tokens % t
            if offset == 0:
                table.block_ids.append(self._allocate(table.holding))
            elif self.pool.ref_count(table.block_ids[-1]) > 1:
                # Copy-on-write: the last sharer keeps the original, so W sharers make W-1 copies.
                src_block_id = table.block_ids[-1]
                dst_block_id = self._allocate(table.holding)
                # only the `offset` slots this table has written: the rest is written later, or never read
                self.pending_copies.append(BlockCopy(src_block_id, dst_block_id, offset))
                self.pool.dec_ref(src_block_id)
                table.block_ids[-1] = dst_block_id
            num_written = min(remaining, t - offset)
            first_slot = table.block_ids[-1] * t + offset
            slots.extend(range(first_slot, first_slot + num_written))
            table.num_tokens += num_written
            remaining -= num_written
        return slots

    def append_blocks(self, tables: list[BlockTable], num_tokens: int) -> int:
        # The same walk as `append_slots`: new blocks where the tokens spill past a table's last
        # block, and one copy per writer of a shared partial last block, except that the last
        # writer keeps the original when no other request holds it.
        t = self.tokens_per_block
        num_blocks = 0
        sharers: Counter[int] = Counter()
        for table in tables:
            offset = table.num_tokens % t
            if offset:
                sharers[table.block_ids[-1]] += 1
            num_blocks += -(-max(num_tokens - (t - offset if offset else 0), 0) // t)
        for block_id, count in sharers.items():
            num_blocks += count - 1 if self.pool.ref_count(block_id) <= count else count
        return num_blocks - self.trimmed_blocks(tables)


class SlidingWindowManager(FullAttentionManager):
    """Sliding-window layers: a query at position i sees keys j with i - j < w. A block that lies
    wholly before the next query's window is released (`trim`), shared prompt blocks included once
    no beam can see them; the bound is `sliding_window_blocks`.

    Callers trim every beam of a request before appending for any of them, so blocks leave before
    new ones come (the bound relies on it); `append_slots` trims its own table too.
    """

    # A window releases prompt blocks while the request runs: a shared hit would leave its
    # reservation short by one block per release, so in-use hits are copied.
    shares_hits = False
    # The bound (`sliding_window_blocks`) assumes one token per sequence a step beyond the re-fed
    # speculative ones, all written after one trim.
    max_refeed_tokens_per_sequence = 1

    def __init__(self, spec: SlidingWindowSpec, pool: BlockPool, tokens_per_block: int,
                 prefill_chunk_tokens: int | None = None):
        super().__init__(spec, pool, tokens_per_block, prefill_chunk_tokens)
        self.window_tokens = spec.window_tokens

    def hit_block_range(self, num_blocks: int) -> range:
        # the next query, at position n*T, sees keys from n*T - w + 1 on; earlier blocks stay dropped
        first_visible = max(num_blocks * self.tokens_per_block - self.window_tokens + 1, 0)
        return range(first_visible // self.tokens_per_block, num_blocks)

    def required_blocks(self, request: KVRequest) -> int:
        r = request
        if r.beam_width_schedule:
            return scheduled_sliding_window_blocks(r.prompt_tokens, r.max_new_tokens, r.beam_width_schedule,
                                                   self.tokens_per_block, self.window_tokens,
                                                   self.prefill_chunk_tokens, r.cached_prompt_tokens,
                                                   r.refeeds_after_preemption)
        return sliding_window_blocks(r.prompt_tokens, r.max_new_tokens, r.beam_width, self.tokens_per_block,
                                     self.window_tokens, self.prefill_chunk_tokens, r.extra_tokens,
                                     r.refeed_tokens, r.cached_prompt_tokens)

    def fit_hints(self, request: KVRequest) -> dict[str, int | None]:
        # the bound is monotone in N and W; `replace` keeps D and R (`refeed_tokens`) as requested
        capacity = self.capacity_blocks()
        if request.beam_width_schedule:
            return _schedule_hints(self, request, capacity)

        def fits_new_tokens(n: int) -> bool:
            return self.required_blocks(replace(request, max_new_tokens=n)) <= capacity

        def fits_width(w: int) -> bool:
            return self.required_blocks(replace(request, beam_width=w)) <= capacity

        return {
            "max_new_tokens_that_fit": _largest(fits_new_tokens, 0, capacity * self.tokens_per_block),
            "beam_width_that_fits": _largest(fits_width, 0, max(capacity, 1)),
        }

    def trim(self, table: BlockTable) -> None:
        """Release the blocks no future query of this table can see."""
        self._check_live(table)
        first_visible = table.num_tokens - self.window_tokens + 1  # the next query's window start
        num_dropped_blocks = max(first_visible, 0) // self.tokens_per_block
        for i in range(min(num_dropped_blocks, len(table.block_ids))):
            block_id = table.block_ids[i]
            if block_id != DROPPED:
                if self.pool.dec_ref(block_id):
                    table.holding._sub(1)
                table.block_ids[i] = DROPPED

    def trimmed_blocks(self, tables: list[BlockTable]) -> int:
        # blocks every sharer drops and no other request holds
        dropped: Counter[int] = Counter()
        for table in tables:
            num_dropped_blocks = max(table.num_tokens - self.window_tokens + 1, 0) // self.tokens_per_block
            dropped.update(b for b in table.block_ids[:num_dropped_blocks] if b != DROPPED)
        return sum(1 for block_id, count in dropped.items() if self.pool.ref_count(block_id) == count)

    def append_slots(self, table: BlockTable, num_tokens: int = 1) -> list[int]:
        self.trim(table)
        return super().append_slots(table, num_tokens)

    def check_truncate(self, table: BlockTable, num_tokens: int) -> None:
        # Trimming happens only before an append, by the length committed then, so a rollback to
        # at least that length never needs a released block; one below it would.
        super().check_truncate(table, num_tokens)
        first_visible = max(num_tokens - self.window_tokens + 1, 0)
        needed = range(first_visible // self.tokens_per_block, -(-num_tokens // self.tokens_per_block))
        if any(i < len(table.block_ids) and table.block_ids[i] == DROPPED for i in needed):
            raise BlockStateError(f"cannot truncate to {num_tokens} tokens: the window already released "
                                  "blocks those tokens' queries would see")


def _schedule_hints(manager: PoolManager, request: KVRequest, capacity: int) -> dict[str, int | None]:
    """A schedule's hints: the largest N below the one asked for (the bound grows with N: every step's
    term is kept, and it costs O(N), so the search stays below the request's); no single width answers
    for a schedule."""
    def fits_new_tokens(n: int) -> bool:
        return manager.required_blocks(replace(request, max_new_tokens=n)) <= capacity

    return {"max_new_tokens_that_fit": _largest(fits_new_tokens, 0, request.max_new_tokens),
            "beam_width_that_fits": None}


def _largest(fits, lo: int, hi: int) -> int:
    """The largest value in [lo, hi] for which the monotone predicate holds; lo - 1 if none (lo > 0)
    or 0 (lo = 0, then meaning none)."""
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


class CrossAttentionManager(PoolManager):
    """Encoder output K/V: allocated once per request, shared by all beams, freed at finish."""

    def required_blocks(self, request: KVRequest) -> int:
        return cross_attention_blocks(request.encoder_tokens, self.tokens_per_block)

    def uses(self, request: KVRequest) -> bool:
        return request.encoder_tokens > 0

    def fit_detail(self, request: KVRequest) -> str:
        return (f"the encoder output has {request.encoder_tokens} tokens and at most "
                f"{self.capacity_blocks() * self.tokens_per_block} fit")

    def append_slots(self, table: BlockTable, num_tokens: int = 1) -> list[int]:
        """All of the encoder output at once: the table never grows after."""
        self._check_live(table)
        if table.block_ids:
            raise BlockStateError("a cross table is written once, by the encoder")
        for _ in range(cross_attention_blocks(num_tokens, self.tokens_per_block)):
            table.block_ids.append(self._allocate(table.holding))
        table.num_tokens = num_tokens
        return self.slots(table)

    def append_blocks(self, tables: list[BlockTable], num_tokens: int) -> int:
        # a table is written once: only the ones still empty take blocks
        num_blocks = cross_attention_blocks(num_tokens, self.tokens_per_block)
        return sum(num_blocks for table in tables if not table.block_ids)

    def allocate(self, holding: Holding, encoder_tokens: int) -> BlockTable:
        table = BlockTable(holding)
        self.append_slots(table, encoder_tokens)
        return table

    def slots(self, table: BlockTable) -> list[int]:
        t = self.tokens_per_block
        return [table.block_ids[i // t] * t + i % t for i in range(table.num_tokens)]


# One manager per pool kind: no kind opts out of the cost model.
MANAGER_BY_KIND: dict[str, type[PoolManager]] = {
    FullAttentionSpec.kind: FullAttentionManager,
    SlidingWindowSpec.kind: SlidingWindowManager,
    CrossAttentionSpec.kind: CrossAttentionManager,
}


def make_manager(spec: PoolSpec, pool: BlockPool, tokens_per_block: int,
                 prefill_chunk_tokens: int | None = None) -> PoolManager:
    """The manager for a pool's kind."""
    manager_class = MANAGER_BY_KIND.get(spec.kind)
    if manager_class is None:
        raise TypeError(f"no manager for pool kind {spec.kind!r}")
    return manager_class(spec, pool, tokens_per_block, prefill_chunk_tokens)
