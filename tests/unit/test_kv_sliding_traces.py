"""The sliding-window pool's contract, against the real allocator: held blocks never exceed
`sliding_window_blocks`, an adversarial trace reaches it exactly, and everything comes back.

The traces follow the engine's protocol: N generated tokens take N - 1 decode steps after the
prompt (the N-th token is chosen, never written)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from kv_helpers import num_used_blocks

from widebeam.kv.budget import KVRequest, full_attention_blocks, sliding_window_blocks
from widebeam.kv.cache import KVCache
from widebeam.kv.spec import SlidingWindowSpec
from widebeam.kv.tables import DROPPED


class SlidingTrace:
    """Drives the engine's own coordinator (`RequestKV`) on a pool sized to exactly the bound, and
    checks the bound after every single allocation the pool makes."""

    def __init__(self, prompt_tokens, max_new_tokens, beam_width, tokens_per_block, window_tokens,
                 chunk_tokens):
        self.request = KVRequest(prompt_tokens, max_new_tokens, beam_width)
        spec = SlidingWindowSpec(name="sliding", num_layers=1, num_kv_heads=1, head_dim=8,
                                 window_tokens=window_tokens)
        self.required_blocks = sliding_window_blocks(prompt_tokens, max_new_tokens, beam_width,
                                                     tokens_per_block, window_tokens, chunk_tokens)
        self.cache = KVCache([(spec, self.required_blocks)], tokens_per_block, chunk_tokens)
        self.pool = self.cache["sliding"].pool
        assert self.cache["sliding"].required_blocks(self.request) == self.required_blocks
        self.kv = self.cache.new_request()
        self.holding = self.kv.holdings["sliding"]
        self.peak_blocks = 0
        self.window_tokens, self.t = window_tokens, tokens_per_block
        allocate = self.pool.allocate

        def checked_allocate():
            block_id = allocate()
            self.check()
            return block_id

        self.pool.allocate = checked_allocate

    def check(self, tables=()):
        held = num_used_blocks(self.pool)
        assert held <= self.required_blocks, f"held {held} > required {self.required_blocks}"
        self.peak_blocks = max(self.peak_blocks, held)
        for table in tables:  # everything the last written query can see is still there
            first_visible = max(0, table.num_tokens - self.window_tokens)
            needed = range(first_visible // self.t, -(-table.num_tokens // self.t))
            assert all(table.block_ids[i] != DROPPED for i in needed)

    def prefill(self, chunks):
        for chunk in chunks:
            self.kv.prefill_slots(chunk)
            self.check(self.kv.tables["sliding"])
        return self.step([0] * self.request.beam_width, append=False)

    def step(self, parents, append=True):
        self.kv.reorder(parents)
        assert self.holding.num_held_blocks == num_used_blocks(self.pool)
        if append:
            self.kv.decode_slots()
            self.check(self.kv.tables["sliding"])
        assert self.holding.num_held_blocks == num_used_blocks(self.pool)
        return self.kv.tables["sliding"]

    def finish(self, beams):
        self.kv.free()
        assert self.pool.num_free_blocks == self.pool.num_blocks and self.holding.num_held_blocks == 0


def split(total, first, chunk):
    """Chunks of at most `chunk` tokens, the first ones summing to `first`."""
    out = []
    for part in (first, total - first):
        while part > 0:
            out.append(min(chunk, part))
            part -= out[-1]
    return out


SIZES = {
    "prompt_tokens": st.integers(1, 60),
    "max_new_tokens": st.integers(1, 20),
    "beam_width": st.integers(1, 6),
    "tokens_per_block": st.sampled_from([1, 2, 4, 16]),
    "window_tokens": st.integers(1, 24),
    "chunk_tokens": st.integers(1, 32),
}


@settings(max_examples=300, deadline=None)
@given(data=st.data(), **SIZES)
def test_random_traces_never_exceed_required(prompt_tokens, max_new_tokens, beam_width, tokens_per_block,
                                             window_tokens, chunk_tokens, data):
    trace = SlidingTrace(prompt_tokens, max_new_tokens, beam_width, tokens_per_block, window_tokens,
                         chunk_tokens)
    chunks, left = [], prompt_tokens
    while left:
        chunks.append(data.draw(st.integers(1, min(left, chunk_tokens))))
        left -= chunks[-1]
    beams = trace.prefill(chunks)
    for _ in range(data.draw(st.integers(0, max_new_tokens - 1))):
        parents = data.draw(st.lists(st.integers(0, len(beams) - 1), min_size=len(beams),
                                     max_size=len(beams)))
        beams = trace.step(parents)
    trace.finish(beams)


@settings(max_examples=200, deadline=None)
@given(**SIZES)
def test_adversarial_traces_reach_required_exactly(prompt_tokens, max_new_tokens, beam_width,
                                                   tokens_per_block, window_tokens, chunk_tokens):
    """Some chunking of the prompt, then every beam diverging, holds exactly the bound."""
    peak = 0
    for first in range(min(prompt_tokens, window_tokens + 2 * tokens_per_block + chunk_tokens) + 1):
        for tail_first in (first, max(0, prompt_tokens - chunk_tokens - first)):
            trace = SlidingTrace(prompt_tokens, max_new_tokens, beam_width, tokens_per_block, window_tokens,
                                 chunk_tokens)
            beams = trace.prefill(split(prompt_tokens, min(tail_first, prompt_tokens), chunk_tokens))
            for _ in range(max_new_tokens - 1):
                beams = trace.step(list(range(beam_width)))
            trace.finish(beams)
            peak = max(peak, trace.peak_blocks)
        if peak == trace.required_blocks:
            break
    assert peak == trace.required_blocks


def test_long_prompt_fits_in_window_pool_where_full_attention_would_not():
    # 4,096-token prompt, beam 16, window 512, chunks of 2,048: far below the full-attention need
    windowed = sliding_window_blocks(4096, 64, 16, 16, 512, 2048)
    full = full_attention_blocks(4096, 64, 16, 16)
    assert windowed == 161 and full == 320
