"""The selection kernel (widebeam/model/kernels/row_top.cpp: `log_softmax_topk`) against what it
replaces, torch.topk over torch.log_softmax: values bit for bit and tokens in the same order, ties,
masked (-inf) entries, NaN rows and strided rows included; and a beam step through `top_candidates`
taking the kernel and giving what the torch path gives."""

from __future__ import annotations

import shutil

import pytest
import torch

from widebeam.beam import ranking
from widebeam.beam.ranking import top_candidates
from widebeam.model import kernels

needs_selection = pytest.mark.skipif(not kernels.selection_enabled(),
                                     reason="C++ kernels not built for this CPU capability")


def test_the_selection_kernel_serves_wherever_a_compiler_is():
    """`make setup` builds it for the capability torch dispatches to; a build that does not serve here
    (stale, or for another capability) must fail, not leave the tests below skipped."""
    if shutil.which("g++") or shutil.which("c++"):
        assert kernels.selection_enabled(), "run `python -m widebeam.model.kernels.build`"


def reference(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.topk(torch.log_softmax(x, dim=1), k, dim=1)


def logits(rows: int, vocab: int, case: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen) * 6
    if case == "ties":
        x = torch.round(x)  # a dozen distinct values a row: every top-k boundary is a tie
    elif case == "flat":
        x = torch.zeros(rows, vocab)  # every entry ties: the order is the heap's alone
    elif case == "masked":
        x[:, torch.randperm(vocab, generator=gen)[: vocab // 2]] = float("-inf")
    elif case == "nan":
        x[rows // 2, vocab // 3] = float("nan")  # a NaN row: torch puts NaN first
    elif case == "large":
        x = x + 1e4  # large logits, small differences: the order of the kernel's subtractions matters
    return x


@needs_selection
@pytest.mark.parametrize("rows,vocab,k", [(1, 64, 1), (3, 640, 10), (17, 1000, 9), (64, 4096, 64),
                                          (5, 49152, 18), (2, 4099, 11)])
@pytest.mark.parametrize("case", ["plain", "ties", "flat", "masked", "nan", "large"])
def test_log_softmax_topk_is_torch_topk_of_the_log_softmax(rows, vocab, k, case):
    x = logits(rows, vocab, case, seed=rows * vocab + k)
    values, tokens = torch.ops.widebeam.log_softmax_topk(x, k)
    expected_values, expected_tokens = reference(x, k)
    assert torch.equal(tokens, expected_tokens)
    assert torch.equal(values, expected_values) or case == "nan" and torch.allclose(
        values, expected_values, equal_nan=True)


@needs_selection
def test_strided_rows_and_the_limits():
    """Rows of a wider tensor (a view, stride(0) > vocab) read in place; k past the partial-sort regime
    or a non-float32 input is refused with the reason."""
    wide = logits(8, 1100, "ties", seed=3)
    x = wide[:, :1000]
    values, tokens = torch.ops.widebeam.log_softmax_topk(x, 12)
    expected_values, expected_tokens = reference(x, 12)
    assert torch.equal(values, expected_values) and torch.equal(tokens, expected_tokens)
    with pytest.raises(RuntimeError, match="partial-sort"):
        torch.ops.widebeam.log_softmax_topk(x, 16)  # 16 x 64 > 1000
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.widebeam.log_softmax_topk(x.double(), 4)


@needs_selection
@pytest.mark.parametrize("rows,vocab", [(64, 4096), (256, 2048), (7, 30000)])
@pytest.mark.parametrize("ties", [False, True])
def test_a_beam_step_takes_the_kernel_and_ranks_as_the_torch_path(monkeypatch, rows, vocab, ties):
    """`top_candidates(normalize=True)` on the CPU goes through `log_softmax_topk` (a spy counts it) and
    returns, bit for bit and in order, what the chunked torch path returns with the kernel off."""
    gen = torch.Generator().manual_seed(rows + vocab)
    x = torch.randn(rows, vocab, generator=gen) * 4
    if ties:
        x = torch.round(x)
    running = torch.randn(rows, generator=gen) * 2
    calls = []
    kernel = torch.ops.widebeam.log_softmax_topk

    def spy(*args):
        calls.append(args[1])
        return kernel(*args)

    monkeypatch.setattr(ranking, "_log_softmax_topk", spy)
    with_kernel = top_candidates(x, running, 2 * rows, None, normalize=True)
    assert calls, "the kernel did not serve"
    monkeypatch.setattr(kernels, "SELECTION_ENABLED", False)
    calls.clear()
    without = top_candidates(x, running, 2 * rows, None, normalize=True)
    assert not calls
    for a, b in zip(with_kernel, without):
        assert torch.equal(a, b)
