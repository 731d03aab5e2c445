"""Cross-attention through the C++ kernel (backends.kernel_shared_keys: the group op with no own keys, the
encoder's K/V read in place) against the reference one sequence at a time and against the torch path
(gathered K/V, PyTorch's fused kernel): float32 and bfloat16 caches and an int8 pool, a run of slots and
scattered blocks, few beams and a group wide enough to be tiled."""

from __future__ import annotations

import pytest
import torch
from test_encoder_decoder import cross_attention_reference

from widebeam.model import kernels
from widebeam.model.attention import backends
from widebeam.model.attention.cross import CrossAttentionMetadata, cross_attention
from widebeam.model.attention.quantized_kv import QuantizedKV, write_pair

# the dense-cache kernel reads run here on every build (tests/conftest.py), not only where they pay
pytestmark = pytest.mark.usefixtures("dense_kernel_reads_anywhere")

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="C++ kernels not built")
T = 4


def metadata(tables: dict[str, tuple[list[int], int]], seqs: list[tuple[str, int]]) -> CrossAttentionMetadata:
    query_start_loc = [0]
    for _, num_queries in seqs:
        query_start_loc.append(query_start_loc[-1] + num_queries)
    return CrossAttentionMetadata(query_start_loc, [tables[r][0] for r, _ in seqs],
                                  [tables[r][1] for r, _ in seqs], tokens_per_block=T)


def caches(kind: str, slots: int, kv_heads: int, head_dim: int):
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(slots, kv_heads, head_dim, generator=gen)
    v = torch.randn(slots, kv_heads, head_dim, generator=gen)
    if kind == "int8":
        values = torch.zeros(2, slots, kv_heads, head_dim, dtype=torch.int8)
        scales = torch.zeros(2, slots, kv_heads, 2, dtype=torch.float16)
        k_cache, v_cache = QuantizedKV.pair(values, scales, torch.float32)
        write_pair(k_cache, v_cache, torch.arange(slots), k, v)
        return tuple(c.in_stored_domain() for c in (k_cache, v_cache))
    dtype = getattr(torch, kind)
    return k.to(dtype), v.to(dtype)


@needs_kernels
@pytest.mark.parametrize("kind, tolerance", [("float32", 2e-5), ("bfloat16", 2e-2), ("int8", 2e-5)])
@pytest.mark.parametrize("beams", [3, 40])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)])
def test_cross_attention_through_the_kernel(monkeypatch, kind, tolerance, beams, heads):
    """Request A: `beams` beams over a run of blocks (read in place); B: a 5-token prefill over scattered
    blocks (gathered by index); C: one beam. 40 beams x 8 heads a KV head: past the few-row caps (tiled)."""
    num_heads, num_kv_heads = heads
    k_cache, v_cache = caches(kind, 64 * T, num_kv_heads, 64)
    tables = {"A": ([10, 11, 12], 11), "B": ([7, 2, 30], 10), "C": ([40, 41, 42, 43], 13)}
    seqs = [("B", 5), *[("A", 1)] * beams, ("C", 1)]
    meta = metadata(tables, seqs)
    q = torch.randn(meta.query_start_loc[-1], num_heads, 64, generator=torch.Generator().manual_seed(4))
    if kind == "bfloat16":
        q = q.to(torch.bfloat16)
    runs = {tuple(meta.block_tables[i]): g.slot_run for i, g in
            zip([0, 1, len(seqs) - 1], meta.groups(q.device))}
    assert runs == {(7, 2, 30): None, (10, 11, 12): (40, 51), (40, 41, 42, 43): (160, 173)}
    calls = []
    real = backends.kernel_shared_keys

    def spy(*args):
        out = real(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr("widebeam.model.attention.cross.kernel_shared_keys", spy)
    results = {}
    for on in (True, False):
        monkeypatch.setattr(kernels, "ENABLED" if kind == "int8" else "DENSE_ATTENTION_ENABLED", on)
        results[on] = cross_attention(q, k_cache, v_cache, meta, scale=0.125)
    assert calls == [True] * 3 + [False] * 3, "the kernel served every group with it on, none with it off"
    torch.testing.assert_close(results[True], results[False], atol=tolerance, rtol=tolerance)
    if kind == "float32":
        expected = cross_attention_reference(q, k_cache, v_cache, meta, scale=0.125)
        torch.testing.assert_close(results[True], expected, atol=tolerance, rtol=tolerance)
