"""The full-attention pool's manager: every token's K/V kept until the beam is released."""

from __future__ import annotations

from collections import Counter

from widebeam.kv.budget import (
    KVRequest,
    beam_width_that_fits,
    full_attention_blocks,
    max_new_tokens_that_fit,
)
from widebeam.kv.pool_manager import PoolManager, schedule_fit_hints
from widebeam.kv.schedule_budget import scheduled_blocks
from widebeam.kv.tables import DROPPED, BlockCopy, BlockTable, common_prefix_length


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
            return schedule_fit_hints(self, request, capacity)
        return {
            "max_new_tokens_that_fit": max_new_tokens_that_fit(capacity, p, request.beam_width, t, d),
            "beam_width_that_fits": beam_width_that_fits(capacity, p, request.max_new_tokens, t, d),
        }

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
