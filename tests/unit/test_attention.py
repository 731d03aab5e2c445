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


def build_beam_case(num_beams, prompt_tokens, generated_tokens, tokens_per_block, seed=0, num_heads=6,
                    num_kv_heads=2, head_dim=8):
    """Beams of one request: the prompt's full blocks are the same physical blocks in every table,
    the partial prompt block and the generated blocks are each beam's own (copied on write)."""
    gen = torch.Generator().manual_seed(seed)
    t = tokens_per_block
    seq_len = prompt_tokens + generated_tokens
    shared = list(range(prompt_tokens // t))
    next_block = len(shared)
    tables = []
    for _ in range(num_beams):
        own = -(-seq_len // t) - len(shared)
        tables.append(shared + list(range(next_block, next_block + own)))
        next_block += own
    num_slots = (next_block + 1) * t
    k_cache = torch.full((num_slots, num_kv_heads, head_dim), float("nan"))
    v_cache = torch.full((num_slots, num_kv_heads, head_dim), float("nan"))
    for table in tables:
        for p in range(seq_len):
            slot = table[p // t] * t + p % t
            k_cache[slot] = torch.randn(num_kv_heads, head_dim, generator=gen)
            v_cache[slot] = torch.randn(num_kv_heads, head_dim, generator=gen)
    meta = AttentionMetadata(list(range(num_beams + 1)), [seq_len] * num_beams, tables,
                             torch.tensor([tb[(seq_len - 1) // t] * t + (seq_len - 1) % t for tb in tables]), t,
                             groups=["request-a"] * num_beams)
    q = torch.randn(num_beams, num_heads, head_dim, generator=gen)
    return q, k_cache, v_cache, meta


@pytest.mark.parametrize("tokens_per_block", [1, 4, 16])
@pytest.mark.parametrize("prompt_tokens, generated_tokens", [(37, 5), (32, 1), (3, 9), (64, 16)])
@pytest.mark.parametrize("sliding_window", [None, 7, 40])
def test_shared_prefix_group_matches_reference(tokens_per_block, prompt_tokens, generated_tokens, sliding_window):
    q, k_cache, v_cache, meta = build_beam_case(8, prompt_tokens, generated_tokens, tokens_per_block)
    (group,) = meta.decode_groups(q.device)
    assert group.prefix_tokens == (prompt_tokens // tokens_per_block) * tokens_per_block
    expected = paged_attention_reference(q, k_cache, v_cache, meta, 0.35, sliding_window)
    actual = paged_attention(q, k_cache, v_cache, meta, 0.35, sliding_window)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_groups_and_loose_sequences_and_prefills_in_one_batch():
    """Two beam groups, an ungrouped decode and a prefill chunk, all in one forward."""
    qa, ka, va, ma = build_beam_case(4, 21, 3, 4, seed=1)
    qb, kb, vb, mb = build_beam_case(3, 9, 2, 4, seed=2)
    offset = ka.shape[0] // 4  # put group b's blocks after group a's
    tables = ma.block_tables + [[b + offset for b in tb] for tb in mb.block_tables]
    k_cache, v_cache = torch.cat([ka, kb]), torch.cat([va, vb])
    # a loose decode sequence and a 5-token prefill chunk reuse group a's first beam's blocks
    tables += [ma.block_tables[0], ma.block_tables[0]]
    seq_lens = ma.seq_lens + mb.seq_lens + [24, 20]
    query_start_loc = list(range(len(seq_lens))) + [len(seq_lens) - 1 + 5]
    groups = ["a"] * 4 + ["b"] * 3 + [None, None]
    meta = AttentionMetadata(query_start_loc, seq_lens, tables, torch.zeros(0, dtype=torch.long), 4, groups=groups)
    q = torch.randn(query_start_loc[-1], 6, 8, generator=torch.Generator().manual_seed(3))
    decode_groups = meta.decode_groups(q.device)
    assert sorted(g.prefix_tokens for g in decode_groups) == [0, 8, 20]
    expected = paged_attention_reference(q, k_cache, v_cache, meta, 0.3)
    torch.testing.assert_close(paged_attention(q, k_cache, v_cache, meta, 0.3), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens_per_block", [1, 3, 4])
@pytest.mark.parametrize("window", [1, 5, 9])
def test_windowed_pool_with_released_blocks_matches_full_table(tokens_per_block, window):
    """Blocks behind the window are released (-1 in the table, NaN in the cache): the windowed
    metadata must give what attention over the complete table gives."""
    query_lens = [1, 7, 1, 4]
    seq_lens = [30, 20, 9, 26]
    q, k_cache, v_cache, full_meta = build_case(query_lens, seq_lens, tokens_per_block)
    expected = paged_attention_reference(q, k_cache, v_cache, full_meta, 0.3, window)
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    tables = []
    for i, table in enumerate(full_meta.block_tables):
        first_visible = max(0, seq_lens[i] - query_lens[i] - window + 1)
        dropped = first_visible // tokens_per_block
        for b in table[:dropped]:
            k_cache[b * tokens_per_block:(b + 1) * tokens_per_block] = float("nan")
            v_cache[b * tokens_per_block:(b + 1) * tokens_per_block] = float("nan")
        tables.append([-1] * dropped + table[dropped:])
    meta = AttentionMetadata(full_meta.query_start_loc, seq_lens, tables, full_meta.slot_mapping, tokens_per_block,
                             groups=["g"] * len(seq_lens), sliding_window=window)
    for fn in (paged_attention_reference, paged_attention):
        torch.testing.assert_close(fn(q, k_cache, v_cache, meta, 0.3, window), expected, atol=1e-5, rtol=1e-5)
