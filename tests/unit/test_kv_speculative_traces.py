"""Speculative decoding's round protocol against the real coordinator (`RequestKV`) and allocator.

Each round, every live sequence (C tokens committed, k pending: the last chosen token plus the
k - 1 accepted speculative tokens fed again) does `decode_slots(k + D)`, is truncated back to C + k
after verification, beams finishing on a stop string are dropped, and `reorder(parents)` makes the
next beams; the next round's k is the number s of steps accepted, 1 <= s <= min(depth + 1, N - g).
Every pool (full, sliding, cross) is sized to exactly the request's `required_blocks` with
`refeed_tokens = D`, so any overshoot fails as OutOfBlocksError; the held count is checked against
the bound after every single allocation and after every operation, and `free()` gives it all back.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_helpers import num_used_blocks
from kv_reference_bounds import sliding_window_blocks_reference

from widebeam.defaults import MAX_NUM_SPECULATIVE_TOKENS
from widebeam.kv.budget import (
    KVRequest,
    full_attention_blocks,
    sliding_window_blocks,
)
from widebeam.kv.cache import KVCache
from widebeam.kv.spec import CrossAttentionSpec, FullAttentionSpec, SlidingWindowSpec

COMMON = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 8}
# D over the range the engine accepts (num_speculative_tokens), small values drawn as often as large
SPECULATIVE_TOKENS = st.integers(0, 5) | st.integers(6, MAX_NUM_SPECULATIVE_TOKENS)


class SpecTrace:
    """One request on a cache whose pools hold exactly its `required_blocks`; checks every instant."""

    def __init__(self, prompt_tokens, max_new_tokens, beam_width, tokens_per_block, window_tokens,
                 speculative_tokens, chunk_tokens=None, encoder_tokens=0, refeed_tokens=None):
        self.p, self.n, self.w, self.d = prompt_tokens, max_new_tokens, beam_width, speculative_tokens
        refeed = speculative_tokens if refeed_tokens is None else refeed_tokens
        self.request = KVRequest(prompt_tokens, max_new_tokens, beam_width, extra_tokens=speculative_tokens,
                                 encoder_tokens=encoder_tokens, refeed_tokens=refeed)
        specs = [FullAttentionSpec(name="full", **COMMON),
                 SlidingWindowSpec(name="sliding", window_tokens=window_tokens, **COMMON)]
        if encoder_tokens:
            specs.append(CrossAttentionSpec(name="cross", **COMMON))
        sizing = KVCache([(s, 0) for s in specs], tokens_per_block, chunk_tokens)
        self.required = {b.pool: b.required_blocks for b in sizing.budgets(self.request)}
        self.cache = KVCache([(s, self.required[s.name]) for s in specs], tokens_per_block, chunk_tokens)
        self.start_free = self.cache.num_free_blocks()
        self.peak = dict.fromkeys(self.required, 0)
        for name, manager in self.cache.managers.items():
            self._check_every_allocation(name, manager.pool)
        self.kv = self.cache.new_request()
        if encoder_tokens:
            assert len(self.kv.allocate_shared(encoder_tokens)["cross"]) == encoder_tokens
        self.g = 0  # tokens generated so far

    def _check_every_allocation(self, name, pool):
        allocate = pool.allocate

        def checked_allocate():
            block_id = allocate()
            self.check(name)
            return block_id

        pool.allocate = checked_allocate

    def check(self, *names):
        for name in names or self.required:
            pool = self.cache[name].pool
            held = num_used_blocks(pool)
            assert held <= self.required[name], f"{name}: held {held} > required {self.required[name]}"
            self.peak[name] = max(self.peak[name], held)

    def check_holdings(self):
        self.check()
        for name, manager in self.cache.managers.items():
            assert self.kv.holdings[name].num_held_blocks == num_used_blocks(manager.pool), name

    def prefill(self, chunks):
        assert sum(chunks) == self.p
        for chunk in chunks:
            assert len(self.kv.prefill_slots(chunk)["full"]) == chunk
            self.check_holdings()
        self.kv.reorder([0] * self.w)  # the beams fork from the prompt
        self.check_holdings()
        self.g, self.k = 1, 1  # the prompt's forward pass chose the first token; it is pending

    @property
    def running(self):
        return self.g <= self.n - 1 and self.kv.num_sequences > 0

    def round(self, drops, parents, accepted):
        """One round: write k pending + D draft tokens, roll back the drafts, drop, reorder."""
        assert self.running and 1 <= self.k <= self.d + 1
        live, committed = self.kv.num_sequences, self.kv.num_tokens(0)
        assert committed + self.k == self.p + self.g
        slots = self.kv.decode_slots(self.k + self.d)
        assert len(slots) == live and all(len(s["full"]) == self.k + self.d for s in slots)
        self.check_holdings()
        self.cache.take_copies()
        for i in range(live):
            self.kv.truncate(i, committed + self.k)
            self.check_holdings()
        assert all(self.kv.num_tokens(i) == committed + self.k for i in range(live))
        if drops:
            self.kv.drop(drops)
            self.check_holdings()
        if self.kv.num_sequences:
            self.kv.reorder(parents)
            self.check_holdings()
        assert 1 <= accepted <= min(self.d + 1, self.n - self.g)
        self.g += accepted
        self.k = accepted

    def finish(self):
        self.kv.free()
        self.kv.free()  # abort after finish frees nothing twice
        assert self.cache.num_free_blocks() == self.start_free
        assert all(h.num_held_blocks == 0 for h in self.kv.holdings.values())


def draw_parents(data, live, beam_width):
    kind = data.draw(st.sampled_from(["diverge", "one", "random"]))
    if kind == "diverge":  # every old beam continued once: no fork, all keep their own blocks
        return data.draw(st.permutations(range(live)))
    if kind == "one":  # every new beam continues one parent: the others are pruned
        return [data.draw(st.integers(0, live - 1))] * data.draw(st.integers(1, beam_width))
    return data.draw(st.lists(st.integers(0, live - 1), min_size=1, max_size=beam_width))


@settings(max_examples=1000, deadline=None)
@given(data=st.data(), prompt_tokens=st.integers(1, 40), max_new_tokens=st.integers(1, 16),
       beam_width=st.integers(1, 5), tokens_per_block=st.sampled_from([1, 2, 3, 4, 8, 16]),
       window_tokens=st.integers(3, 20), speculative_tokens=SPECULATIVE_TOKENS,
       chunk_tokens=st.integers(1, 24), encoder_tokens=st.integers(0, 20))
def test_random_speculative_rounds_stay_within_every_pool(data, prompt_tokens, max_new_tokens, beam_width,
                                                          tokens_per_block, window_tokens, speculative_tokens,
                                                          chunk_tokens, encoder_tokens):
    trace = SpecTrace(prompt_tokens, max_new_tokens, beam_width, tokens_per_block, window_tokens,
                      speculative_tokens, chunk_tokens, encoder_tokens)
    chunks, left = [], prompt_tokens
    while left:
        chunks.append(data.draw(st.integers(1, min(left, chunk_tokens))))
        left -= chunks[-1]
    trace.prefill(chunks)
    while trace.running and data.draw(st.integers(0, 9)):  # the request may also be aborted
        live = trace.kv.num_sequences
        drops = []
        if data.draw(st.booleans()):  # beams that hit a stop string (possibly all of them)
            drops = data.draw(st.lists(st.integers(0, live - 1), max_size=live, unique=True))
        parents = draw_parents(data, live - len(drops), beam_width) if live > len(drops) else []
        depth = data.draw(st.integers(0, speculative_tokens))
        accepted = data.draw(st.integers(1, min(depth + 1, max_new_tokens - trace.g)))
        trace.round(drops, parents, accepted)
    trace.finish()


def adversarial_full_trace(prompt_tokens, max_new_tokens, beam_width, tokens_per_block, speculative_tokens,
                           window_tokens=3):
    """Whole-prompt prefill, then every beam diverging every round, each round accepting as many
    tokens as allowed while still landing on a round that starts at g = N - 1."""
    trace = SpecTrace(prompt_tokens, max_new_tokens, beam_width, tokens_per_block, window_tokens,
                      speculative_tokens)
    trace.prefill([prompt_tokens])
    while trace.running:
        last_round = trace.g == max_new_tokens - 1
        accepted = 1 if last_round else min(speculative_tokens + 1, max_new_tokens - 1 - trace.g)
        trace.round([], list(range(beam_width)), accepted)
    trace.finish()
    return trace


@settings(max_examples=600, deadline=None)
@given(prompt_tokens=st.integers(1, 40), max_new_tokens=st.integers(1, 16), beam_width=st.integers(1, 5),
       tokens_per_block=st.sampled_from([1, 2, 3, 4, 8, 16]), speculative_tokens=SPECULATIVE_TOKENS)
def test_adversarial_rounds_reach_the_full_attention_bound(prompt_tokens, max_new_tokens, beam_width,
                                                           tokens_per_block, speculative_tokens):
    """A round that starts with g <= N - 1 tokens generated has C + k = P + g and writes positions
    C .. C + k - 1 + D, so the highest position ever written is P + N - 2 + D: the N-th generated
    token is never fed (nothing comes after it). The adversarial trace holds, per beam, the blocks
    of P mod T + N - 1 + D tokens, which is what `full_attention_blocks(P, N, W, T, D)` counts:
    exactly the bound. At N = 1 no round runs at all (the prompt's forward pass chose the only
    token): the prompt alone, once."""
    p, n, w, t, d = prompt_tokens, max_new_tokens, beam_width, tokens_per_block, speculative_tokens
    trace = adversarial_full_trace(p, n, w, t, d)
    required = trace.required["full"]
    assert required == full_attention_blocks(p, n, w, t, d)
    reachable = -(-p // t) if n == 1 else p // t + -(-(p % t + n + d - 1) // t) * w
    assert trace.peak["full"] == reachable
    assert trace.peak["full"] >= required - beam_width
    assert trace.peak["full"] == required


def adversarial_sliding_peak(prompt_tokens, max_new_tokens, beam_width, tokens_per_block, window_tokens,
                             speculative_tokens):
    """For every committed length x a round can start at, one trace starts a round there with as many
    pending tokens as allowed (k = min(D + 1, N - 1 - (x - P)), after single-token rounds), every beam
    diverging; returns (the largest sliding-pool peak of these traces, the pool's required blocks)."""
    p, n, d = prompt_tokens, max_new_tokens, speculative_tokens
    peak = required = 0
    for x in range(p, max(p + n - 1, p + 1)):  # N = 1: the prompt alone, no round
        pending = 1 if x == p else min(d + 1, n - 1 - (x - p))
        trace = SpecTrace(p, n, beam_width, tokens_per_block, window_tokens, d)
        trace.prefill([p])
        while trace.running and trace.kv.num_tokens(0) < x:  # rounds of one token up to x
            trace.round([], list(range(beam_width)), pending if trace.kv.num_tokens(0) + 1 == x else 1)
        if trace.running:
            trace.round([], list(range(beam_width)), 1)  # the round at x, with k = pending
        trace.finish()
        peak, required = max(peak, trace.peak["sliding"]), trace.required["sliding"]
    return peak, required


@settings(max_examples=150, deadline=None)
@given(prompt_tokens=st.integers(1, 40), max_new_tokens=st.integers(1, 12) | st.integers(13, 40),
       beam_width=st.integers(1, 4), tokens_per_block=st.sampled_from([1, 2, 3, 4, 8]),
       window_tokens=st.integers(3, 20) | st.integers(21, 64), speculative_tokens=SPECULATIVE_TOKENS)
def test_adversarial_rounds_reach_the_sliding_bound(
        prompt_tokens, max_new_tokens, beam_width, tokens_per_block, window_tokens, speculative_tokens):
    """The bound's writes reach position P + N - 2 + D, the last a round ever writes (see the
    full-attention test above), so the largest of the adversarial traces reaches it exactly, and it
    is the reference loop's value."""
    peak, required = adversarial_sliding_peak(prompt_tokens, max_new_tokens, beam_width, tokens_per_block,
                                              window_tokens, speculative_tokens)
    assert required - beam_width <= peak <= required
    assert peak == required
    d = speculative_tokens
    assert required == sliding_window_blocks_reference(prompt_tokens, max_new_tokens, beam_width,
                                                        tokens_per_block, window_tokens, None, d, d)


def test_the_audit_point_holds_its_reference_blocks():
    """T=16, window 128, P=91, N=90, W=3, D=R=25: beams diverging in speculative rounds hold 29 blocks
    of the sliding pool at once, what the reference loop gives; a pool sized by a fast bound that
    forgets the re-feed tail (27) runs dry."""
    peak, required = adversarial_sliding_peak(91, 90, 3, 16, 128, 25)
    assert peak == required == sliding_window_blocks_reference(91, 90, 3, 16, 128, None, 25, 25) == 29


def test_the_refeed_term_is_what_keeps_the_sliding_pool_from_running_dry():
    """Without R the sliding bound assumes a round writes x .. x + D; re-fed accepted tokens write up
    to x + R + D from the same trim, and the pool runs out."""
    # window 4, T 1: a round at x committed with k = D + 1 holds w - 1 + k + D slots per beam
    args = {"prompt_tokens": 8, "max_new_tokens": 12, "beam_width": 2, "tokens_per_block": 1,
            "window_tokens": 4, "speculative_tokens": 3}
    with_refeed = sliding_window_blocks(8, 12, 2, 1, 4, None, 3, refeed_tokens=3)
    without_refeed = sliding_window_blocks(8, 12, 2, 1, 4, None, 3)
    assert with_refeed == without_refeed + 2 * 3
    assert SpecTrace(**args).required["sliding"] == with_refeed
    trace = adversarial_full_trace(**args)
    assert trace.peak["sliding"] == with_refeed


def test_zero_refeed_is_the_old_bound_and_negative_is_refused():
    for args in [(10, 5, 3, 4, 6, 8, 2), (1, 1, 1, 1, 1, None, 0), (40, 16, 5, 16, 20, 7, 5)]:
        assert sliding_window_blocks(*args) == sliding_window_blocks(*args, refeed_tokens=0)
    with pytest.raises(ValueError, match="refeed_tokens"):
        KVRequest(4, 4, refeed_tokens=-1)
    with pytest.raises(ValueError, match="refeed_tokens"):
        sliding_window_blocks(4, 4, 1, 4, 4, refeed_tokens=-1)


def test_fit_hints_keep_the_refeed_tokens():
    spec = SlidingWindowSpec(name="sliding", window_tokens=8, **COMMON)
    request = KVRequest(20, 30, 4, extra_tokens=4, refeed_tokens=4)
    need = KVCache([(spec, 0)], 2)["sliding"].required_blocks(request)
    assert need > KVCache([(spec, 0)], 2)["sliding"].required_blocks(KVRequest(20, 30, 4, extra_tokens=4))
    manager = KVCache([(spec, need - 1)], 2)["sliding"]
    hints = manager.fit_hints(request)
    width = hints["beam_width_that_fits"]
    assert 1 <= width < 4
    assert manager.required_blocks(KVRequest(20, 30, width, extra_tokens=4, refeed_tokens=4)) <= need - 1
    assert manager.required_blocks(KVRequest(20, 30, width + 1, extra_tokens=4, refeed_tokens=4)) > need - 1
