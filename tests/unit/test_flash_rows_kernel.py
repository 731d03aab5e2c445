"""Many query rows through the tiled C++ path (widebeam/model/kernels/flash_rows.h: a wide decode group
against its shared prompt) against plain attention in float64, against the few-row path at the same rows
(`set_flash_min_rows` moves the switch), through the backend past the few-row caps, and through the engine
at a width whose groups are past them, tiled path on and off.

Tolerances: float32 within 2e-5 (summation order, the online softmax's rescaling, the polynomial exp;
PyTorch's fused kernel is as far from float64 on these inputs: 1.8e-5 at worst, as is this path);
bfloat16 reads one bfloat16 step (1e-2)."""

from __future__ import annotations

import pytest
import torch

from widebeam.llm import LLM
from widebeam.model import kernels
from widebeam.model.attention import backends
from widebeam.model.attention.metadata import DecodeGroup
from widebeam.model.attention.quantized_kv import QuantizedKV, write_pair
from widebeam.params import BeamSearchParams

# the dense-cache kernel reads run here on every build (tests/conftest.py), not only where they pay
pytestmark = pytest.mark.usefixtures("dense_kernel_reads_anywhere")

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="C++ kernels not built")
NEVER = 2**62


@pytest.fixture
def min_rows():
    """Set the C++ side's tiling row count for one test (any work: 1 forces the tiled path), restored
    after."""
    saved = torch.ops.widebeam.flash_min_rows() if kernels.available() else None
    yield lambda rows: torch.ops.widebeam.set_flash_min_rows(rows, 0)
    if saved is not None:
        torch.ops.widebeam.set_flash_min_rows(saved, kernels.FLASH_MIN_WORK)


def dense_cache(slots: int, heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return ((torch.randn(slots, heads, head_dim, generator=gen) * 2).to(dtype),
            torch.randn(slots, heads, head_dim, generator=gen).to(dtype))


def reference(q_rows, k, v, bf16):
    """q_rows [KV, R, d] against k, v [S, KV, d] in float64, rounded as a bfloat16 read rounds."""
    rounded = (lambda x: x.to(torch.bfloat16).double()) if bf16 else (lambda x: x.double())
    k, v = k.double().transpose(0, 1), v.double().transpose(0, 1)
    scores = rounded(q_rows) @ k.transpose(1, 2)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    weights = (scores - scores.amax(dim=-1, keepdim=True)).exp()
    return rounded((rounded(weights) @ v) / weights.sum(dim=-1, keepdim=True)).float(), lse.float()


@needs_kernels
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 2e-5), (torch.bfloat16, 1e-2)],
                         ids=["float32", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_keys", [1, 63, 65, 255, 256, 257, 700])
@pytest.mark.parametrize("rows", [1, 5, 47, 48, 49, 200])
def test_the_tiled_path_matches_plain_attention(min_rows, dtype, tolerance, head_dim, num_keys, rows):
    """Row tiles (48), score tiles (64 keys) and key blocks (256) with and without tails; a run of slots (V
    read in place) and a list (V widened)."""
    min_rows(1)
    k_cache, v_cache = dense_cache(900, 2, head_dim, dtype, seed=num_keys)
    gen = torch.Generator().manual_seed(rows)
    q_rows = torch.randn(2, rows, head_dim, generator=gen) * head_dim ** -0.5 * 3  # peaked and flat rows
    index = torch.randperm(900, generator=gen)[:num_keys]
    for slots, args in ((torch.arange(60, 60 + num_keys), (60, 60 + num_keys, None)), (index, (0, 0, index))):
        out, lse = torch.ops.widebeam.dense_attention(q_rows, k_cache, v_cache, *args)
        bf16 = dtype == torch.bfloat16
        expected_out, expected_lse = reference(q_rows, k_cache[slots], v_cache[slots], bf16)
        torch.testing.assert_close(out, expected_out, atol=tolerance, rtol=tolerance)
        torch.testing.assert_close(lse, expected_lse, atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 2e-5), (torch.bfloat16, 1e-2)],
                         ids=["float32", "bfloat16"])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("rows, num_keys", [(5, 1100), (60, 2600), (100, 3000)])
def test_a_narrow_group_splits_its_keys_into_runs(min_rows, dtype, tolerance, threads, rows, num_keys):
    """Few row tiles for the threads: each tile's keys in runs of whole 256-key blocks (a last run shorter),
    merged by log-sum-exp; the answer does not depend on the thread count."""
    min_rows(1)
    k_cache, v_cache = dense_cache(3200, 2, 64, dtype, seed=rows)
    gen = torch.Generator().manual_seed(num_keys)
    q_rows = torch.randn(2, rows, 64, generator=gen) * 0.4
    index = torch.randperm(3200, generator=gen)[:num_keys]
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for slots, args in ((torch.arange(90, 90 + num_keys), (90, 90 + num_keys, None)),
                            (index, (0, 0, index))):
            out, lse = torch.ops.widebeam.dense_attention(q_rows, k_cache, v_cache, *args)
            bf16 = dtype == torch.bfloat16
            expected_out, expected_lse = reference(q_rows, k_cache[slots], v_cache[slots], bf16)
            torch.testing.assert_close(out, expected_out, atol=tolerance, rtol=tolerance)
            torch.testing.assert_close(lse, expected_lse, atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(saved)


@needs_kernels
@pytest.mark.parametrize("head_dim", [64, 128, 48])
@pytest.mark.parametrize("rows", [12, 100])
def test_both_paths_agree_and_unserved_head_sizes_stay_on_the_few_row_path(min_rows, head_dim, rows):
    """The same rows tiled and not; head_dim 48 is not tiled (its answer is the few-row path's bit for bit
    either way)."""
    k_cache, v_cache = dense_cache(500, 3, head_dim, torch.float32, seed=3)
    q_rows = torch.randn(3, rows, head_dim, generator=torch.Generator().manual_seed(1)) * 0.2
    results = {}
    for setting in (1, NEVER):
        min_rows(setting)
        results[setting] = torch.ops.widebeam.dense_attention(q_rows, k_cache, v_cache, 10, 490, None)
    if head_dim == 48:
        assert all(torch.equal(a, b) for a, b in zip(results[1], results[NEVER]))
    else:
        assert not torch.equal(results[1][0], results[NEVER][0]), "a different summation: a different path"
        for a, b in zip(results[1], results[NEVER]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("consecutive", [True, False])
def test_an_int8_pool_reads_the_same_tiled(min_rows, bf16, consecutive):
    """The int8 pool dequantized (and rounded) as read into the tiled path's buffers: the few-row path's
    answer."""
    values = torch.zeros(2, 1200, 3, 64, dtype=torch.int8)
    scales = torch.zeros(2, 1200, 3, 2, dtype=torch.float16)
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache = QuantizedKV.pair(values, scales, torch.float32)
    write_pair(k_cache, v_cache, torch.arange(1200), torch.randn(1200, 3, 64, generator=gen) * 2,
               torch.randn(1200, 3, 64, generator=gen))
    q_rows = torch.randn(3, 150, 64, generator=gen) * 0.3
    args = (40, 1040, None) if consecutive else (0, 0, torch.randperm(1200, generator=gen)[:1000])
    results = {}
    for setting in (1, NEVER):
        min_rows(setting)
        results[setting] = torch.ops.widebeam.int8_attention(q_rows, values, scales, *args, bf16)
    tolerance = 1e-2 if bf16 else 1e-5
    torch.testing.assert_close(results[1][0], results[NEVER][0], atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(results[1][1], results[NEVER][1], atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_a_wide_group_goes_through_the_kernel_past_the_caps(monkeypatch, dtype, tolerance):
    """64 beams x 3 grouped heads = 192 rows, past the few-row caps: one kernel op (prefix tiled, each beam's
    own keys merged) with the tiled path on, the torch path (PyTorch's fused kernel) with it off."""
    k_cache, v_cache = dense_cache(1500, 3, 64, dtype, seed=4)
    gen = torch.Generator().manual_seed(8)
    beams, order = 64, torch.randperm(1500, generator=gen)
    suffix_slots = order[600:600 + beams * 9].view(beams, 9)
    suffix_mask = torch.arange(9)[None, :] < torch.randint(0, 10, (beams, 1), generator=gen)
    group = DecodeGroup(token_index=torch.arange(beams), prefix_slots=torch.arange(100, 700),
                        suffix_slots=suffix_slots, suffix_mask=suffix_mask,
                        suffix_hidden=~suffix_mask[:, None, :],
                        prefix_tokens=600, prefix_start=100)
    q = torch.randn(beams, 9, 64, generator=gen).to(dtype)
    calls = []
    real = backends._kernel_group
    monkeypatch.setattr(backends, "_kernel_group", lambda *a: calls.append(1) or real(*a))
    results = {}
    for on in (True, False):
        kernels.set_flash_rows(on)
        try:
            results[on] = backends._attend_group(q, k_cache, v_cache, group, 0.125)
        finally:
            kernels.set_flash_rows(True)
    assert calls == [1]
    torch.testing.assert_close(results[True], results[False], atol=tolerance, rtol=tolerance)


@needs_kernels
def test_the_switch_moves_both_sides(monkeypatch):
    k_cache, v_cache = dense_cache(64, 2, 64, torch.float32, seed=0)
    wide = backends.DENSE_KERNEL_MAX_ROWS + 1
    try:
        kernels.set_flash_rows(False)
        assert torch.ops.widebeam.flash_min_rows() == NEVER
        assert not backends._use_kernel(k_cache, v_cache, wide)
        kernels.set_flash_rows(True)
        assert torch.ops.widebeam.flash_min_rows() == kernels.FLASH_MIN_ROWS
        assert backends._use_kernel(k_cache, v_cache, wide)
        k48, v48 = dense_cache(64, 2, 48, torch.float32, seed=0)
        assert not backends._use_kernel(k48, v48, wide), "a head size the tiles are not unrolled for"
    finally:
        kernels.set_flash_rows(True)
    with pytest.raises(RuntimeError, match="at least 1"):
        torch.ops.widebeam.set_flash_min_rows(0)
    with pytest.raises(RuntimeError, match="not negative"):
        torch.ops.widebeam.set_flash_min_rows(12, -1)


@needs_kernels
def test_the_engine_searches_the_same_with_the_tiled_path_on_and_off(tiny_llama_head64_dir):
    """W=48 through the public engine (48 beams x the tiny model's 2 grouped heads = 96 rows, past the
    few-row caps), prefix cache off, over a prompt of several blocks; every block back afterwards."""
    llm = LLM(str(tiny_llama_head64_dir), device="cpu", kv_cache_memory="16MiB", tokens_per_block=8,
              enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": [(i * 37 + k) % 120 + 3 for i in range(n)]}
               for k, n in ((1, 150), (4, 40))]
    params = BeamSearchParams(beam_width=48, max_new_tokens=6, num_return_sequences=4)
    pools_before = llm.engine.stats()["pools"]
    outputs = {}
    try:
        for on in (True, False):
            kernels.set_flash_rows(on)
            outputs[on] = llm.generate(prompts, params, use_tqdm=False)
    finally:
        kernels.set_flash_rows(True)
    for on, off in zip(outputs[True], outputs[False], strict=True):
        assert [a.token_ids for a in on.outputs] == [b.token_ids for b in off.outputs]
        assert [a.score for a in on.outputs] == pytest.approx([b.score for b in off.outputs], abs=1e-4)
    assert llm.engine.stats()["pools"] == pools_before
