"""One request's KV across every pool: the coordinator that does all of its allocation.

A request has live sequences (one while its prompt is prefilled and for sampling; W beams after).
In each per-sequence pool it holds one block table per live sequence; in each per-request pool
(the encoder output's cross pool) one table that every sequence reads. Pool kinds are dispatched by
their spec (`per_sequence`), never by the manager's class.

The order of operations is what keeps a request within its `required_blocks` in every pool:
- `reorder(parents)`: pruned parents are released before the kept ones are forked (the held count
  only falls here);
- `decode_slots()`: every sequence trims what its window left behind before any sequence appends
  (the sliding-window bound rests on it); a shared partial block is copied before it is written,
  the copy queued for the runner (`KVCache.take_copies`);
- `take_hit(hit)` starts the prompt from cached blocks (another request's, or a pinned prefix),
  counted as held like blocks it computed, so `required_blocks` still bounds it;
  `register_computed(num_tokens)` names the prompt blocks it computed for later requests;
- `step_blocks(num_tokens)` / `first_step_blocks(hit, num_tokens)` answer, without allocating, the
  free blocks the next step (or a waiting request's first one) takes, by asking each pool's manager
  what its `append_slots` would take (`append_blocks`); `decode_slots` checks it before it appends;
- `truncate(seq, num_tokens)` rolls back tokens not accepted (speculative decoding); a sliding pool
  trims only by the length committed before an append, so a rollback to it never needs a released
  block.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from widebeam.errors import BlockStateError, OutOfBlocksError
from widebeam.kv.pool_manager import PoolManager
from widebeam.kv.prefix import PrefixHit, PrefixKey
from widebeam.kv.tables import DROPPED, BlockTable, Holding, common_prefix_length


class CachePools(Protocol):
    """What a request's coordinator uses of the cache it allocates in (`KVCache` is one): each pool's
    manager by name, the block size, and the prefix lookup with its hit-rate count. Named here so
    this module does not import the cache, which makes coordinators (`KVCache.new_request`)."""

    tokens_per_block: int
    managers: dict[str, PoolManager]

    def __getitem__(self, pool_name: str) -> PoolManager: ...

    def find_hit(self, key: PrefixKey | None) -> PrefixHit: ...

    def record_lookup(self, key: PrefixKey | None, hit: PrefixHit) -> None: ...


class RequestKV:
    """Block tables and holdings of one request, in every pool of a `KVCache`."""

    def __init__(self, cache: CachePools, key: PrefixKey | None = None, encoder_tokens: int = 0):
        """`encoder_tokens`: the length of the encoder output the per-request (cross) pools hold,
        written with the request's first step (0: a decoder-only request)."""
        self.cache = cache
        self.key = key  # the prompt's block names; None: nothing is cached for later requests
        self.encoder_tokens = encoder_tokens
        self.num_cached_tokens = 0  # prompt (and encoder) tokens taken from the cache
        self._num_named_blocks: dict[str, int] = {}  # per-sequence pool -> prompt blocks named so far
        self.holdings: dict[str, Holding] = {name: Holding() for name in cache.managers}
        # Per-sequence pools: one table per live sequence; empty until the prompt's first chunk.
        self.tables: dict[str, list[BlockTable]] = {}
        # Per-request pools: one table shared by every sequence (allocated once, never grows).
        self.shared_tables: dict[str, BlockTable] = {}
        self._freed = False

    # -- reading ------------------------------------------------------------------------------------
    @property
    def num_sequences(self) -> int:
        return len(next(iter(self.tables.values()))) if self.tables else 0

    def num_tokens(self, seq_index: int = 0) -> int:
        """Tokens sequence `seq_index` has in the cache (the same in every per-sequence pool)."""
        for tables in self.tables.values():
            return tables[seq_index].num_tokens
        return 0

    def block_tables(self, seq_index: int) -> dict[str, list[int]]:
        """Pool name -> the block ids sequence `seq_index` reads (per-request pools included)."""
        out = {name: tables[seq_index].block_ids for name, tables in self.tables.items()}
        out.update({name: table.block_ids for name, table in self.shared_tables.items()})
        return out

    def written_slots(self, seq_index: int, start: int, end: int,
                      names: Iterable[str]) -> dict[str, list[int]]:
        """Pool -> the slots of positions [start, end) of sequence `seq_index`, already allocated, in the
        per-sequence pools `names`: where a lagging reader (a draft model that skipped rounds) writes
        the K/V it missed. Nothing is allocated; blocks shared by several sequences hold the same
        tokens up to their fill, so writing them again writes what they hold."""
        t = self.cache.tokens_per_block
        out = {}
        for name in names:
            table = self.tables[name][seq_index]
            if not 0 <= start <= end <= table.num_tokens:
                raise BlockStateError(f"pool '{name}': positions [{start}, {end}) are not all allocated "
                                      f"(the sequence holds {table.num_tokens})")
            block_ids = table.block_ids
            if any(block_ids[p // t] == DROPPED for p in range(start, end, t)) or (
                    end > start and block_ids[(end - 1) // t] == DROPPED):
                raise BlockStateError(f"pool '{name}': positions [{start}, {end}) fall in released blocks")
            out[name] = [block_ids[p // t] * t + p % t for p in range(start, end)]
        return out

    def num_common_tokens(self, names: Iterable[str]) -> int:
        """Leading positions every live sequence reads from the same blocks in each of the per-sequence
        pools `names`, whole blocks only, never the block that holds the first uncommitted position (a
        shared partial block is copied before it is written): written there once, every sequence
        reads them."""
        t = self.cache.tokens_per_block
        num_blocks = None
        for name in names:
            tables = self.tables[name]
            first = tables[0]
            common = min((common_prefix_length(first.block_ids, other.block_ids) for other in tables[1:]),
                         default=len(first.block_ids))
            common = min(common, first.num_tokens // t)  # not the block the next token is written in
            num_blocks = common if num_blocks is None else min(num_blocks, common)
        return (num_blocks or 0) * t

    def num_shared_tokens(self) -> dict[str, int]:
        """Per-request pool -> tokens its table holds (the encoder output's length)."""
        return {name: table.num_tokens for name, table in self.shared_tables.items()}

    def peak_blocks(self) -> dict[str, int]:
        return {name: holding.peak_held_blocks for name, holding in self.holdings.items()}

    def remaining_blocks(self, required_blocks: dict[str, int]) -> dict[str, int]:
        """What the request may still take, per pool: its reservation beside others."""
        return {name: need - self.holdings[name].num_held_blocks for name, need in required_blocks.items()}

    def renew(self) -> RequestKV:
        """A fresh coordinator for the same request (same cache, key and encoder output), holding
        nothing: what a preempted request starts again from."""
        # `self.key` is already None where the cache keeps no prefixes (`KVCache.new_request`)
        return RequestKV(self.cache, self.key, self.encoder_tokens)

    # -- block needs (nothing is allocated) ---------------------------------------------------------
    def step_blocks(self, num_tokens: int) -> dict[str, int]:
        """Per pool, the free blocks the request's next step takes (at least 0): `num_tokens` more
        for each live sequence (the prompt's one before the fork; a prefill chunk or a decode), and
        the encoder output when its table is still to write."""
        need = {}
        for name, manager in self.cache.managers.items():
            if manager.spec.per_sequence:
                # before the prompt's first chunk: one empty sequence
                tables = self.tables.get(name) or [BlockTable(self.holdings[name])]
                need[name] = max(manager.append_blocks(tables, num_tokens), 0)
            elif self.encoder_tokens and name not in self.shared_tables:
                need[name] = manager.append_blocks([BlockTable(self.holdings[name])], self.encoder_tokens)
        return need

    def first_step_blocks(self, hit: PrefixHit, num_tokens: int) -> dict[str, int]:
        """Per pool, the free blocks this request, still waiting, takes if admitted now with prefix
        `hit` (`find_hit`) and a first prompt chunk of `num_tokens`: the hit blocks it does not share
        (cached-evictable ones, or in-use ones a kind copies), the chunk's blocks (the hit ends on a
        block boundary), and the encoder output's unless the hit holds it."""
        need = {}
        for name, manager in self.cache.managers.items():
            entries = hit.block_ids.get(name) or hit.shared_block_ids.get(name) or []
            num_taken_blocks = sum(1 for b in entries if b != DROPPED) - hit.credit_blocks.get(name, 0)
            empty = [BlockTable(self.holdings[name])]
            if manager.spec.per_sequence:
                need[name] = num_taken_blocks + manager.append_blocks(empty, num_tokens)
            elif self.encoder_tokens:
                cached = name in hit.shared_block_ids
                need[name] = num_taken_blocks if cached else manager.append_blocks(empty, self.encoder_tokens)
        return need

    # -- prefix reuse -------------------------------------------------------------------------------
    def find_hit(self) -> PrefixHit:
        """What the cache holds of this request's prompt now (no side effects)."""
        return self.cache.find_hit(self.key)

    def take_hit(self, hit: PrefixHit) -> None:
        """Start from what the cache holds of the prompt (found by `KVCache.find_hit` in this same
        state): the prompt table of every per-sequence pool, and the encoder output's tables."""
        if self.tables or self.shared_tables:
            raise BlockStateError("a prefix hit is taken before the request allocates anything")
        if hit.block_ids:
            self.tables = {name: [self.cache[name].take_hit(self.holdings[name], entries)]
                           for name, entries in hit.block_ids.items()}
            self._num_named_blocks = {name: len(entries) for name, entries in hit.block_ids.items()}
        for name, block_ids in hit.shared_block_ids.items():
            table = self.cache[name].take_hit(self.holdings[name], block_ids)
            table.num_tokens = hit.num_encoder_tokens
            self.shared_tables[name] = table
            self._num_named_blocks[name] = len(block_ids)
        self.num_cached_tokens = hit.num_cached_tokens

    def unnamed_prompt_blocks(self) -> tuple[bytes, ...]:
        """Names of the prompt blocks this request will compute and name but has not yet: a later
        request sharing them gains by waiting for them rather than computing them too."""
        if self.key is None:
            return ()
        counts = [n for name, n in self._num_named_blocks.items() if self.cache[name].spec.per_sequence]
        return self.key.block_hashes[min(counts) if counts else 0:]

    def gains_by_waiting(self, hit: PrefixHit, pending: set[bytes]) -> bool:
        """Whether the next prompt block past `hit` is one another request is about to compute."""
        if self.key is None or not pending:
            return False
        t = self.cache.tokens_per_block
        i = hit.num_tokens // t
        max_blocks = min((self.key.prompt_tokens - 1) // t, len(self.key.block_hashes))
        return i < max_blocks and self.key.block_hashes[i] in pending

    def register_computed(self, num_prompt_tokens: int) -> None:
        """Name the prompt blocks computed so far (the first `num_prompt_tokens` prompt tokens
        have their K/V written) and the encoder output, once written, so later requests find them.
        Call after the forward pass that wrote them, before the prompt forks into beams."""
        if self.key is None:
            return
        if self.tables and self.num_sequences == 1:
            for name, tables in self.tables.items():
                self._num_named_blocks[name] = self.cache[name].register(
                    tables[0], self.key.block_hashes, num_prompt_tokens, self._num_named_blocks.get(name, 0))
        for name, table in self.shared_tables.items():
            if name not in self._num_named_blocks:  # the encoder output: every block is complete
                hashes = self.key.encoder_block_hashes
                num_tokens = len(hashes) * self.cache.tokens_per_block
                self._num_named_blocks[name] = self.cache[name].register(table, hashes, num_tokens)

    # -- allocating ---------------------------------------------------------------------------------
    def allocate_shared(self, num_tokens: int) -> dict[str, list[int]]:
        """Allocate every per-request pool's table for `num_tokens` tokens (the encoder output),
        once; returns pool name -> one slot per token."""
        if self.shared_tables:
            raise BlockStateError("the request's shared tables are already allocated")
        slots = {}
        for name, manager in self._managers(per_sequence=False):
            table = manager.new_table(self.holdings[name])
            slots[name] = manager.append_slots(table, num_tokens)
            self.shared_tables[name] = table
        return slots

    def prefill_slots(self, num_tokens: int) -> dict[str, list[int]]:
        """Slots for the next `num_tokens` prompt tokens, as one sequence: the prompt is stored once."""
        if not self.tables:
            self.tables = {name: [manager.new_table(self.holdings[name])]
                           for name, manager in self._managers(per_sequence=True)}
        elif self.num_sequences != 1:
            raise BlockStateError("a prompt is prefilled as one sequence, before any fork")
        return {name: self.cache[name].append_slots(tables[0], num_tokens)
                for name, tables in self.tables.items()}

    def decode_slots(self, num_tokens: int = 1) -> list[dict[str, list[int]]]:
        """Slots for `num_tokens` more tokens of every live sequence, per sequence: pool -> slots.

        Every sequence trims before any appends, so blocks leave before new ones come. Raises
        `OutOfBlocksError`, naming the pool, before anything changes when a pool has too few free
        blocks for the step."""
        self._check_free(num_tokens)
        for name, tables in self.tables.items():
            manager = self.cache[name]
            for table in tables:
                manager.trim(table)
        return [{name: self.cache[name].append_slots(tables[i], num_tokens)
                 for name, tables in self.tables.items()}
                for i in range(self.num_sequences)]

    def reorder(self, parent_indices: Sequence[int]) -> None:
        """The next step's sequences: sequence i continues `parent_indices[i]`. Parents nobody
        continues are released first, then each chosen parent is kept by its first child and
        forked for the others."""
        for name, tables in self.tables.items():
            self.tables[name] = self.cache[name].reorder(tables, list(parent_indices))

    def drop(self, seq_indices: Iterable[int]) -> None:
        """Release the given live sequences (beams that finished on a stop string); the others
        keep their order."""
        dropped = set(seq_indices)
        if not dropped:
            return
        for name, tables in self.tables.items():
            manager = self.cache[name]
            for i in dropped:
                manager.release(tables[i])
            self.tables[name] = [table for i, table in enumerate(tables) if i not in dropped]

    def truncate(self, seq_index: int, num_tokens: int) -> None:
        """Roll sequence `seq_index` back to its first `num_tokens` tokens in every per-sequence pool;
        all pools or none (a pool that cannot roll back raises before any pool changes)."""
        for name, tables in self.tables.items():
            self.cache[name].check_truncate(tables[seq_index], num_tokens)
        for name, tables in self.tables.items():
            self.cache[name].truncate(tables[seq_index], num_tokens)

    def free(self) -> None:
        """Give back every block; safe to call twice (abort after finish)."""
        if self._freed:
            return
        self._freed = True
        for name, tables in self.tables.items():
            for table in tables:
                if not table.released:
                    self.cache[name].release(table)
        for name, table in self.shared_tables.items():
            if not table.released:
                self.cache[name].release(table)

    def _check_free(self, num_tokens: int) -> None:
        """Raise before a decode step that cannot get its blocks. The exact count (`step_blocks`)
        is walked only when the pool is short of the step's most: a new block and a copy per
        sequence per block the tokens span."""
        num_sequences = self.num_sequences
        for name, tables in self.tables.items():
            manager = self.cache[name]
            num_free_blocks = manager.pool.num_free_blocks
            if num_free_blocks >= num_sequences * (-(-num_tokens // manager.tokens_per_block) + 1):
                continue
            num_blocks = manager.append_blocks(tables, num_tokens)
            if num_blocks > num_free_blocks:
                raise OutOfBlocksError(f"pool '{name}' has {num_free_blocks} free blocks; a step of "
                                       f"{num_tokens} tokens for {num_sequences} sequences takes "
                                       f"{num_blocks}")

    def _managers(self, per_sequence: bool) -> list[tuple[str, PoolManager]]:
        return [(name, m) for name, m in self.cache.managers.items() if m.spec.per_sequence == per_sequence]
