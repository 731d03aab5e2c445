"""Start-up sizing: memory -> blocks per pool, and the max_seq_len bound (never divided by W)."""

from __future__ import annotations

import pytest

from widebeam.errors import CacheTooSmallError
from widebeam.kv.sizing import PoolNeed, resolve_max_seq_len, split_by_need, tokens_per_sequence
from widebeam.kv.spec import CrossAttentionSpec, FullAttentionSpec, SlidingWindowSpec
from widebeam.model.loading.arch import load_arch
from widebeam.plan import PlanInputs, plan

FULL = FullAttentionSpec(name="self", num_layers=4, num_kv_heads=2, head_dim=16, dtype="float32")


def test_bytes_per_token_counts_k_and_v_of_every_layer():
    assert FULL.bytes_per_token == 2 * 4 * 2 * 16 * 4
    assert FullAttentionSpec(name="x", num_layers=30, num_kv_heads=3, head_dim=64).bytes_per_token == 23040


def test_single_pool_gets_all_memory():
    (blocks,) = split_by_need(10 * FULL.bytes_per_block(16) + 5, [PoolNeed(FULL, 1000)], 16)
    assert blocks == 10


def test_split_by_need_not_equally():
    sliding = SlidingWindowSpec(name="sliding_64", num_layers=4, num_kv_heads=2, head_dim=16, dtype="float32",
                                window_tokens=64)
    needs = [PoolNeed(FULL, 4096), PoolNeed(sliding, 64)]
    full_blocks, sliding_blocks = split_by_need(100 * FULL.bytes_per_block(16), needs, 16)
    assert full_blocks + sliding_blocks <= 100
    assert full_blocks == pytest.approx(100 * 4096 / (4096 + 64), abs=1)


def test_tokens_per_sequence_by_kind():
    cross = CrossAttentionSpec(name="cross", num_layers=1, num_kv_heads=1, head_dim=8)
    assert tokens_per_sequence(FULL, 2048) == 2048
    assert tokens_per_sequence(cross, 2048, max_encoder_tokens=300) == 300


@pytest.mark.parametrize("beam_width", [1, 4, 64, 128, 256])
def test_startup_bound_does_not_change_with_beam_width(beam_width):
    arch = load_arch("llama-3-8b")
    result = plan(arch, PlanInputs(memory_bytes=141 * 2**30, beam_width=beam_width, prompt_len=4096,
                                   max_new_tokens=1024))
    assert result["max_seq_len"] == 8192  # the model's limit; the pool holds far more tokens
    small = plan(load_arch("smollm2-135m-instruct"), PlanInputs(memory_bytes=2**30, beam_width=beam_width,
                                                                  prompt_len=64, max_new_tokens=64))
    assert small["max_seq_len"] == min(8192, small["capacity_blocks"] * 16)


def test_requested_max_seq_len_beyond_capacity_names_both_numbers():
    with pytest.raises(CacheTooSmallError, match=r"max_seq_len=5000.*4096 tokens.*kv_cache_memory"):
        resolve_max_seq_len(model_max_seq_len=8192, capacity_tokens=4096, requested_max_seq_len=5000)
    with pytest.raises(CacheTooSmallError, match="model's limit of 8192"):
        resolve_max_seq_len(model_max_seq_len=8192, capacity_tokens=100000, requested_max_seq_len=9000)
    assert resolve_max_seq_len(8192, 4096, 4096) == 4096
    assert resolve_max_seq_len(8192, 4096) == 4096
    with pytest.raises(CacheTooSmallError):
        resolve_max_seq_len(8192, 0)
