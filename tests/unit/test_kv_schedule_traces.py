"""Beam-width schedules against the real allocator: a request whose width follows a schedule holds at
most `required_blocks` (kv/schedule_budget.py: `scheduled_blocks`) in a full-attention and a sliding-window
pool at once, after every single allocation, and a trace that spreads its parents over the ancestors
(every beam diverging) reaches the bound exactly in both.

The traces follow the engine's protocol (`Request`): the prompt's pass chooses the first w_1 tokens,
so the prompt forks into w_1 beams; decode step k writes one token per beam (w_k of them), then the
search keeps w_{k+1} beams whose parents are among them. N generated tokens take N - 1 steps."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from kv_helpers import num_used_blocks
from kv_reference_bounds import scheduled_blocks_reference

from widebeam.kv.budget import KVRequest, full_attention_blocks, sliding_window_blocks
from widebeam.kv.cache import KVCache
from widebeam.kv.schedule_budget import scheduled_blocks, scheduled_sliding_window_blocks, width_at_step
from widebeam.kv.spec import FullAttentionSpec, SlidingWindowSpec

SIZES = {
    "prompt_tokens": st.integers(1, 40),
    "max_new_tokens": st.integers(1, 16),
    "schedule": st.lists(st.integers(1, 6), min_size=1, max_size=5).map(tuple),
    "tokens_per_block": st.sampled_from([1, 2, 4, 16]),
    "window_tokens": st.integers(1, 24),
    "chunk_tokens": st.integers(1, 32),
}


class ScheduleTrace:
    """One request in a full and a sliding pool, each sized to exactly its bound; every allocation
    is checked against both bounds."""

    def __init__(self, prompt_tokens, max_new_tokens, schedule, tokens_per_block, window_tokens,
                 chunk_tokens):
        self.schedule = schedule
        request = KVRequest(prompt_tokens, max_new_tokens, max(schedule), beam_width_schedule=schedule)
        full = FullAttentionSpec(name="self", num_layers=1, num_kv_heads=1, head_dim=8)
        sliding = SlidingWindowSpec(name="sliding", num_layers=1, num_kv_heads=1, head_dim=8,
                                    window_tokens=window_tokens)
        self.required = {
            "self": scheduled_blocks(prompt_tokens, max_new_tokens, schedule, tokens_per_block),
            "sliding": scheduled_sliding_window_blocks(prompt_tokens, max_new_tokens, schedule,
                                                       tokens_per_block, window_tokens, chunk_tokens),
        }
        self.cache = KVCache([(full, self.required["self"]), (sliding, self.required["sliding"])],
                             tokens_per_block, chunk_tokens)
        for name, need in self.required.items():
            assert self.cache[name].required_blocks(request) == need
        self.kv = self.cache.new_request()
        self.peak = {name: 0 for name in self.required}
        for name in self.required:
            pool = self.cache[name].pool
            allocate = pool.allocate

            def checked_allocate(pool=pool, allocate=allocate, name=name):
                block_id = allocate()
                held = num_used_blocks(pool)
                assert held <= self.required[name], f"{name}: held {held} > required {self.required[name]}"
                self.peak[name] = max(self.peak[name], held)
                return block_id

            pool.allocate = checked_allocate

    def run(self, chunks, choose_parents, max_new_tokens):
        """Prefill in `chunks`, then N - 1 decode steps; `choose_parents(ancestry, width)` picks the
        next step's parents from the current beams' ancestry (one tuple of indices per beam)."""
        for chunk in chunks:
            self.kv.prefill_slots(chunk)
        self.kv.reorder([0] * width_at_step(self.schedule, 1))
        ancestry = [(i,) for i in range(width_at_step(self.schedule, 1))]
        for k in range(1, max_new_tokens):
            self.kv.decode_slots()
            parents = choose_parents(ancestry, width_at_step(self.schedule, k + 1))
            self.kv.reorder(parents)
            ancestry = [ancestry[p] + (i,) for i, p in enumerate(parents)]
        self.kv.free()
        for name in self.required:
            pool = self.cache[name].pool
            assert pool.num_free_blocks == pool.num_blocks


def spread_parents(ancestry, width):
    """Parents for `width` beams keeping as many distinct ancestors of every earlier step as
    possible: every parent when the width grows; when it falls, representatives of the coarsest
    ancestor classes first (the classes are nested, so each level's choice keeps the earlier ones')."""
    n = len(ancestry)
    if width >= n:
        return list(range(n)) + [0] * (width - n)
    chosen: list[int] = []
    for level in range(len(ancestry[0])):
        covered = {ancestry[i][:level + 1] for i in chosen}
        for i in range(n):
            if len(chosen) == width:
                return sorted(chosen)
            key = ancestry[i][:level + 1]
            if key not in covered and i not in chosen:
                chosen.append(i)
                covered.add(key)
    return sorted(chosen)


def split(total, first, chunk):
    out = []
    for part in (first, total - first):
        while part > 0:
            out.append(min(chunk, part))
            part -= out[-1]
    return out


@settings(max_examples=250, deadline=None)
@given(data=st.data(), **SIZES)
def test_random_schedule_traces_never_exceed_required(prompt_tokens, max_new_tokens, schedule,
                                                      tokens_per_block, window_tokens, chunk_tokens, data):
    trace = ScheduleTrace(prompt_tokens, max_new_tokens, schedule, tokens_per_block, window_tokens,
                          chunk_tokens)
    chunks, left = [], prompt_tokens
    while left:
        chunks.append(data.draw(st.integers(1, min(left, chunk_tokens))))
        left -= chunks[-1]

    def random_parents(ancestry, width):
        return sorted(data.draw(st.lists(st.integers(0, len(ancestry) - 1), min_size=width, max_size=width)))

    trace.run(chunks, random_parents, max_new_tokens)


@settings(max_examples=200, deadline=None)
@given(**SIZES)
def test_spread_schedule_traces_reach_required_exactly(prompt_tokens, max_new_tokens, schedule,
                                                       tokens_per_block, window_tokens, chunk_tokens):
    """The full pool's bound is reached by the spread trace with any chunking; the sliding pool's by
    one of the chunkings that reach its prefill term (as in test_kv_sliding_traces.py)."""
    peak = {"self": 0, "sliding": 0}
    for first in range(min(prompt_tokens, window_tokens + 2 * tokens_per_block + chunk_tokens) + 1):
        for tail_first in (first, max(0, prompt_tokens - chunk_tokens - first)):
            trace = ScheduleTrace(prompt_tokens, max_new_tokens, schedule, tokens_per_block, window_tokens,
                                  chunk_tokens)
            trace.run(split(prompt_tokens, min(tail_first, prompt_tokens), chunk_tokens), spread_parents,
                      max_new_tokens)
            peak = {name: max(peak[name], trace.peak[name]) for name in peak}
            assert peak["self"] == trace.required["self"]
        if peak["sliding"] == trace.required["sliding"]:
            break
    assert peak == trace.required


@settings(max_examples=300, deadline=None)
@given(**SIZES, beams_own_all=st.booleans())
def test_fast_schedule_bound_equals_its_definition(prompt_tokens, max_new_tokens, schedule, tokens_per_block,
                                                   window_tokens, chunk_tokens, beams_own_all):
    for window in (None, window_tokens):
        assert (scheduled_blocks(prompt_tokens, max_new_tokens, schedule, tokens_per_block, window,
                                 beams_own_all)
                == scheduled_blocks_reference(prompt_tokens, max_new_tokens, schedule, tokens_per_block,
                                               window, beams_own_all))


@settings(max_examples=200, deadline=None)
@given(**SIZES)
def test_constant_schedule_is_the_plain_bound(prompt_tokens, max_new_tokens, schedule, tokens_per_block,
                                              window_tokens, chunk_tokens):
    width = schedule[0]
    assert scheduled_blocks(prompt_tokens, max_new_tokens, (width,) * 3, tokens_per_block) == \
        full_attention_blocks(prompt_tokens, max_new_tokens, width, tokens_per_block)
    assert scheduled_sliding_window_blocks(prompt_tokens, max_new_tokens, (width,), tokens_per_block,
                                           window_tokens, chunk_tokens) == \
        sliding_window_blocks(prompt_tokens, max_new_tokens, width, tokens_per_block, window_tokens,
                              chunk_tokens)


def test_schedule_bound_examples():
    # a 2,500-token prompt, 3 item codes + EOS: every beam writes within the partial prompt block, so
    # the widest step decides ([64, 256, 1024] saves compute, not KV, against a fixed 1,024)
    assert scheduled_blocks(2500, 4, (64, 256, 1024), 16) == full_attention_blocks(2500, 4, 1024, 16) \
        == 156 + 1024
    # a long generation: the early narrow steps' blocks stay shared by the wide beams
    assert scheduled_blocks(16, 64, (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 8), 16) == \
        1 + 1 + 8 * 3


def test_preempted_schedule_counts_every_block_per_beam():
    # a resume re-feeds each beam into its own blocks: every block per beam, at the widest step
    schedule = (1,) * 16 + (8,)
    assert scheduled_blocks(16, 64, schedule, 16, beams_own_all=True) == 1 + 8 * 4
