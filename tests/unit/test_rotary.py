"""`apply_rotary` (widebeam/model/families/layers.py) against transformers' formula,
`x * cos + rotate_half(x) * sin`: float32 runs it as x * cos plus two in-place halves (equal within
float32 rounding); other dtypes run the formula op for op (bit-equal), and a partial rotary leaves the
tail dims as they are."""

from __future__ import annotations

import pytest
import torch

from widebeam.model.families.layers import apply_rotary


def formula(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def tables(num_tokens: int, rotary_dims: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(100, 100 + num_tokens, dtype=torch.float32)
    freqs = positions[:, None] / 10000 ** (torch.arange(0, rotary_dims, 2) / rotary_dims)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("num_tokens, heads, head_dim", [(1, 9, 64), (4, 12, 64), (17, 3, 8)])
def test_float32_equals_the_formula_within_rounding(num_tokens, heads, head_dim):
    x = torch.randn(num_tokens, heads, head_dim, generator=torch.Generator().manual_seed(head_dim)) * 5
    cos, sin = tables(num_tokens, head_dim, torch.float32)
    got = apply_rotary(x, cos, sin)
    assert got.shape == x.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, formula(x, cos, sin), rtol=1e-6, atol=1e-6)


def test_float32_takes_a_strided_slice_of_a_fused_projection():
    """The decoder rotates q and k as one slice of the fused q/k/v output (not contiguous)."""
    heads = torch.randn(3, 9 + 3 + 3, 16)
    cos, sin = tables(3, 16, torch.float32)
    qk = heads[:, :12]
    torch.testing.assert_close(apply_rotary(qk, cos, sin), formula(qk.contiguous(), cos, sin),
                               rtol=1e-6, atol=1e-6)


def test_bfloat16_is_the_formula_bit_for_bit():
    x = torch.randn(5, 4, 32, generator=torch.Generator().manual_seed(1)).bfloat16()
    cos, sin = tables(5, 32, torch.bfloat16)
    assert torch.equal(apply_rotary(x, cos, sin), formula(x, cos, sin))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_partial_rotary_rotates_the_leading_dims_only(dtype):
    x = torch.randn(3, 2, 16, generator=torch.Generator().manual_seed(2)).to(dtype)
    cos, sin = tables(3, 8, dtype)
    got = apply_rotary(x, cos, sin)
    assert torch.equal(got[..., 8:], x[..., 8:])
    torch.testing.assert_close(got[..., :8], formula(x[..., :8], cos, sin), rtol=1e-6, atol=1e-6)
