"""The few-row linear kernel (widebeam/model/kernels/few_rows.cpp: `few_rows_linear`) against
`F.linear`: 1-8 rows, each of its loop orders (narrow inputs at 1-4 rows: one weight row at a time;
wide ones: four weight rows sharing each input load; 5-8 rows: two), output rows that do not fill
the last group, inputs that are not a multiple of the vector width, bias or none, strided rows; and
it is built wherever a compiler is."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from widebeam.model import kernels

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="C++ kernels not built")


def test_the_linear_kernel_serves_wherever_a_compiler_is():
    """`make setup` builds it; a missing or stale build must fail here, not leave the tests below skipped."""
    if shutil.which("g++") or shutil.which("c++"):
        assert kernels.linear_enabled(), "run `python -m widebeam.model.kernels.build`"


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("in_features", [7, 16, 64, 576, 1000, 1536, 4100])  # 1,536+ at 3-4 rows: wide
@pytest.mark.parametrize("out_features", [1, 3, 5, 64, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_few_rows_linear_equals_f_linear(rows, in_features, out_features, bias):
    gen = torch.Generator().manual_seed(rows * 7919 + in_features * 31 + out_features)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) * 10 if bias else None
    got = torch.ops.widebeam.few_rows_linear(x, weight, b)
    assert got.shape == (rows, out_features) and got.is_contiguous()
    # the same dot products summed in another order: float32 rounding of a sum of `in_features` terms
    torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-5, atol=2e-5 * in_features ** 0.5)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 8])
@pytest.mark.parametrize("in_features", [40, 576, 1540])
def test_16_bit_weights_sum_in_float32_and_round_once(dtype, rows, in_features):
    """bfloat16/float16 x and weight: each output is the float32 sum of the widened products plus the
    bias, rounded once to the dtype (within one rounding of that float32 reference)."""
    gen = torch.Generator().manual_seed(rows * 13 + in_features)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    weight = torch.randn(72, in_features, generator=gen).to(dtype)
    b = torch.randn(72, generator=gen).to(dtype)
    got = torch.ops.widebeam.few_rows_linear(x, weight, b)
    assert got.dtype == dtype and got.shape == (rows, 72)
    reference = F.linear(x.float(), weight.float(), b.float())
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got.float(), reference, rtol=eps, atol=1e-4 * in_features ** 0.5)


@needs_kernels
def test_strided_rows_and_each_row_its_own():
    """Rows with a stride past their length (a slice of a wider tensor) read each row where it is, and
    each output row depends on its input row only."""
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(4, 1600, generator=gen)
    x = wide[:, :1536]
    weight = torch.randn(96, 1536, generator=gen)
    got = torch.ops.widebeam.few_rows_linear(x, weight, None)
    torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-5, atol=1e-3)
    for r in range(4):
        alone = torch.ops.widebeam.few_rows_linear(x[r:r + 1].contiguous(), weight, None)
        torch.testing.assert_close(alone[0], got[r], rtol=1e-5, atol=1e-3)


@needs_kernels
@pytest.mark.parametrize("case", ["nine rows", "no rows", "weight transposed", "mixed dtypes", "float64",
                                  "wrong in"])
def test_what_it_refuses(case):
    x, weight = torch.randn(2, 32), torch.randn(48, 32)
    if case == "nine rows":
        x = torch.randn(9, 32)
    elif case == "no rows":
        x = torch.randn(0, 32)
    elif case == "weight transposed":
        weight = torch.randn(32, 48).t()
    elif case == "mixed dtypes":
        x = x.bfloat16()
    elif case == "float64":
        x, weight = x.double(), weight.double()
    else:
        x = torch.randn(2, 33)
    with pytest.raises(RuntimeError, match="few_rows_linear"):
        torch.ops.widebeam.few_rows_linear(x, weight, None)
