"""The cost-model contract, checked against the real allocator.

Hypothesis drives the managers through beam-search traces (forks, prunes, finished beams, every
beam diverging, chunked prefill) and checks, after every single allocator call, that the distinct
blocks the request holds never exceed `required_blocks`. The pool is sized to exactly
`required_blocks`, so an overshoot would also fail as OutOfBlocksError. Adversarial traces show the
bound is reached exactly, and every trace ends with the pool's free count back at its start.

The traces follow the engine's protocol: the prompt's forward pass chooses the first token, and a
decode step writes one token per beam and chooses the next, so N generated tokens take N - 1 steps
(the N-th token is chosen, never written).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from kv_helpers import allocate_many, num_used_blocks

from widebeam.kv.block_pool import BlockPool
from widebeam.kv.budget import KVRequest, full_attention_blocks
from widebeam.kv.full_attention import FullAttentionManager
from widebeam.kv.spec import FullAttentionSpec
from widebeam.kv.tables import BlockTable, Holding

SPEC = FullAttentionSpec(name="self", num_layers=1, num_kv_heads=1, head_dim=8)
TOKENS_PER_BLOCK = st.sampled_from([1, 2, 4, 16])


class CheckedTrace:
    """Runs beam operations on a real manager and checks the bound after each one."""

    def __init__(self, prompt_tokens: int, max_new_tokens: int, beam_width: int, tokens_per_block: int):
        self.request = KVRequest(prompt_tokens, max_new_tokens, beam_width)
        self.required_blocks = full_attention_blocks(prompt_tokens, max_new_tokens, beam_width,
                                                     tokens_per_block)
        self.pool = BlockPool(self.required_blocks, name="self")
        self.manager = FullAttentionManager(SPEC, self.pool, tokens_per_block)
        assert self.manager.required_blocks(self.request) == self.required_blocks
        self.holding = Holding()
        self.peak_blocks = 0

    def check(self) -> None:
        held = self.holding.num_held_blocks
        assert held == num_used_blocks(self.pool), "holding count drifted from the pool"
        assert held <= self.required_blocks, f"held {held} > required {self.required_blocks}"
        self.peak_blocks = max(self.peak_blocks, held)

    def prefill(self, chunk_tokens: list[int]) -> list[BlockTable]:
        prompt = self.manager.new_table(self.holding)
        for chunk in chunk_tokens:
            self.manager.append_slots(prompt, chunk)
            self.check()
        beams = []
        for _ in range(self.request.beam_width):
            beams.append(self.manager.fork(prompt))
            self.check()
        self.manager.release(prompt)
        self.check()
        return beams

    def step(self, beams: list[BlockTable], parent_indices: list[int]) -> list[BlockTable]:
        beams = self.manager.reorder(beams, parent_indices)
        self.check()
        for beam in beams:
            self.manager.append_slots(beam)
            self.check()
        self.manager.take_copies()
        return beams

    def finish(self, beams: list[BlockTable]) -> None:
        for beam in beams:
            self.manager.release(beam)
            self.check()
        assert self.pool.num_free_blocks == self.pool.num_blocks
        assert self.holding.num_held_blocks == 0


def _chunks(data, prompt_tokens: int) -> list[int]:
    """Split the prompt into random prefill chunks."""
    chunks, left = [], prompt_tokens
    while left:
        chunk = data.draw(st.integers(1, left))
        chunks.append(chunk)
        left -= chunk
    return chunks


@settings(max_examples=300, deadline=None)
@given(
    prompt_tokens=st.integers(1, 70),
    max_new_tokens=st.integers(1, 24),
    beam_width=st.integers(1, 8),
    tokens_per_block=TOKENS_PER_BLOCK,
    data=st.data(),
)
def test_random_traces_never_exceed_required(prompt_tokens, max_new_tokens, beam_width, tokens_per_block,
                                             data):
    trace = CheckedTrace(prompt_tokens, max_new_tokens, beam_width, tokens_per_block)
    beams = trace.prefill(_chunks(data, prompt_tokens))
    for _ in range(data.draw(st.integers(0, max_new_tokens - 1), label="steps")):
        # Beams may finish (fewer survivors) and survivors may share parents in any pattern.
        num_live = data.draw(st.integers(1, len(beams)), label="live") if beams else 0
        if num_live == 0:
            break
        parents = data.draw(st.lists(st.integers(0, len(beams) - 1), min_size=num_live, max_size=num_live))
        beams = trace.step(beams, parents)
    trace.finish(beams)


ADVERSARIAL_PATTERNS = {
    # every beam continues itself: all W beams diverge from step one and keep their own blocks
    "all_diverge": lambda width, step: list(range(width)),
    # the beams rotate parents each step: every partial block is shared, then copied
    "rotate": lambda width, step: [(i + step) % width for i in range(width)],
    # two parents swap roles while the rest diverge
    "swap_pairs": lambda width, step: [i ^ 1 if (i ^ 1) < width else i for i in range(width)],
}


@settings(max_examples=200, deadline=None)
@given(
    prompt_tokens=st.integers(1, 70),
    max_new_tokens=st.integers(1, 24),
    beam_width=st.integers(1, 8),
    tokens_per_block=TOKENS_PER_BLOCK,
    pattern=st.sampled_from(sorted(ADVERSARIAL_PATTERNS)),
)
def test_adversarial_traces_reach_required_exactly(prompt_tokens, max_new_tokens, beam_width,
                                                   tokens_per_block, pattern):
    trace = CheckedTrace(prompt_tokens, max_new_tokens, beam_width, tokens_per_block)
    beams = trace.prefill([prompt_tokens])
    for step in range(max_new_tokens - 1):
        beams = trace.step(beams, ADVERSARIAL_PATTERNS[pattern](beam_width, step))
    assert trace.peak_blocks == trace.required_blocks
    trace.finish(beams)


@settings(max_examples=150, deadline=None)
@given(
    prompt_tokens=st.integers(1, 70),
    max_new_tokens=st.integers(1, 24),
    beam_width=st.integers(2, 8),
    tokens_per_block=TOKENS_PER_BLOCK,
)
def test_one_surviving_branch_holds_like_greedy(prompt_tokens, max_new_tokens, beam_width, tokens_per_block):
    """All beams pruned down to one lineage: the request holds what a single sequence would."""
    trace = CheckedTrace(prompt_tokens, max_new_tokens, beam_width, tokens_per_block)
    beams = trace.prefill([prompt_tokens])
    for _ in range(max_new_tokens - 1):
        beams = trace.step(beams, [0] * beam_width)
    survivor = beams[0]
    for beam in beams[1:]:
        trace.manager.release(beam)
    assert trace.holding.num_held_blocks == full_attention_blocks(prompt_tokens, max_new_tokens, 1,
                                                                  tokens_per_block)
    trace.finish([survivor])


def test_copy_on_write_copies_only_the_shared_partial_block():
    trace = CheckedTrace(prompt_tokens=10, max_new_tokens=4, beam_width=3, tokens_per_block=4)
    beams = trace.prefill([10])
    prompt_full_blocks = beams[0].block_ids[:2]
    partial_block = beams[0].block_ids[2]
    beams = trace.step(beams, [0, 1, 2])
    copies = trace.manager.pending_copies  # take_copies already drained the step's copies
    assert copies == []
    # Every beam still shares the two full prompt blocks; the partial block was copied twice and
    # the last writer kept the original.
    for beam in beams:
        assert beam.block_ids[:2] == prompt_full_blocks
    third_blocks = [beam.block_ids[2] for beam in beams]
    assert len(set(third_blocks)) == 3 and partial_block in third_blocks
    assert all(trace.pool.ref_count(b) == 3 for b in prompt_full_blocks)
    trace.finish(beams)


def test_copies_are_queued_src_to_dst():
    # N = 2: one decode step writes one token per beam (N = 1 writes nothing past the prompt)
    trace = CheckedTrace(prompt_tokens=3, max_new_tokens=2, beam_width=2, tokens_per_block=4)
    beams = trace.prefill([3])
    shared = beams[0].block_ids[0]
    beams = trace.manager.reorder(beams, [0, 1])
    trace.manager.append_slots(beams[0])
    (copy,) = trace.manager.take_copies()
    assert copy[0] == shared and copy[1] == beams[0].block_ids[0] != shared
    trace.manager.append_slots(beams[1])
    assert trace.manager.take_copies() == []  # the last sharer writes in place
    trace.finish(beams)


def _reorder_by_release_and_fork(manager, beams, parents):
    """The reference `reorder`: every unchosen parent released whole, then every fork counted whole."""
    num_children = [parents.count(i) for i in range(len(beams))]
    for beam, count in zip(beams, num_children):
        if count == 0:
            manager.release(beam)
    kept, children = set(), []
    for parent in parents:
        children.append(manager.fork(beams[parent]) if parent in kept else beams[parent])
        kept.add(parent)
    return children


@settings(max_examples=150, deadline=None)
@given(
    prompt_tokens=st.integers(1, 70),
    max_new_tokens=st.integers(2, 12),
    beam_width=st.integers(1, 8),
    tokens_per_block=TOKENS_PER_BLOCK,
    data=st.data(),
)
def test_reorder_passing_references_on_equals_releasing_and_forking_whole_tables(
        prompt_tokens, max_new_tokens, beam_width, tokens_per_block, data):
    # `reorder` lets a released parent's leading blocks pass to a fork untouched; the ref counts,
    # the blocks freed and their order (the ids handed out next) must be those of the plain way.
    traces = [CheckedTrace(prompt_tokens, max_new_tokens, beam_width, tokens_per_block) for _ in range(2)]
    beams = [trace.prefill([prompt_tokens]) for trace in traces]
    for _ in range(data.draw(st.integers(1, max_new_tokens - 1), label="steps")):
        num_live = data.draw(st.integers(1, len(beams[0])), label="live")
        parents = data.draw(st.lists(st.integers(0, len(beams[0]) - 1), min_size=num_live, max_size=num_live))
        beams = [traces[0].manager.reorder(beams[0], parents),
                 _reorder_by_release_and_fork(traces[1].manager, beams[1], parents)]
        for trace, trace_beams in zip(traces, beams):
            trace.check()
            for beam in trace_beams:
                trace.manager.append_slots(beam)
        assert [b.block_ids for b in beams[0]] == [b.block_ids for b in beams[1]]
        assert traces[0].manager.take_copies() == traces[1].manager.take_copies()
        pools = [trace.pool for trace in traces]
        assert [pools[0].ref_count(b) for b in range(pools[0].num_blocks)] == \
            [pools[1].ref_count(b) for b in range(pools[1].num_blocks)]
    free_order = [allocate_many(trace.pool, trace.pool.num_free_blocks) for trace in traces]
    assert free_order[0] == free_order[1]
