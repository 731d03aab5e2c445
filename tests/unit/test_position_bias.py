"""An additive position bias (T5's relative bias) through both attention backends on paged K/V.

The layouts are test_attention_backends.py's (beams sharing prompt blocks in decode groups, loose
decodes, prefill chunks from position 0 and after cached tokens, scattered blocks), plus a sequence
ending in a token tree. The expected output is dense, float64, each query's bias spelled out from
its position and each key's, so the reference backend and the sdpa fast path (shared prefix merged by
log-sum-exp, padded loose decodes, SDPA with a float mask) are both held to the same definition.
"""

from __future__ import annotations

import pytest
import torch
from test_attention_backends import random_layout

from widebeam.model.attention.backends import get_attention_backend
from widebeam.model.attention.metadata import PositionBias, tree_ancestry, tree_depths

# the dense-cache kernel reads run here on every build (tests/conftest.py), not only where they pay
pytestmark = pytest.mark.usefixtures("dense_kernel_reads_anywhere")

RELATIVE_RANGE = 12


def make_bias_fn(num_heads: int, seed: int):
    """A per-head bias depending on key - query (clipped, asymmetric) and on the query position, so a
    swapped sign, a wrong head order or an absolute-position mix-up all change it."""
    gen = torch.Generator().manual_seed(seed + 100)
    table = torch.randn(num_heads, 2 * RELATIVE_RANGE + 1, generator=gen, dtype=torch.float64) * 2
    slope = torch.randn(num_heads, generator=gen, dtype=torch.float64) * 0.1

    def fn(query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        relative = (key_positions - query_positions).clamp(-RELATIVE_RANGE, RELATIVE_RANGE) + RELATIVE_RANGE
        by_head = table.to(query_positions.device)[:, relative]  # [H, *shape]
        return by_head + slope.view(-1, *[1] * relative.dim()) * query_positions.double()

    return fn


def dense_with_bias(lay, q: torch.Tensor, scale: float, fn) -> torch.Tensor:
    out, row = [], 0
    for s in (s for s in lay.seqs if s["queries"]):
        k, v = torch.stack(s["k"]), torch.stack(s["v"])  # [S, KV, d]
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        for j in range(s["queries"]):
            pos = s["len"] - s["queries"] + j
            visible = torch.arange(pos + 1)
            scores = torch.einsum("hd,shd->hs", q[row].double(), k[visible]) * scale
            scores = scores + fn(torch.tensor(pos), visible)
            out.append(torch.einsum("hs,shd->hd", torch.softmax(scores, -1), v[visible]))
            row += 1
    return torch.stack(out)


@pytest.mark.parametrize("backend_name", ["reference", "sdpa"])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (6, 2), (4, 1)])
@pytest.mark.parametrize("t", [1, 4, 16])
@pytest.mark.parametrize("seed", [0, 1])
def test_backends_add_the_position_bias_like_dense_attention(backend_name, num_heads, num_kv_heads, t, seed):
    lay = random_layout(seed, t, num_kv_heads, 8, torch.float32)
    backend = get_attention_backend(backend_name)
    meta = lay.metadata(backend, None)
    if backend_name == "sdpa" and t <= 4:  # every fast path is taken: shared prefixes and a loose batch
        assert {g.prefix_tokens > 0 for g in meta.decode_groups} == {True, False}
    q = torch.randn(meta.query_start_loc[-1], num_heads, 8, generator=torch.Generator().manual_seed(seed))
    fn = make_bias_fn(num_heads, seed)
    bias = PositionBias(fn, torch.device("cpu"))
    actual = backend.forward(q, lay.k_cache, lay.v_cache, meta, 1.0, bias)
    torch.testing.assert_close(actual.double(), dense_with_bias(lay, q, 1.0, fn), atol=2e-5, rtol=2e-5)
    # the bias matters here: without it the outputs differ
    plain = backend.forward(q, lay.k_cache, lay.v_cache, meta, 1.0)
    assert not torch.allclose(plain, actual, atol=1e-3)


@pytest.mark.parametrize("backend_name", ["reference", "sdpa"])
def test_a_token_tree_sees_the_bias_of_its_node_positions(backend_name):
    """A tree node's position is its depth below the tree's base; its bias is taken there."""
    t, num_heads, head_dim = 4, 4, 8
    lay = random_layout(3, t, 2, head_dim, torch.float32)
    lay.seqs = [s for s in lay.seqs if not s["queries"]]
    seq = lay.new()
    lay.append(seq, 9)  # linear tokens
    parents = [-1, 0, 0, 1, -1]
    lay.step(seq, len(parents))
    backend = get_attention_backend(backend_name)
    meta = backend.build_metadata(query_start_loc=[0, len(parents)], seq_lens=[seq["len"]],
                                  block_tables=[seq["table"]], slot_mapping=[0] * len(parents),
                                  tokens_per_block=t, device=torch.device("cpu"), trees=[parents])
    q = torch.randn(len(parents), num_heads, head_dim, generator=torch.Generator().manual_seed(5))
    fn = make_bias_fn(num_heads, 5)
    actual = backend.forward(q, lay.k_cache, lay.v_cache, meta, 0.5, PositionBias(fn, torch.device("cpu")))
    tree_start = seq["len"] - len(parents)
    positions = torch.tensor(list(range(tree_start)) + [tree_start - 1 + d for d in tree_depths(parents)])
    k, v = torch.stack(seq["k"]).repeat_interleave(2, 1), torch.stack(seq["v"]).repeat_interleave(2, 1)
    ancestry = tree_ancestry(parents)
    for j in range(len(parents)):
        visible = list(range(tree_start)) + [tree_start + a for a in range(len(parents)) if ancestry[j, a]]
        visible = torch.tensor(visible)
        scores = torch.einsum("hd,shd->hs", q[j].double(), k[visible]) * 0.5
        scores = scores + fn(positions[tree_start + j], positions[visible])
        expected = torch.einsum("hs,shd->hd", torch.softmax(scores, -1), v[visible])
        torch.testing.assert_close(actual[j].double(), expected, atol=2e-5, rtol=2e-5)
