"""The batched paged attention path against the one-sequence-at-a-time reference."""

from __future__ import annotations

import pytest
import torch

from widebeam.model.attention import AttentionMetadata, paged_attention, paged_attention_reference, write_kv


def build_case(query_lens, seq_lens, tokens_per_block, num_heads=4, num_kv_heads=2, head_dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // tokens_per_block) for n in seq_lens) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # scattered, non-contiguous blocks
    block_tables, cursor = [], 0
    for n in seq_lens:
        count = -(-n // tokens_per_block)
        block_tables.append(perm[cursor:cursor + count])
        cursor += count
    slot_mapping, query_start_loc = [], [0]
    for table, q_len, n in zip(block_tables, query_lens, seq_lens):
        slot_mapping += [table[p // tokens_per_block] * tokens_per_block + p % tokens_per_block
                         for p in range(n - q_len, n)]
        query_start_loc.append(query_start_loc[-1] + q_len)
    num_slots = num_blocks * tokens_per_block
    k_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen)
    # Unwritten slots hold NaN: a correct kernel never reads them.
    written = torch.zeros(num_slots, dtype=torch.bool)
    for table, n in zip(block_tables, seq_lens):
        for p in range(n):
            written[table[p // tokens_per_block] * tokens_per_block + p % tokens_per_block] = True
    k_cache[~written] = float("nan")
    v_cache[~written] = float("nan")
    meta = AttentionMetadata(query_start_loc, list(seq_lens), block_tables, torch.tensor(slot_mapping),
                             tokens_per_block)
    q = torch.randn(query_start_loc[-1], num_heads, head_dim, generator=gen)
    return q, k_cache, v_cache, meta


@pytest.mark.parametrize("tokens_per_block", [1, 3, 16])
@pytest.mark.parametrize("sliding_window", [None, 5])
@pytest.mark.parametrize("softcap", [None, 20.0])
def test_batched_path_matches_reference(tokens_per_block, sliding_window, softcap):
    # a mix of decoding beams (one query) and prefill chunks (several), short and long
    query_lens = [1, 7, 1, 1, 20, 3]
    seq_lens = [9, 7, 30, 2, 45, 12]
    q, k_cache, v_cache, meta = build_case(query_lens, seq_lens, tokens_per_block)
    expected = paged_attention_reference(q, k_cache, v_cache, meta, 0.3, sliding_window, softcap)
    actual = paged_attention(q, k_cache, v_cache, meta, 0.3, sliding_window, softcap)
    assert torch.isfinite(expected).all()
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_reference_matches_dense_causal_attention():
    """One sequence laid out in scattered blocks equals ordinary causal attention."""
    q, k_cache, v_cache, meta = build_case([10], [10], tokens_per_block=4, num_heads=2, num_kv_heads=2)
    slots = meta.key_slots(0, q.device)
    k, v = k_cache[slots].transpose(0, 1), v_cache[slots].transpose(0, 1)
    dense = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True, scale=0.5)
    actual = paged_attention_reference(q, k_cache, v_cache, meta, 0.5)
    torch.testing.assert_close(actual, dense.transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_write_kv_puts_tokens_at_their_slots():
    k_cache, v_cache = torch.zeros(8, 1, 2), torch.zeros(8, 1, 2)
    k = torch.arange(6.0).view(3, 1, 2)
    write_kv(k_cache, v_cache, k, -k, torch.tensor([5, 0, 7]))
    assert k_cache[5].tolist() == [[0.0, 1.0]] and k_cache[7].tolist() == [[4.0, 5.0]]
    assert v_cache[0].tolist() == [[-2.0, -3.0]] and k_cache[1].abs().sum() == 0
