"""Prefix reuse under the real scheduler and allocator: random workloads with shared prefixes.

A simulator plays the engine's part (schedule, take slots, "run" the step by writing each token
into the slot the allocator gave it, then choose beams) over a `KVCache` with a full-attention pool
and a sliding-window pool, and checks:
- after every step, every request holds at most its `required_blocks` in every pool, and the
  pools' counts agree (in use + free + evictable = total);
- every block a sequence reads holds that sequence's own tokens (so no hit ever serves a block
  evicted and rewritten, and no sliding pool serves a block its window released);
- a hit block holds the prompt's tokens at the hit's positions;
- nothing admitted runs out of blocks, everything admitted finishes, aborted requests included,
  and at the end every block is free or cached-evictable (pinned ones excepted);
- a request rejected as never-fit runs out of blocks when run alone on a cache holding only the
  pinned prefixes (its worst case, every beam diverging, really does not fit).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_helpers import allocate_many, num_used_blocks

from widebeam.errors import OutOfBlocksError, RequestTooLargeError
from widebeam.kv.cache import KVCache
from widebeam.kv.spec import FullAttentionSpec, SlidingWindowSpec
from widebeam.kv.tables import DROPPED
from widebeam.sched.admission import admit_check
from widebeam.sched.scheduler import Scheduler

FULL = FullAttentionSpec(name="self", num_layers=1, num_kv_heads=1, head_dim=8)


def sliding(window_tokens: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(name="sliding", num_layers=1, num_kv_heads=1, head_dim=8,
                             window_tokens=window_tokens)


class SimRequest:
    """One request as the scheduler sees it (the `SchedulableRequest` protocol; its blocks through the
    real `RequestKV`), with the engine's step order: prefill chunks, then beams that fork, diverge,
    and finish."""

    def __init__(self, request_id, cache, prompt, max_new_tokens, beam_width, rng, max_seq_len=10_000):
        self.request_id = request_id
        self.priority = 0  # one priority: first come, first served
        self.prompt = prompt
        self.beam_width = beam_width
        self.key = cache.prefix_key(prompt)
        self.admission = admit_check(cache, max_seq_len, len(prompt), max_new_tokens, beam_width,
                                     key=self.key)
        self.max_new_tokens = max_new_tokens
        self.kv = cache.new_request(self.key)
        self.rng = rng
        self.num_prefilled_tokens = 0
        self.beams: list[list[int]] = []  # generated tokens per live beam
        self.finished = False
        self.num_preemptions = 0  # never preempted (test_scheduling_policies_traces.py's requests are)

    # -- the scheduler's view --
    @property
    def prompt_done(self):
        return self.num_prefilled_tokens == len(self.prompt)

    @property
    def num_prompt_tokens_left(self):
        return len(self.prompt) - self.num_prefilled_tokens

    @property
    def num_feed_tokens(self):
        return 1 if self.beams else 0  # one token per live beam a decode step

    def num_step_tokens(self, num_draft_tokens=0):
        return len(self.beams)

    def num_round_tokens(self, num_draft_tokens=0):
        return self.num_feed_tokens  # no drafter: a round feeds its pending tokens alone

    split = None  # its rounds go whole (a split round's rows are the engine's: test_split_rounds.py)

    def num_splittable_rows(self, num_draft_tokens=0):
        return 0

    def take_prefix_hit(self, hit):
        self.on_hit(self, hit)
        self.kv.take_hit(hit)
        self.num_prefilled_tokens = hit.num_tokens
        self.hit = hit


class Simulator:
    def __init__(self, cache: KVCache, max_num_batched_tokens: int, rng: random.Random):
        self.cache = cache
        self.scheduler = Scheduler(cache, max_num_batched_tokens)
        self.rng = rng
        self.t = cache.tokens_per_block
        # pool -> slot -> the token written there (the K/V stand-in)
        self.written: dict[str, dict[int, int]] = {name: {} for name in cache.managers}
        self.outputs: dict[str, list[list[int]]] = {}
        self.num_aborted = 0
        self.early_finish_probability = 0.03  # every beam ends on EOS before max_new_tokens

    def add(self, request: SimRequest):
        request.on_hit = self.check_hit
        self.scheduler.add(request)

    def check_hit(self, request: SimRequest, hit):
        """A hit's blocks hold the prompt's own tokens at the hit's positions."""
        for name, entries in hit.block_ids.items():
            for i, block_id in enumerate(entries):
                if block_id != DROPPED:
                    got = [self.written[name].get(block_id * self.t + o) for o in range(self.t)]
                    assert got == request.prompt[i * self.t:(i + 1) * self.t], \
                        f"{name}: hit block {i} is stale"

    def sequence_tokens(self, request: SimRequest, seq: int) -> list[int]:
        return request.prompt + (request.beams[seq] if request.beams else [])

    def check_reads(self, request: SimRequest, seq: int, num_tokens: int):
        """Every block sequence `seq` reads holds its own tokens up to `num_tokens` (a sliding
        pool: those its last query's window sees)."""
        tokens = self.sequence_tokens(request, seq)
        for name, block_ids in request.kv.block_tables(seq).items():
            manager = self.cache[name]
            first = max(0, num_tokens - manager.window_tokens) if hasattr(manager, "window_tokens") else 0
            for pos in range(first, num_tokens):
                block_id = block_ids[pos // self.t]
                assert block_id != DROPPED, f"{name}: position {pos} was released but is still in the window"
                got = self.written[name].get(block_id * self.t + pos % self.t)
                assert got == tokens[pos], f"{name}: position {pos} reads {got}, expected {tokens[pos]}"

    def check_counts(self):
        for name, manager in self.cache.managers.items():
            pool = manager.pool
            assert num_used_blocks(pool) + pool.num_free_blocks == pool.num_blocks
            for request in self.scheduler.running:
                held = request.kv.holdings[name].num_held_blocks
                assert held <= request.admission.required_blocks.get(name, 0), (name, held)

    def apply_copies(self):
        for name, copies in self.cache.take_copies().items():
            written = self.written[name]
            for src, dst, num_tokens in copies:  # only the leading `num_tokens` slots are copied
                for offset in range(self.t):
                    if offset < num_tokens and src * self.t + offset in written:
                        written[dst * self.t + offset] = written[src * self.t + offset]
                    else:
                        written.pop(dst * self.t + offset, None)

    def write(self, request, seq, slots, first_position):
        tokens = self.sequence_tokens(request, seq)
        for name, pool_slots in slots.items():
            for i, slot in enumerate(pool_slots):
                self.written[name][slot] = tokens[first_position + i]

    def step(self, abort_probability=0.0):
        schedule = self.scheduler.schedule()
        work = []
        for item in schedule.scheduled:
            request = item.request
            if item.num_prompt_tokens:
                start = request.num_prefilled_tokens
                slots = request.kv.prefill_slots(item.num_prompt_tokens)
                request.num_prefilled_tokens += item.num_prompt_tokens
                work.append((request, [(0, slots, start)]))
            else:
                position = len(request.prompt) + len(request.beams[0]) - 1
                slots = request.kv.decode_slots()
                work.append((request, [(i, s, position) for i, s in enumerate(slots)]))
            self.check_counts()
        self.apply_copies()
        for request, seqs in work:  # the forward pass: write every token, then read
            for seq, slots, position in seqs:
                self.write(request, seq, slots, position)
            for seq, slots, position in seqs:
                self.check_reads(request, seq, position + len(next(iter(slots.values()), [])))
        for request, _ in work:
            request.kv.register_computed(request.num_prefilled_tokens)
            if self.rng.random() < abort_probability:
                self.finish(request, aborted=True)
                continue
            if not request.prompt_done:
                continue
            self.advance(request)
        self.check_counts()

    def advance(self, request):
        """Choose the next tokens: random parents (beams diverge, share or die), new tokens."""
        rng = request.rng
        if not request.beams:
            parents = [0] * request.beam_width
            request.beams = [[] for _ in parents]
        else:
            live = len(request.beams)
            pattern = rng.random()
            if pattern < 0.4:
                parents = list(range(live))  # every beam diverges
            else:
                parents = [rng.randrange(live) for _ in range(live)]
        request.beams = [request.beams[p] + [rng.randrange(1000, 2000)] for p in parents]
        if len(request.beams[0]) >= request.max_new_tokens or rng.random() < self.early_finish_probability:
            self.finish(request)
            return
        request.kv.reorder(parents)
        if len(request.beams) > 1 and rng.random() < 0.1:  # a beam ends on a stop string
            dropped = rng.randrange(len(request.beams))
            request.kv.drop([dropped])
            del request.beams[dropped]

    def finish(self, request, aborted=False):
        request.kv.free()
        self.scheduler.remove(request)
        request.finished = True
        self.num_aborted += aborted
        self.outputs[request.request_id] = request.beams

    def run(self, max_steps=20_000, abort_probability=0.0):
        steps = 0
        while self.scheduler.has_unfinished():
            self.step(abort_probability)
            steps += 1
            assert steps < max_steps, "the scheduler did not finish"


def pin(sim: Simulator, prefix: list[int], new_request=SimRequest) -> None:
    """Compute a prefix as a one-token request, then pin it (as widebeam/pinning.py does)."""
    sim.add(new_request("pin", sim.cache, prefix, 1, 1, sim.rng))
    sim.run()
    sim.cache.pin(sim.cache.prefix_key(prefix))


def run_alone_diverging(cache: KVCache, prompt, max_new_tokens, beam_width):
    """Run one request on `cache` without admission, every beam diverging and writing all
    `max_new_tokens` tokens: the worst case `required_blocks` is defined for (the engine never
    feeds the last token, so it writes one fewer)."""
    kv = cache.new_request(cache.prefix_key(prompt))
    hit = cache.find_hit(kv.key)
    kv.take_hit(hit)
    kv.prefill_slots(len(prompt) - hit.num_tokens)
    kv.register_computed(len(prompt))
    kv.reorder([0] * beam_width)
    for _ in range(max_new_tokens):
        kv.decode_slots()
        kv.reorder(list(range(beam_width)))
    kv.free()


def make_cache(num_full_blocks, num_sliding_blocks, tokens_per_block, window_tokens, chunk):
    pools = [(FULL, num_full_blocks)]
    if num_sliding_blocks:
        pools.append((sliding(window_tokens), num_sliding_blocks))
    return KVCache(pools, tokens_per_block, chunk, enable_prefix_caching=True)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), tokens_per_block=st.sampled_from([1, 2, 4, 8]),
       window_tokens=st.integers(2, 24), with_sliding=st.booleans(), num_full_blocks=st.integers(8, 80),
       num_sliding_blocks=st.integers(6, 40), chunk=st.integers(3, 48), num_pins=st.integers(0, 1),
       abort_probability=st.sampled_from([0.0, 0.05]))
def test_random_workloads_with_shared_prefixes(seed, tokens_per_block, window_tokens, with_sliding,
                                               num_full_blocks,
                                               num_sliding_blocks, chunk, num_pins, abort_probability):
    run_random_workload(seed, tokens_per_block, window_tokens, with_sliding, num_full_blocks,
                        num_sliding_blocks, chunk, num_pins, abort_probability)


def run_random_workload(seed, tokens_per_block, window_tokens, with_sliding, num_full_blocks,
                        num_sliding_blocks,
                        chunk, num_pins, abort_probability, new_simulator=Simulator, new_request=SimRequest):
    """Random arrivals sharing prefixes (pinned or not), interleaved with steps and aborts, run to the
    end; asserts every admitted request finishes, no block leaks and no rejection is false. None when a
    pin does not fit the cache (nothing to test), else (simulator, admitted requests, rejected
    (prompt, new_tokens, width)). test_scheduling_policies_traces.py runs it with preemptible requests."""
    rng = random.Random(seed)
    t = tokens_per_block
    cache = make_cache(num_full_blocks, num_sliding_blocks if with_sliding else 0, t, window_tokens, chunk)
    prefixes = [[rng.randrange(5, 50) for _ in range(rng.randrange(1, 40))] for _ in range(3)]
    sim = new_simulator(cache, chunk, random.Random(seed + 1))
    for prefix in prefixes[:num_pins]:
        if len(prefix) >= t:
            try:
                pin(sim, prefix, new_request)
            except RequestTooLargeError:
                return None
    admitted, rejected = [], []
    for i in range(rng.randrange(4, 14)):
        prompt = rng.choice(prefixes) + [rng.randrange(50, 99) for _ in range(rng.randrange(0, 12))]
        if rng.random() < 0.3:
            prompt = rng.choice(prefixes)[: rng.randrange(1, 40)] or [7]  # a prefix of a prefix
        width, new_tokens = rng.randrange(1, 6), rng.randrange(1, 10)
        try:
            request = new_request(f"r{i}", cache, prompt, new_tokens, width, random.Random(rng.random()))
        except RequestTooLargeError:
            rejected.append((prompt, new_tokens, width))
            continue
        admitted.append(request)
        sim.add(request)
        if rng.random() < 0.5:
            sim.step(abort_probability)  # arrivals interleave with steps
    sim.run(abort_probability=abort_probability)
    assert all(request.finished for request in admitted)
    for name, manager in cache.managers.items():
        pool = manager.pool
        assert pool.num_free_blocks + pool.num_pinned_blocks == pool.num_blocks, f"{name} leaked blocks"
    # No false rejection: alone, on a cache holding only the pins, the worst case does not fit.
    for prompt, new_tokens, width in rejected[:2]:
        alone = make_cache(num_full_blocks, num_sliding_blocks if with_sliding else 0, t, window_tokens,
                           chunk)
        for prefix in prefixes[:num_pins]:
            if len(prefix) >= t:
                pin(Simulator(alone, chunk, random.Random(0)), prefix)
        for manager in alone.managers.values():  # empty but for the pins: evict every other cached block
            manager.pool.free(allocate_many(manager.pool, manager.pool.num_free_blocks))
        with pytest.raises(OutOfBlocksError):
            run_alone_diverging(alone, prompt, new_tokens, width)
    return sim, admitted, rejected


def test_hits_are_taken_and_outputs_of_the_allocator_stay_exact():
    """A fixed workload where the hits are sure: the second request takes the first's prompt blocks
    while the first still runs (shared, credited), the third after it finished (evictable)."""
    rng = random.Random(1)
    cache = make_cache(64, 0, 4, 8, 64)
    sim = Simulator(cache, 64, rng)
    prompt = list(range(10, 30))  # 20 tokens: 4 full blocks can hit (one token is always computed)
    first = SimRequest("a", cache, prompt + [1, 2], 6, 2, random.Random(2))
    sim.add(first)
    sim.step()
    second = SimRequest("b", cache, prompt + [3], 6, 2, random.Random(3))
    sim.add(second)
    sim.step()
    assert second.hit.num_tokens == 20 and second.hit.credit_blocks["self"] == 5
    assert second.kv.holdings["self"].num_held_blocks >= 5
    sim.run()
    third = SimRequest("c", cache, prompt + [4, 5, 6], 3, 1, random.Random(4))
    sim.add(third)
    sim.run()
    assert third.hit.num_tokens == 20 and third.hit.credit_blocks["self"] == 0
    assert third.hit.evictable_blocks["self"] == 5


def test_eviction_under_pressure_serves_a_request_that_needs_every_block():
    """A pool full of cached-evictable blocks: a request needing all of them is admitted, evicts
    them as it allocates, and finishes."""
    rng = random.Random(0)
    cache = make_cache(24, 0, 4, 8, 64)
    sim = Simulator(cache, 64, rng)
    sim.early_finish_probability = 0.0
    for i in range(6):  # distinct 16-token prompts: 4 full blocks each, all cached after they finish
        sim.add(SimRequest(f"fill{i}", cache, [100 + i] * 15 + [i], 1, 1, random.Random(i)))
    sim.run()
    pool = cache["self"].pool
    assert pool.num_evictable_blocks == 24 and pool.num_free_blocks == 24
    # 24 blocks exactly: floor(3/4) + ceil((3 + 93)/4) = 24
    big = SimRequest("big", cache, [1, 2, 3], 93, 1, random.Random(9))
    assert big.admission.required_blocks["self"] == 24
    sim.add(big)
    sim.run()
    assert big.finished and pool.num_evictions == 24 and pool.num_free_blocks == 24


def test_a_sliding_hit_on_blocks_in_use_is_copied_not_shared():
    """A sliding pool releases prompt blocks while a request runs; a block two requests shared
    would leave the releaser's reservation short, so an in-use hit is copied."""
    rng = random.Random(0)
    cache = make_cache(64, 32, 4, 6, 64)
    sim = Simulator(cache, 64, rng)
    prompt = list(range(10, 26))  # + 1 token: 4 blocks hit (positions 0..15); window 6 needs blocks 2, 3
    sim.add(SimRequest("a", cache, prompt + [1], 12, 1, random.Random(1)))
    sim.step()
    second = SimRequest("b", cache, prompt + [2], 4, 1, random.Random(2))
    sim.add(second)
    sim.step()
    assert second.hit.num_tokens == 16
    assert second.hit.block_ids["sliding"][:2] == [DROPPED, DROPPED]
    assert second.hit.credit_blocks == {"self": 4, "sliding": 0}
    own = second.kv.tables["sliding"][0].block_ids
    assert not set(own[2:4]) & set(second.hit.block_ids["sliding"][2:4]), "in-use sliding hits must be copies"
    sim.run()


def test_a_hit_copy_never_evicts_a_block_of_the_same_hit():
    """Sliding pool, no free block: the hit's in-use block must be copied, and the copy's block
    may only come from eviction; the hit's own evictable block must not be the one evicted."""
    cache = KVCache([(sliding(100), 4)], 1, enable_prefix_caching=True)
    manager, pool = cache["sliding"], cache["sliding"].pool
    ids = allocate_many(pool, 4)
    for block_id, name in zip(ids, (b"in-use", b"lru", b"newer", b"other")):
        pool.register(block_id, name)
    pool.dec_ref(ids[1])  # least recently released: first in line for eviction
    pool.dec_ref(ids[2])
    kv = cache.new_request()
    table = manager.take_hit(kv.holdings["sliding"], [ids[0], ids[1]])
    assert table.block_ids[1] == ids[1] and pool.ref_count(ids[1]) == 1  # touched, not evicted
    assert table.block_ids[0] == ids[2]  # the copy took the other evictable block
    assert manager.take_copies() == [(ids[0], ids[2], manager.tokens_per_block)]  # a full block
    assert pool.lookup(b"newer") is None


def test_a_pinned_prefix_shortens_the_sliding_prefill_it_is_sure_to_skip():
    """Sliding pool of 24 blocks (T=1, window 2, chunks of 24), one block pinned: a 25-token prompt
    computed from 0 could span 25 blocks (a chunk of 24 plus the window), more than the 23 left. But
    it starts with the pinned 24 tokens, so its prefill starts at 24 and it fits."""
    cache = make_cache(40, 24, 1, 2, 24)
    sim = Simulator(cache, 24, random.Random(0))
    prefix = list(range(5, 29))
    pin(sim, prefix)
    assert cache["sliding"].pool.num_pinned_blocks == 1 and cache["sliding"].capacity_blocks() == 23
    request = SimRequest("r", cache, prefix + [99], 1, 3, random.Random(1))
    assert request.admission.kv_request.cached_prompt_tokens == 24
    assert request.admission.required_blocks["sliding"] <= 23
    with pytest.raises(RequestTooLargeError):  # the same prompt shape without the pin: never fits
        SimRequest("other", cache, [3] * 25, 1, 3, random.Random(2))
    sim.add(request)
    sim.run()
    assert request.finished and request.hit.num_tokens == 24


def test_reset_forgets_evictable_blocks_but_keeps_pins_and_blocks_in_use():
    cache = make_cache(32, 0, 4, 8, 64)
    sim = Simulator(cache, 64, random.Random(0))
    pin(sim, list(range(10, 18)))  # 2 pinned blocks
    sim.add(SimRequest("done", cache, list(range(40, 53)), 1, 1, random.Random(1)))
    sim.run()
    running = SimRequest("running", cache, list(range(60, 73)), 8, 1, random.Random(2))
    sim.early_finish_probability = 0.0
    sim.add(running)
    sim.step()
    pool = cache["self"].pool
    assert pool.num_evictable_blocks == 3 and pool.num_pinned_blocks == 2
    assert cache.reset_prefix_cache() == 3
    assert (pool.num_evictable_blocks == 0
            and pool.num_free_blocks == 32 - 2 - running.kv.holdings["self"].num_held_blocks)
    # the pin is still found
    assert cache.find_hit(cache.prefix_key(list(range(10, 18)) + [1])).num_tokens == 8
    assert cache.find_hit(cache.prefix_key(list(range(40, 53)))).num_tokens == 0
    sim.run()
    assert cache.find_hit(cache.prefix_key(list(range(60, 73)))).num_tokens == 12  # named while in use: kept
