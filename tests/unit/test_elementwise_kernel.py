"""RMSNorm and the rotary embedding as one C++ op each (widebeam/model/kernels/elementwise.cpp) against the
torch formulas in model/families/layers.py they replace (the same module called with the kernels switched
off), and through the engine with them on and off.

Tolerances: float32 within 1e-6 relative (the sum of squares in another order, a contracted product); a
16-bit result may land one step of its dtype the other way where a float32 intermediate sits that close
to a rounding boundary."""

from __future__ import annotations

import pytest
import torch

from widebeam.llm import LLM
from widebeam.model import kernels
from widebeam.model.families.layers import RMSNorm, apply_rotary
from widebeam.params import BeamSearchParams

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="C++ kernels not built")

TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}


def both_ways(monkeypatch, fn):
    """fn() with the kernels on, then off, and how many times the ops ran with them on."""
    calls = []
    for name in ("rms_norm", "rotary", "silu_and_mul"):
        op = getattr(torch.ops.widebeam, name)
        monkeypatch.setattr(torch.ops.widebeam, name, lambda *a, op=op: calls.append(1) or op(*a))
    monkeypatch.setattr(kernels, "ELEMENTWISE_ENABLED", True)
    on = fn()
    ran = len(calls)
    monkeypatch.setattr(kernels, "ELEMENTWISE_ENABLED", False)
    off = fn()
    assert len(calls) == ran, "switched off, the ops must not run"
    return on, off, ran


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("unit_offset", [False, True], ids=["w", "1 + w"])
@pytest.mark.parametrize("rows, hidden", [(1, 576), (7, 50), (300, 64), (2, 3)])
def test_rms_norm_matches_the_torch_formula(monkeypatch, dtype, unit_offset, rows, hidden):
    """Rows past the parallel grain (300 x 64), a width with a tail past 16 lanes (50) and below (3)."""
    gen = torch.Generator().manual_seed(rows * hidden)
    norm = RMSNorm(hidden, 1e-6, unit_offset)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=gen) * 0.5 + (0.0 if unit_offset else 1.0))
    norm = norm.to(dtype)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    with torch.no_grad():
        on, off, ran = both_ways(monkeypatch, lambda: norm(x))
    assert ran == 1 and on.dtype == dtype and on.shape == x.shape
    torch.testing.assert_close(on, off, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens, heads, head_dim", [(1, 12, 64), (5, 3, 128), (40, 4, 32), (2, 2, 6)])
def test_rotary_matches_the_torch_formula(monkeypatch, dtype, tokens, heads, head_dim):
    """x strided as the fused q/k/v output leaves it (q and k heads a slice of each token's row)."""
    gen = torch.Generator().manual_seed(tokens * heads)
    fused = torch.randn(tokens, heads + 2, head_dim, generator=gen).to(dtype)
    x = fused[:, :heads]  # not contiguous: the token stride covers heads + 2
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 6
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    with torch.no_grad():
        on, off, ran = both_ways(monkeypatch, lambda: apply_rotary(x, cos, sin))
    assert ran == 1 and on.shape == (tokens, heads, head_dim)
    torch.testing.assert_close(on, off, atol=TOLERANCE[dtype] * 4, rtol=TOLERANCE[dtype])


@needs_kernels
def test_a_partial_rotary_rotates_the_leading_dims_through_the_op(monkeypatch):
    x = torch.randn(3, 4, 64)
    emb = torch.rand(3, 16) * 6
    cos, sin = torch.cat((emb, emb), -1).cos(), torch.cat((emb, emb), -1).sin()
    with torch.no_grad():
        on, off, ran = both_ways(monkeypatch, lambda: apply_rotary(x, cos, sin))
    assert ran == 1
    torch.testing.assert_close(on, off, atol=1e-6, rtol=1e-6)
    assert torch.equal(on[..., 32:], x[..., 32:])


@needs_kernels
def test_with_a_gradient_wanted_the_torch_formulas_run(monkeypatch):
    """The ops have no backward: a norm whose weight wants a gradient, under grad mode, stays in torch."""
    norm = RMSNorm(32, 1e-6)
    x = torch.randn(2, 32)
    _, _, ran = both_ways(monkeypatch, lambda: norm(x))
    assert ran == 0
    norm(x).sum().backward()
    assert norm.weight.grad is not None


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, inter", [(1, 1536), (5, 37), (300, 64)])
def test_silu_and_mul_matches_the_torch_formula(dtype, rows, inter):
    """A width with a partial vector at its tail (37), rows past the parallel grain (300 x 64)."""
    gen = torch.Generator().manual_seed(rows + inter)
    fused = (torch.randn(rows, 2 * inter, generator=gen) * 4).to(dtype)
    gate, up = fused.split(inter, dim=-1)
    got = torch.ops.widebeam.silu_and_mul(fused)
    assert got.shape == (rows, inter) and got.dtype == dtype
    torch.testing.assert_close(got, torch.nn.functional.silu(gate) * up, atol=TOLERANCE[dtype] * 4,
                               rtol=TOLERANCE[dtype])


@needs_kernels
def test_a_fused_gated_mlp_runs_its_activation_as_one_op(monkeypatch):
    """A float32 model's MLP with gate/up stacked (the split backend's fusion): the op serves it, and the
    output equals the two-op formula's."""
    from widebeam.model.families.layers import GatedMLP
    from widebeam.model.linears.split import SplitLinear

    torch.manual_seed(0)
    mlp = GatedMLP(64, 96, "silu")
    mlp.fuse_projections(SplitLinear.concat)
    x = torch.randn(6, 64)
    with torch.no_grad():
        on, off, ran = both_ways(monkeypatch, lambda: mlp(x))
    assert ran == 1
    torch.testing.assert_close(on, off, atol=1e-6, rtol=1e-6)


@needs_kernels
def test_the_ops_check_their_arguments():
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="weight"):
        torch.ops.widebeam.rms_norm(x, torch.ones(7), 1e-6, False)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.widebeam.rms_norm(x.t(), torch.ones(2), 1e-6, False)
    with pytest.raises(RuntimeError, match="cos, sin"):
        torch.ops.widebeam.rotary(torch.randn(2, 3, 8), torch.randn(2, 6), torch.randn(2, 6))
    with pytest.raises(RuntimeError, match="silu_and_mul"):
        torch.ops.widebeam.silu_and_mul(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="dtype"):
        wide = torch.randn(2, 8).double()
        torch.ops.widebeam.rotary(torch.randn(2, 3, 8), wide, wide)


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_the_engine_generates_the_same_with_the_ops_on_and_off(monkeypatch, tiny_llama_head64_dir, dtype):
    """int8: its fused gate/up is an int8 linear (no float weight) whose float32 output the op reads; its
    linears quantize each activation row, so a last-bit change of an activation may round one of its
    int8 values the other way: scores within 2e-2, as bfloat16's."""
    llm = LLM(str(tiny_llama_head64_dir), device="cpu", dtype=dtype, kv_cache_memory="4MiB",
              enable_prefix_caching=False)
    requests = [{"prompt_token_ids": [(i * 31 + k) % 120 + 3 for i in range(n)]}
                for k, n in ((1, 9), (5, 40))]
    params = BeamSearchParams(beam_width=4, max_new_tokens=10, num_return_sequences=4)
    on, off, ran = both_ways(monkeypatch, lambda: llm.generate(requests, params, use_tqdm=False))
    assert ran > 0
    tolerance = 1e-4 if dtype == "float32" else 3e-2
    for a, b in zip(on, off, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [x.score for x in a.outputs] == pytest.approx([y.score for y in b.outputs], abs=tolerance)
