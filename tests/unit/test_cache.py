"""The facade: every pool's budget for a request, and the error for one that can never fit."""

from __future__ import annotations

import pytest
from kv_helpers import allocate_table

from widebeam.errors import BlockStateError, RequestTooLargeError
from widebeam.kv.budget import KVRequest, full_attention_blocks
from widebeam.kv.cache import KVCache
from widebeam.kv.spec import CrossAttentionSpec, FullAttentionSpec, SlidingWindowSpec
from widebeam.kv.tables import Holding

COMMON = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16}


def self_only(num_blocks: int, tokens_per_block: int = 16) -> KVCache:
    return KVCache([(FullAttentionSpec(name="self", **COMMON), num_blocks)], tokens_per_block)


def test_budgets_list_every_pool_the_request_uses():
    cache = KVCache(
        [
            (FullAttentionSpec(name="self", **COMMON), 100),
            (SlidingWindowSpec(name="sliding_8", window_tokens=8, **COMMON), 50),
            (CrossAttentionSpec(name="cross", **COMMON), 10),
        ],
        tokens_per_block=4,
    )
    decoder_only = cache.budgets(KVRequest(10, 4, 3))
    assert [b.pool for b in decoder_only] == ["self", "sliding_8"]  # no encoder tokens: cross unused
    with_encoder = {b.pool: b for b in cache.budgets(KVRequest(10, 4, 3, encoder_tokens=9))}
    assert with_encoder["self"].required_blocks == 2 + 2 * 3
    assert with_encoder["cross"].required_blocks == 3
    assert with_encoder["cross"].capacity_blocks == 10


@pytest.mark.parametrize("beam_width", [1, 4, 64, 256])
def test_one_block_less_fits_one_more_does_not(beam_width):
    request = KVRequest(prompt_tokens=1000, max_new_tokens=40, beam_width=beam_width)
    required = full_attention_blocks(1000, 40, beam_width, 16)
    assert self_only(required).check_fits(request)[0].fits
    assert self_only(required + 1).check_fits(request)[0].fits
    with pytest.raises(RequestTooLargeError):
        self_only(required - 1).check_fits(request)


def test_oversized_request_error_names_pool_numbers_and_what_fits():
    cache = self_only(900)
    request = KVRequest(prompt_tokens=4096, max_new_tokens=64, beam_width=256)
    with pytest.raises(RequestTooLargeError) as info:
        cache.check_fits(request)
    err = info.value
    assert isinstance(err, ValueError)
    assert (err.pool, err.required_blocks, err.capacity_blocks) == ("self", 1280, 900)
    assert (err.prompt_len, err.max_new_tokens, err.beam_width) == (4096, 64, 256)
    # 900 - 256 shared = 644 blocks; 644 // 256 = 2 blocks per beam -> 32 written tokens, so 33 new
    # ones (the last is never written)
    assert err.max_new_tokens_that_fit == 33
    # 644 // 4 blocks per beam = 161 beams
    assert err.beam_width_that_fits == 161
    message = str(err)
    for fragment in ("'self'", "1280", "900", "prompt_len=4096", "max_new_tokens=64", "beam_width=256",
                     "max_new_tokens <= 33", "beam_width <= 161"):
        assert fragment in message


def test_prompt_alone_too_large_says_nothing_fits():
    with pytest.raises(RequestTooLargeError, match="no max_new_tokens fits") as info:
        self_only(10).check_fits(KVRequest(prompt_tokens=1000, max_new_tokens=1, beam_width=1))
    assert info.value.beam_width_that_fits == 0


def test_cross_pool_rejection_names_the_cross_pool():
    cache = KVCache(
        [(FullAttentionSpec(name="self", **COMMON), 100), (CrossAttentionSpec(name="cross", **COMMON), 2)],
        tokens_per_block=4,
    )
    with pytest.raises(RequestTooLargeError, match="'cross'") as info:
        cache.check_fits(KVRequest(10, 4, 8, encoder_tokens=9))
    assert info.value.pool == "cross"
    assert "at most 8 fit" in str(info.value)
    cache.check_fits(KVRequest(10, 4, 8, encoder_tokens=8))  # ceil(8/4) = 2 blocks fits


def test_cross_blocks_are_shared_by_beams_and_freed():
    cache = KVCache([(CrossAttentionSpec(name="cross", **COMMON), 4)], tokens_per_block=4)
    manager = cache["cross"]
    holding = Holding()
    table = allocate_table(manager, holding, 9)
    assert holding.num_held_blocks == 3 and cache.num_free_blocks()["cross"] == 1
    assert manager.slots(table)[:5] == ([table.block_ids[0] * 4 + i for i in range(4)]
                                        + [table.block_ids[1] * 4])
    manager.release(table)
    assert cache.num_free_blocks()["cross"] == 4
    with pytest.raises(BlockStateError):
        manager.release(table)


def test_stats_report_totals_and_free_blocks():
    cache = self_only(8, tokens_per_block=4)
    table = allocate_table(cache["self"], Holding(), 5)
    stats = cache.stats()["self"]
    assert stats["total_blocks"] == 8 and stats["free_blocks"] == 6 and stats["kind"] == "full"
    assert stats["bytes_per_block"] == 2 * 2 * 2 * 16 * 2 * 4
    cache["self"].release(table)
    assert cache.stats()["self"]["free_blocks"] == 8


def test_released_table_cannot_be_used():
    manager = self_only(4, tokens_per_block=4)["self"]
    table = allocate_table(manager, Holding(), 3)
    manager.release(table)
    for op in (manager.fork, manager.append_slots):
        with pytest.raises(BlockStateError):
            op(table)


def test_slots_follow_block_table():
    manager = self_only(4, tokens_per_block=4)["self"]
    table = allocate_table(manager, Holding(), 6)
    b0, b1 = table.block_ids
    assert manager.append_slots(table, 3) == [b1 * 4 + 2, b1 * 4 + 3, table.block_ids[2] * 4]
    assert b0 != b1
    manager.release(table)
