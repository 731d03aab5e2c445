"""The sliding-window pool's manager: full attention that gives back the blocks no query can see."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from widebeam.errors import BlockStateError
from widebeam.kv.block_pool import BlockPool
from widebeam.kv.budget import KVRequest, sliding_window_blocks
from widebeam.kv.full_attention import FullAttentionManager
from widebeam.kv.pool_manager import largest_that_fits, schedule_fit_hints
from widebeam.kv.schedule_budget import scheduled_sliding_window_blocks
from widebeam.kv.spec import SlidingWindowSpec
from widebeam.kv.tables import DROPPED, BlockTable


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
            return schedule_fit_hints(self, request, capacity)

        def fits_new_tokens(n: int) -> bool:
            return self.required_blocks(replace(request, max_new_tokens=n)) <= capacity

        def fits_width(w: int) -> bool:
            return self.required_blocks(replace(request, beam_width=w)) <= capacity

        capacity_tokens = capacity * self.tokens_per_block
        return {
            "max_new_tokens_that_fit": largest_that_fits(fits_new_tokens, 0, capacity_tokens),
            "beam_width_that_fits": largest_that_fits(fits_width, 0, max(capacity, 1)),
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
