"""Rows of a KV cache copied by index in C++ (widebeam/model/kernels/copy_rows.cpp): the op against
index_copy_ for every dtype a pool holds and a strided source, its argument checks, the step's K/V write
(model/attention/paged.py) from a slice of a fused projection, the runner's copy-on-write copies (a block
that both gives and takes falls back to the gathered copy), and the engine's searches bit-equal with the
op on and off. Copies are exact: every comparison is `torch.equal`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from widebeam.llm import LLM
from widebeam.model import kernels
from widebeam.model.attention.paged import write_kv
from widebeam.model.runner import ModelRunner
from widebeam.params import BeamSearchParams

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="C++ kernels not built")


def spy_copy_rows(monkeypatch) -> list[bool]:
    """The op's calls, each as whether it was a copy (a source index: copy-on-write) or a write."""
    calls: list[bool] = []
    real = torch.ops.widebeam.copy_rows
    monkeypatch.setattr(torch.ops.widebeam, "copy_rows",
                        lambda *a: calls.append(a[3] is not None) or real(*a))
    return calls


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
@pytest.mark.parametrize("with_src_index", [False, True])
def test_the_op_copies_as_index_copy_does(dtype, with_src_index):
    gen = torch.Generator().manual_seed(0)
    dst = (torch.randn(3, 50, 12, generator=gen) * 50).to(dtype)
    wide = (torch.randn(3, 40, 20, generator=gen) * 50).to(dtype)
    src = wide[:, :, 4:16]  # rows contiguous inside, strided between: a slice of a fused output
    dst_index = torch.randperm(50, generator=gen)[:17]
    src_index = torch.randint(0, 40, (17,), generator=gen) if with_src_index else None
    rows = src.index_select(1, src_index) if with_src_index else src[:, :17]
    expected = dst.clone()
    expected.index_copy_(1, dst_index, rows.contiguous())
    if not with_src_index:
        src = src[:, :17]
    torch.ops.widebeam.copy_rows(dst, dst_index, src, src_index)
    assert torch.equal(dst, expected)


@needs_kernels
def test_the_op_checks_its_arguments():
    dst, src = torch.zeros(1, 4, 8), torch.ones(1, 2, 8)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.widebeam.copy_rows(dst, torch.tensor([1, 4]), src, None)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.widebeam.copy_rows(dst, torch.tensor([1, 2]), src, torch.tensor([0, 2]))
    with pytest.raises(RuntimeError, match="one dtype"):
        torch.ops.widebeam.copy_rows(dst, torch.tensor([1, 2]), src.double(), None)
    with pytest.raises(RuntimeError, match="one src row per dst_index"):
        torch.ops.widebeam.copy_rows(dst, torch.tensor([1]), src, None)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.widebeam.copy_rows(dst, torch.tensor([1, 2]), torch.ones(1, 8, 2).transpose(1, 2), None)
    assert torch.equal(dst, torch.zeros(1, 4, 8)), "a refused call writes nothing"


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kv_write_from_a_fused_projection_matches_index_copy(monkeypatch, dtype):
    """k and v as the decoder hands them: slices of one [tokens, heads, d] output (strided rows)."""
    gen = torch.Generator().manual_seed(1)
    fused = torch.randn(9, 4 + 2 + 2, 16, generator=gen).to(dtype)  # q heads, k heads, v heads
    k, v = fused[:, 4:6], fused[:, 6:8]
    slots = torch.randperm(40, generator=gen)[:9]
    caches = {}
    calls = spy_copy_rows(monkeypatch)
    for on in (True, False):
        monkeypatch.setattr(kernels, "COPY_ROWS_ENABLED", on)
        k_cache, v_cache = torch.zeros(40, 2, 16, dtype=dtype), torch.zeros(40, 2, 16, dtype=dtype)
        write_kv(k_cache, v_cache, k, v, slots)
        caches[on] = (k_cache, v_cache)
    assert len(calls) == 2, "K and V through the op with it on, index_copy_ with it off"
    assert all(torch.equal(a, b) for a, b in zip(caches[True], caches[False]))
    assert torch.equal(caches[True][0][slots], k) and torch.equal(caches[True][1][slots], v)


def _runner(num_layers: int, num_blocks: int, t: int, kv_cache_dtype: str | None = None) -> ModelRunner:
    arch = SimpleNamespace(num_kv_heads=2, head_dim=8, layer_windows=[None] * num_layers)
    model = SimpleNamespace(arch=arch, layer_pool_names=["self"] * num_layers)
    return ModelRunner(model, {"self": num_blocks}, t, torch.device("cpu"), torch.float32,
                       kv_cache_dtype=kv_cache_dtype)


@needs_kernels
@pytest.mark.parametrize("kv_cache_dtype", [None, "int8"])
@pytest.mark.parametrize("copies, direct", [([(0, 3, 2), (1, 4, 4), (2, 5, 1)], True),
                                            ([(0, 3, 2), (3, 5, 4)], False)],
                         ids=["fresh blocks", "a block gives and takes"])
def test_the_copy_on_write_copies_the_same_either_way(monkeypatch, kv_cache_dtype, copies, direct):
    """Every layer's K and V (and an int8 pool's scales) moved as the gathered copy moves them; a block
    that is both a source and a destination (a copy's input changed by another) goes the gathered way."""
    results = {}
    calls = spy_copy_rows(monkeypatch)
    for on in (True, False):
        monkeypatch.setattr(kernels, "COPY_ROWS_ENABLED", on)
        runner = _runner(num_layers=3, num_blocks=6, t=4, kv_cache_dtype=kv_cache_dtype)
        gen = torch.Generator().manual_seed(2)
        tensors = [runner.kv_tensors["self"], runner.kv_scales.get("self")]
        for tensor in (t for t in tensors if t is not None):
            tensor.copy_((torch.randn(tensor.shape, generator=gen) * 40).to(tensor.dtype))
        runner.copy_blocks("self", copies)
        results[on] = [t.clone() for t in tensors if t is not None]
    assert len(calls) == (len(results[True]) if direct else 0)
    assert all(torch.equal(a, b) for a, b in zip(results[True], results[False], strict=True))


@needs_kernels
def test_the_engine_searches_bit_equal_with_the_op_on_and_off(monkeypatch, tiny_llama_head64_dir):
    """W=8 over prompts of several 4-token blocks, prefix cache off: forks share partial blocks, so every
    step both writes K/V and copies on write; every block back afterwards."""
    llm = LLM(str(tiny_llama_head64_dir), device="cpu", kv_cache_memory="8MiB", tokens_per_block=4,
              enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": [(i * 29 + k) % 120 + 3 for i in range(n)]}
               for k, n in ((1, 13), (7, 30))]
    params = BeamSearchParams(beam_width=8, max_new_tokens=10, num_return_sequences=8)
    pools_before = llm.engine.stats()["pools"]
    calls = spy_copy_rows(monkeypatch)
    outputs = {}
    for on in (True, False):
        monkeypatch.setattr(kernels, "COPY_ROWS_ENABLED", on)
        outputs[on] = llm.generate(prompts, params, use_tqdm=False)
        if on:
            assert any(calls) and not all(calls), "the op ran both the copies on write and the K/V writes"
            calls.clear()
    assert not calls, "nothing through the op with it off"
    for on, off in zip(outputs[True], outputs[False], strict=True):
        assert [(a.token_ids, a.score) for a in on.outputs] == [(b.token_ids, b.score) for b in off.outputs]
    assert llm.engine.stats()["pools"] == pools_before
