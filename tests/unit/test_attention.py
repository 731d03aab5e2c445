"""Paged attention: the reference against dense attention, the KV write, the `PagedAttention` layer,
the backend registry and the runner's single choice, and the sdpa backend's decode groups.
(Every backend against dense attention on random layouts: test_attention_backends.py.)"""

from __future__ import annotations

import pytest
import torch

from widebeam.model.attention.backends import (
    ATTENTION_BACKEND_ENV,
    attention_backend_names,
    get_attention_backend,
)
from widebeam.model.attention.paged import PagedAttention, write_kv

CPU = torch.device("cpu")


def build_case(query_lens, seq_lens, tokens_per_block, num_heads=4, num_kv_heads=2, head_dim=8, seed=0):
    """Sequences in scattered blocks; unwritten slots hold NaN (a correct kernel never reads them)."""
    gen = torch.Generator().manual_seed(seed)
    t = tokens_per_block
    num_blocks = sum(-(-n // t) for n in seq_lens) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables, cursor = [], 0
    for n in seq_lens:
        count = -(-n // t)
        block_tables.append(perm[cursor:cursor + count])
        cursor += count
    slot_mapping, query_start_loc = [], [0]
    for table, q_len, n in zip(block_tables, query_lens, seq_lens):
        slot_mapping += [table[p // t] * t + p % t for p in range(n - q_len, n)]
        query_start_loc.append(query_start_loc[-1] + q_len)
    k_cache = torch.full((num_blocks * t, num_kv_heads, head_dim), float("nan"))
    v_cache = torch.full((num_blocks * t, num_kv_heads, head_dim), float("nan"))
    for table, n in zip(block_tables, seq_lens):
        slots = torch.tensor([table[p // t] * t + p % t for p in range(n)])
        k_cache[slots] = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        v_cache[slots] = torch.randn(n, num_kv_heads, head_dim, generator=gen)
    layout = {"query_start_loc": query_start_loc, "seq_lens": list(seq_lens), "block_tables": block_tables,
              "slot_mapping": slot_mapping, "tokens_per_block": t, "device": CPU}
    q = torch.randn(query_start_loc[-1], num_heads, head_dim, generator=gen)
    return q, k_cache, v_cache, layout


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
    k_cache = torch.full(((next_block + 1) * t, num_kv_heads, head_dim), float("nan"))
    v_cache = torch.full(((next_block + 1) * t, num_kv_heads, head_dim), float("nan"))
    for table in tables:
        for p in range(seq_len):
            slot = table[p // t] * t + p % t
            k_cache[slot] = torch.randn(num_kv_heads, head_dim, generator=gen)
            v_cache[slot] = torch.randn(num_kv_heads, head_dim, generator=gen)
    layout = {"query_start_loc": list(range(num_beams + 1)), "seq_lens": [seq_len] * num_beams,
              "block_tables": tables,
              "slot_mapping": [tb[(seq_len - 1) // t] * t + (seq_len - 1) % t for tb in tables],
              "tokens_per_block": t, "device": CPU, "groups": ["request-a"] * num_beams}
    q = torch.randn(num_beams, num_heads, head_dim, generator=gen)
    return q, k_cache, v_cache, layout


def attend(backend_name, q, k_cache, v_cache, layout, scale, **extra):
    backend = get_attention_backend(backend_name)
    return backend.forward(q, k_cache, v_cache, backend.build_metadata(**layout, **extra), scale)


def test_reference_matches_dense_causal_attention():
    """One sequence laid out in scattered blocks equals ordinary causal attention."""
    q, k_cache, v_cache, layout = build_case([10], [10], tokens_per_block=4, num_heads=2, num_kv_heads=2)
    t, table = 4, layout["block_tables"][0]
    slots = torch.tensor([table[p // t] * t + p % t for p in range(10)])
    k, v = k_cache[slots].transpose(0, 1), v_cache[slots].transpose(0, 1)
    dense = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True,
                                                             scale=0.5)
    for name in attention_backend_names():
        torch.testing.assert_close(attend(name, q, k_cache, v_cache, layout, 0.5), dense.transpose(0, 1),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens_per_block", [1, 3, 16])
@pytest.mark.parametrize("sliding_window", [None, 5])
def test_sdpa_matches_reference_on_a_mixed_batch(tokens_per_block, sliding_window):
    # a mix of decoding sequences (one query) and prefill chunks (several), short and long
    q, k_cache, v_cache, layout = build_case([1, 7, 1, 1, 20, 3], [9, 7, 30, 2, 45, 12], tokens_per_block)
    expected = attend("reference", q, k_cache, v_cache, layout, 0.3, sliding_window=sliding_window)
    actual = attend("sdpa", q, k_cache, v_cache, layout, 0.3, sliding_window=sliding_window)
    assert torch.isfinite(expected).all()
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_write_kv_puts_tokens_at_their_slots():
    k_cache, v_cache = torch.zeros(8, 1, 2), torch.zeros(8, 1, 2)
    k = torch.arange(6.0).view(3, 1, 2)
    write_kv(k_cache, v_cache, k, -k, torch.tensor([5, 0, 7]))
    assert k_cache[5].tolist() == [[0.0, 1.0]] and k_cache[7].tolist() == [[4.0, 5.0]]
    assert v_cache[0].tolist() == [[-2.0, -3.0]] and k_cache[1].abs().sum() == 0


def test_paged_attention_layer_writes_then_attends_with_the_pools_window():
    """The layer stores this step's K/V at the slot mapping, then attends through the backend the
    metadata carries, with the metadata's window (its one source)."""
    q, k_cache, v_cache, layout = build_case([6], [6], tokens_per_block=4)
    t, table = 4, layout["block_tables"][0]
    k_new, v_new = torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    layer = PagedAttention(num_heads=4, num_kv_heads=2, head_dim=8, scale=0.3)
    outputs = {}
    for window in (None, 2):
        meta = get_attention_backend("reference").build_metadata(**layout, sliding_window=window)
        caches = (k_cache.clone(), v_cache.clone())
        outputs[window] = layer(q, k_new, v_new, caches, meta)
        slots = torch.tensor([table[p // t] * t + p % t for p in range(6)])
        assert torch.equal(caches[0][slots], k_new) and torch.equal(caches[1][slots], v_new)
        torch.testing.assert_close(outputs[window], meta.backend.forward(q, *caches, meta, 0.3))
    assert torch.equal(outputs[None][0], outputs[2][0])  # the first query sees one key either way
    assert not torch.allclose(outputs[None][5], outputs[2][5])


def test_backend_registry_default_env_and_unknown(monkeypatch):
    monkeypatch.delenv(ATTENTION_BACKEND_ENV, raising=False)
    assert get_attention_backend().name == "sdpa"
    assert get_attention_backend("reference").name == "reference"
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "reference")
    assert get_attention_backend().name == "reference"
    assert get_attention_backend("sdpa").name == "sdpa"  # an explicit name wins over the variable
    with pytest.raises(ValueError, match="unknown attention backend 'flash'.*reference, sdpa"):
        get_attention_backend("flash")


def test_runner_chooses_the_backend_once_and_every_pool_uses_it(monkeypatch, tiny_llama_dir):
    from widebeam.model.loading.build import load_model
    from widebeam.model.loading.sources import resolve_model
    from widebeam.model.runner import ModelRunner, SequenceInput

    model = load_model(resolve_model(str(tiny_llama_dir)), "float32", CPU)
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "reference")
    runners = {name: ModelRunner(model, {"self": 8}, 4, CPU, torch.float32, attention_backend=name)
               for name in (None, "sdpa")}
    monkeypatch.delenv(ATTENTION_BACKEND_ENV)
    assert runners[None].attention_backend.name == "reference"  # read at construction, not per step
    seen = []
    original = model.forward

    def spy(input_ids, positions, kv_caches, metadata):
        seen.append(metadata["self"].backend)
        return original(input_ids, positions, kv_caches, metadata)

    monkeypatch.setattr(model, "forward", spy)
    logits = {}
    for name, runner in runners.items():
        logits[name] = runner.execute([SequenceInput([5, 6, 7, 8, 9], 0, {"self": [3, 1]},
                                                     {"self": [12, 13, 14, 15, 4]})])
        assert seen[-1] is runner.attention_backend
    torch.testing.assert_close(logits[None], logits["sdpa"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens_per_block", [1, 4, 16])
@pytest.mark.parametrize("prompt_tokens, generated_tokens", [(37, 5), (32, 1), (3, 9), (64, 16)])
def test_shared_prefix_group_matches_reference(tokens_per_block, prompt_tokens, generated_tokens):
    q, k_cache, v_cache, layout = build_beam_case(8, prompt_tokens, generated_tokens, tokens_per_block)
    (group,) = get_attention_backend("sdpa").build_metadata(**layout).decode_groups
    assert group.prefix_tokens == (prompt_tokens // tokens_per_block) * tokens_per_block
    expected = attend("reference", q, k_cache, v_cache, layout, 0.35)
    torch.testing.assert_close(attend("sdpa", q, k_cache, v_cache, layout, 0.35), expected, atol=1e-5,
                               rtol=1e-5)


def test_groups_and_loose_sequences_and_prefills_in_one_batch():
    """Two beam groups, an ungrouped decode and a prefill chunk, all in one forward."""
    _, ka, va, la = build_beam_case(4, 21, 3, 4, seed=1)
    _, kb, vb, lb = build_beam_case(3, 9, 2, 4, seed=2)
    offset = ka.shape[0] // 4  # put group b's blocks after group a's
    tables = la["block_tables"] + [[b + offset for b in tb] for tb in lb["block_tables"]]
    k_cache, v_cache = torch.cat([ka, kb]), torch.cat([va, vb])
    # a loose decode sequence and a 5-token prefill chunk reuse group a's first beam's blocks
    tables += [la["block_tables"][0], la["block_tables"][0]]
    seq_lens = la["seq_lens"] + lb["seq_lens"] + [24, 20]
    query_start_loc = list(range(len(seq_lens))) + [len(seq_lens) - 1 + 5]
    layout = {"query_start_loc": query_start_loc, "seq_lens": seq_lens, "block_tables": tables,
              "slot_mapping": [], "tokens_per_block": 4, "device": CPU,
              "groups": ["a"] * 4 + ["b"] * 3 + [None, None]}
    q = torch.randn(query_start_loc[-1], 6, 8, generator=torch.Generator().manual_seed(3))
    meta = get_attention_backend("sdpa").build_metadata(**layout)
    assert sorted(g.prefix_tokens for g in meta.decode_groups) == [0, 8, 20]
    assert [(s.start, s.end) for s in meta.sequences] == [(8, 13)]
    expected = attend("reference", q, k_cache, v_cache, layout, 0.3)
    torch.testing.assert_close(attend("sdpa", q, k_cache, v_cache, layout, 0.3), expected, atol=1e-5,
                               rtol=1e-5)


@pytest.mark.parametrize("tokens_per_block", [1, 3, 4])
@pytest.mark.parametrize("window", [1, 5, 9])
def test_windowed_pool_with_released_blocks_matches_full_table(tokens_per_block, window):
    """Blocks behind the window are released (-1 in the table, NaN in the cache): the windowed
    metadata must give what attention over the complete table gives."""
    query_lens, seq_lens = [1, 7, 1, 4], [30, 20, 9, 26]
    q, k_cache, v_cache, full = build_case(query_lens, seq_lens, tokens_per_block)
    expected = attend("reference", q, k_cache, v_cache, full, 0.3, sliding_window=window)
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    tables = []
    for i, table in enumerate(full["block_tables"]):
        dropped = max(0, seq_lens[i] - query_lens[i] - window + 1) // tokens_per_block
        for b in table[:dropped]:
            k_cache[b * tokens_per_block:(b + 1) * tokens_per_block] = float("nan")
            v_cache[b * tokens_per_block:(b + 1) * tokens_per_block] = float("nan")
        tables.append([-1] * dropped + table[dropped:])
    layout = {**full, "block_tables": tables, "groups": ["g"] * len(seq_lens)}
    for name in attention_backend_names():
        actual = attend(name, q, k_cache, v_cache, layout, 0.3, sliding_window=window)
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
