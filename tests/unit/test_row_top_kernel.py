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
    values, tokens, shifts = torch.ops.widebeam.log_softmax_topk(x, k)
    expected_values, expected_tokens = reference(x, k)
    assert torch.equal(tokens, expected_tokens)
    # each row's (max, log-sum-exp): the two the log-softmax subtracts
    expected_max = x.max(dim=1).values
    assert torch.equal(shifts[:, 0], expected_max) or case == "nan" and torch.allclose(
        shifts[:, 0], expected_max, equal_nan=True)
    assert torch.equal(values, expected_values) or case == "nan" and torch.allclose(
        values, expected_values, equal_nan=True)


@needs_selection
def test_strided_rows_and_the_limits():
    """Rows of a wider tensor (a view, stride(0) > vocab) read in place; k past the partial-sort regime
    or a non-float32 input is refused with the reason."""
    wide = logits(8, 1100, "ties", seed=3)
    x = wide[:, :1000]
    values, tokens, _ = torch.ops.widebeam.log_softmax_topk(x, 12)
    expected_values, expected_tokens = reference(x, 12)
    assert torch.equal(values, expected_values) and torch.equal(tokens, expected_tokens)
    with pytest.raises(RuntimeError, match="partial-sort"):
        torch.ops.widebeam.log_softmax_topk(x, 16)  # 16 x 64 > 1000
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.widebeam.log_softmax_topk(x.double(), 4)
    with pytest.raises(RuntimeError, match="rows index past"):
        torch.ops.widebeam.log_softmax_topk(x, 4, torch.tensor([0, 8]))
    with pytest.raises(RuntimeError, match="shifts"):
        torch.ops.widebeam.log_softmax_topk(x, 4, torch.tensor([0, 7]), torch.zeros(3, 2))


@needs_selection
@pytest.mark.parametrize("case", ["plain", "ties", "masked", "nan", "large"])
def test_chosen_rows_in_place_and_a_deeper_search_from_known_shifts(case):
    """`rows` reads those rows of x in place, as a gathered copy would give them; `shifts` handed back
    from the first call (the rows' max and log-sum-exp) give a deeper search bit for bit what a fresh
    one gives, and each is what torch.topk of the log-softmax gives."""
    x = logits(40, 4096, case, seed=11)
    _, _, shifts = torch.ops.widebeam.log_softmax_topk(x, 6)
    rows = torch.tensor([39, 0, 17, 17, 20])
    expected = reference(x.index_select(0, rows), 48)
    fresh = torch.ops.widebeam.log_softmax_topk(x, 48, rows)
    known = torch.ops.widebeam.log_softmax_topk(x, 48, rows, shifts.index_select(0, rows))
    for got in (fresh, known):
        assert torch.equal(got[1], expected.indices)
        assert torch.allclose(got[0], expected.values, equal_nan=True, rtol=0, atol=0)
        assert torch.allclose(got[2], shifts.index_select(0, rows), equal_nan=True, rtol=0, atol=0)
    # the shifts are used, not recomputed: a shifted lse moves every value by as much
    moved = shifts.index_select(0, rows) + torch.tensor([0.0, 1.0])
    values, tokens, _ = torch.ops.widebeam.log_softmax_topk(x, 48, rows, moved)
    assert torch.equal(tokens, expected.indices) or case in ("ties", "large")
    finite = torch.isfinite(values)
    assert torch.allclose(values[finite], expected.values[finite] - 1.0, atol=1e-4)


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
        calls.append((args[1], args[2] is not None, args[3] is not None))  # x, k, rows, shifts
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


@needs_selection
@pytest.mark.parametrize("ties", [False, True])
def test_a_deeper_search_reads_its_rows_in_place_with_known_shifts(monkeypatch, ties):
    """Rows that hold more of the K best than the shallow list offers (two rows far ahead of the rest)
    are searched deeper by the kernel, in place and from the first pass's shifts, and the step ranks
    bit for bit as the torch path does."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(96, 16384, generator=gen) * 3  # wide enough for the kernel at every depth
    if ties:
        x = torch.round(x)
    running = torch.zeros(96)
    running[[7, 60]] = 40.0  # these two beams hold all of the 192 best
    calls = []
    kernel = torch.ops.widebeam.log_softmax_topk

    def spy(*args):
        calls.append((args[1], None if args[2] is None else args[2].tolist(), args[3] is not None))
        return kernel(*args)

    monkeypatch.setattr(ranking, "_log_softmax_topk", spy)
    with_kernel = top_candidates(x, running, 192, None, normalize=True)
    assert calls[0][1:] == (None, False)
    deeper = calls[1:]
    assert deeper and all(rows is not None and known for _, rows, known in deeper), calls
    assert {7, 60} <= set(deeper[0][1])
    monkeypatch.setattr(kernels, "SELECTION_ENABLED", False)
    without = top_candidates(x, running, 192, None, normalize=True)
    for a, b in zip(with_kernel, without):
        assert torch.equal(a, b)
