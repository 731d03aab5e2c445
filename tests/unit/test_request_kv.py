"""The KV coordinator (`RequestKV`) across every pool kind at once, against the real allocator.

Random beam traces (chunked prefill, forks, prunes, beams dropped on stop strings, speculative
tokens appended and rolled back) run on a cache whose every pool is sized to exactly the request's
`required_blocks`, so any overshoot fails as OutOfBlocksError; after every step each pool's held
count matches its pool and stays within the bound, and `free()` gives every block back.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_helpers import held_blocks, num_used_blocks

from widebeam.errors import BlockStateError, OutOfBlocksError
from widebeam.kv.budget import KVRequest
from widebeam.kv.cache import KVCache
from widebeam.kv.spec import CrossAttentionSpec, FullAttentionSpec, SlidingWindowSpec

COMMON = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 8}


def exact_cache(request: KVRequest, tokens_per_block: int, window_tokens: int, chunk_tokens: int) -> KVCache:
    specs = [FullAttentionSpec(name="self", **COMMON),
             SlidingWindowSpec(name="sliding", window_tokens=window_tokens, **COMMON),
             CrossAttentionSpec(name="cross", **COMMON)]
    sizing = KVCache([(s, 10**6) for s in specs], tokens_per_block, chunk_tokens)
    required = {b.pool: b.required_blocks for b in sizing.budgets(request)}
    return KVCache([(s, required.get(s.name, 0)) for s in specs], tokens_per_block, chunk_tokens)


def check(cache: KVCache, kv) -> None:
    for name, manager in cache.managers.items():
        assert kv.holdings[name].num_held_blocks == num_used_blocks(manager.pool), name
        assert num_used_blocks(manager.pool) <= manager.pool.num_blocks


@settings(max_examples=100, deadline=None)
@given(data=st.data(), prompt_tokens=st.integers(1, 40), max_new_tokens=st.integers(1, 12),
       beam_width=st.integers(1, 5), tokens_per_block=st.sampled_from([1, 2, 4, 16]),
       window_tokens=st.integers(1, 20), chunk_tokens=st.integers(1, 24), encoder_tokens=st.integers(1, 30),
       speculative_tokens=st.integers(0, 3))
def test_random_traces_stay_within_every_pool(data, prompt_tokens, max_new_tokens, beam_width,
                                              tokens_per_block,
                                              window_tokens, chunk_tokens, encoder_tokens,
                                              speculative_tokens):
    request = KVRequest(prompt_tokens, max_new_tokens, beam_width, extra_tokens=speculative_tokens,
                        encoder_tokens=encoder_tokens)
    cache = exact_cache(request, tokens_per_block, window_tokens, chunk_tokens)
    start_free = cache.num_free_blocks()
    kv = cache.new_request()
    assert len(kv.allocate_shared(encoder_tokens)["cross"]) == encoder_tokens
    left = prompt_tokens
    while left:
        chunk = data.draw(st.integers(1, min(left, chunk_tokens)))
        assert len(kv.prefill_slots(chunk)["self"]) == chunk
        left -= chunk
        check(cache, kv)
    kv.reorder([0] * beam_width)
    for _ in range(data.draw(st.integers(0, max_new_tokens - 1))):  # the N-th token is never written
        live = kv.num_sequences
        if speculative_tokens:  # draft tokens written, then all but the first rolled back
            committed = [kv.num_tokens(i) for i in range(live)]
            kv.decode_slots(1 + speculative_tokens)
            check(cache, kv)
            for i in range(live):
                kv.truncate(i, committed[i] + 1)
        else:
            kv.decode_slots()
        check(cache, kv)
        assert all(kv.num_tokens(i) == kv.num_tokens(0) for i in range(kv.num_sequences))
        cache.take_copies()
        if live > 1 and data.draw(st.booleans()):  # beams that hit a stop string leave early
            kv.drop(data.draw(st.lists(st.integers(0, live - 1), max_size=live - 1, unique=True)))
            check(cache, kv)
        parents = data.draw(st.lists(st.integers(0, kv.num_sequences - 1), min_size=1, max_size=beam_width))
        kv.reorder(parents)
        check(cache, kv)
    kv.free()
    kv.free()  # abort after finish frees nothing twice
    assert cache.num_free_blocks() == start_free


def test_truncate_rolls_back_blocks_and_a_shared_block_is_copied_before_it_is_rewritten():
    request = KVRequest(6, 8, 2, extra_tokens=4)
    cache = exact_cache(request, 4, 64, 64)
    kv = cache.new_request()
    kv.prefill_slots(6)  # blocks: [0..3], [4,5 + 2 free slots]
    kv.reorder([0, 0])  # two beams share both blocks
    kv.decode_slots(4)  # each beam copies the shared partial block, then takes a new one
    assert len(cache.take_copies()["self"]) == 2 - 1  # the last sharer keeps the original
    held = held_blocks(kv)["self"]
    kv.truncate(0, 7)
    assert kv.num_tokens(0) == 7 and held_blocks(kv)["self"] == held - 1
    with pytest.raises(BlockStateError):
        kv.truncate(0, 9)  # a rollback never grows a table
    kv.free()
    assert cache.num_free_blocks()["self"] == cache["self"].pool.num_blocks


def test_sliding_pool_refuses_a_rollback_below_what_its_window_released():
    request = KVRequest(16, 8, 1)
    cache = exact_cache(request, 4, 4, 16)
    kv = cache.new_request()
    kv.prefill_slots(16)
    kv.decode_slots()  # trims blocks no query at position 16 can see
    with pytest.raises(BlockStateError, match="window already released"):
        kv.truncate(0, 5)
    assert kv.num_tokens(0) == 17  # all pools or none: the full pool was not rolled back either
    kv.truncate(0, 16)  # back to the committed length is always possible
    kv.free()


def free_blocks(cache: KVCache) -> dict[str, int]:
    return cache.num_free_blocks()


def taken(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {name: before[name] - after[name] for name in before}


@settings(max_examples=150, deadline=None)
@given(data=st.data(), prompt_tokens=st.integers(1, 30), shared_tokens=st.integers(0, 30),
       beam_width=st.integers(1, 4), tokens_per_block=st.sampled_from([1, 2, 3, 4]),
       window_tokens=st.integers(1, 12), chunk_tokens=st.integers(1, 16), encoder_tokens=st.integers(0, 9),
       num_tokens=st.integers(1, 4))
def test_step_blocks_are_what_the_step_takes(data, prompt_tokens, shared_tokens, beam_width, tokens_per_block,
                                             window_tokens, chunk_tokens, encoder_tokens, num_tokens):
    """`first_step_blocks` and `step_blocks` (and each manager's `append_blocks`, trims included) are
    exactly the free blocks the allocation then takes, in every pool: with a prefix hit on blocks
    another running request holds (shared, or copied by a sliding pool) or has left cached, with
    shared partial blocks copied on write, and with windows that give blocks back."""
    specs = [FullAttentionSpec(name="self", **COMMON),
             SlidingWindowSpec(name="sliding", window_tokens=window_tokens, **COMMON),
             CrossAttentionSpec(name="cross", **COMMON)]
    cache = KVCache([(s, 10**4) for s in specs], tokens_per_block, chunk_tokens, enable_prefix_caching=True)
    prefix = list(range(100, 100 + shared_tokens))
    encoder = list(range(7, 7 + encoder_tokens))

    def run(prompt, kv, num_steps):
        hit = kv.find_hit()
        left = len(prompt) - hit.num_tokens
        chunk = min(left, chunk_tokens)
        before = free_blocks(cache)
        expected = kv.first_step_blocks(hit, chunk)
        kv.take_hit(hit)
        if encoder_tokens and not kv.shared_tables:
            kv.allocate_shared(encoder_tokens)
        kv.prefill_slots(chunk)
        assert taken(before, free_blocks(cache)) == {**dict.fromkeys(before, 0), **expected}
        left -= chunk
        kv.register_computed(len(prompt) - left)
        while left:
            chunk = min(left, chunk_tokens)
            before, expected = free_blocks(cache), kv.step_blocks(chunk)
            kv.prefill_slots(chunk)
            got = taken(before, free_blocks(cache))  # a window's trim may give back more than it takes
            assert {name: max(n, 0) for name, n in got.items()} == {**dict.fromkeys(before, 0), **expected}
            left -= chunk
            kv.register_computed(len(prompt) - left)
        kv.reorder([0] * beam_width)
        for _ in range(num_steps):
            n = data.draw(st.integers(1, num_tokens))
            before = free_blocks(cache)
            expected = kv.step_blocks(n)
            exact = {name: cache[name].append_blocks(tables, n) for name, tables in kv.tables.items()}
            kv.decode_slots(n)
            got = taken(before, free_blocks(cache))
            assert {name: got[name] for name in exact} == exact
            assert {name: max(got[name], 0) for name in expected} == expected
            assert all(got[name] == 0 for name in got if name not in expected)
            cache.take_copies()
            live = kv.num_sequences
            kv.reorder(data.draw(st.lists(st.integers(0, live - 1), min_size=1, max_size=beam_width)))

    first_prompt = prefix + list(range(500, 500 + prompt_tokens))
    first = cache.new_request(cache.prefix_key(first_prompt, encoder or None), encoder_tokens)
    run(first_prompt, first, data.draw(st.integers(0, 4)))
    if data.draw(st.booleans()):
        first.free()  # its blocks stay cached, evictable, for the second
    second_prompt = prefix + list(range(900, 900 + prompt_tokens))
    second = cache.new_request(cache.prefix_key(second_prompt, encoder or None), encoder_tokens)
    run(second_prompt, second, data.draw(st.integers(0, 6)))


def test_decode_slots_refuses_a_step_the_pool_cannot_hold_before_it_changes_anything():
    cache = KVCache([(FullAttentionSpec(name="self", **COMMON), 3)], 4)
    kv = cache.new_request()
    kv.prefill_slots(6)  # two blocks, the second partial
    kv.reorder([0, 0, 0])  # three beams share it: the step copies it twice, one block free
    assert kv.step_blocks(1) == {"self": 2}
    with pytest.raises(OutOfBlocksError, match="pool 'self' has 1 free blocks"):
        kv.decode_slots(1)
    assert held_blocks(kv) == {"self": 2} and [kv.num_tokens(i) for i in range(3)] == [6, 6, 6]
    kv.drop([2])  # two beams: one copy, which fits
    kv.decode_slots(1)
    assert held_blocks(kv) == {"self": 3}


def test_the_refeed_rule_is_the_cache_s():
    full = FullAttentionSpec(name="self", **COMMON)
    sliding = SlidingWindowSpec(name="sliding", window_tokens=4, **COMMON)
    assert KVCache([(full, 8)], 4).max_refeed_tokens(64) == 64
    assert KVCache([(full, 8), (sliding, 8)], 4).max_refeed_tokens(64) == 1


def test_a_renewed_coordinator_keeps_the_key_and_the_encoder_output_but_holds_nothing():
    specs = [FullAttentionSpec(name="self", **COMMON), CrossAttentionSpec(name="cross", **COMMON)]
    cache = KVCache([(spec, 8) for spec in specs], 4, enable_prefix_caching=True)
    key = cache.prefix_key([3, 4, 5, 6, 7], [9] * 6)
    kv = cache.new_request(key, encoder_tokens=6)
    assert kv.step_blocks(5) == {"self": 2, "cross": 2}
    kv.allocate_shared(6)
    kv.prefill_slots(5)
    assert kv.step_blocks(1) == {"self": 0}  # the encoder output is written
    kv.free()
    fresh = kv.renew()
    assert fresh.key is key and fresh.encoder_tokens == 6 and held_blocks(fresh) == {"self": 0, "cross": 0}
    assert fresh.step_blocks(5) == {"self": 2, "cross": 2}
