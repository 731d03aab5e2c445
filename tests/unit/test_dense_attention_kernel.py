"""A float32 or bfloat16 cache's attention through the C++ kernel (widebeam/model/kernels/attention.cpp:
`dense_attention`, `dense_group_attention`) against plain attention in float64, against the torch path
it replaces in the backend (`_attend_group`, `_attend_in_place`), and through the engine with the kernel
on and off.

Tolerances: float32 caches within 1e-5 (summation order, the kernel's polynomial exp). bfloat16 caches are
read as the torch path's bfloat16 attention rounds (q, the weights and the output to bfloat16, products
and sums in float32), so a value a summation order away from a rounding boundary may land one bfloat16
step (2^-8 relative) the other way: 1e-2."""

from __future__ import annotations

import pytest
import torch

from widebeam.llm import LLM
from widebeam.model import kernels
from widebeam.model.attention import backends
from widebeam.model.attention.metadata import DecodeGroup
from widebeam.model.attention.quantized_kv import dequantize, quantize
from widebeam.params import BeamSearchParams, SamplingParams

# the dense-cache kernel reads run here on every build (tests/conftest.py), not only where they pay
pytestmark = pytest.mark.usefixtures("dense_kernel_reads_anywhere")

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="C++ kernels not built")

DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)]
# the real ones, for spies to call through
KERNEL_GROUP, KERNEL_ATTENTION = backends._kernel_group, backends._kernel_attention


def filled_cache(slots: int, heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return ((torch.randn(slots, heads, head_dim, generator=gen) * 2).to(dtype),
            torch.randn(slots, heads, head_dim, generator=gen).to(dtype))


def reference_attention(q_rows, k_cache, v_cache, slots):
    """q_rows [KV, R, d] against the K/V of `slots` in float64, a bfloat16 cache's q, weights and output
    rounded as its reads round them: (out [KV, R, d], lse [KV, R, 1])."""
    bf16 = k_cache.dtype == torch.bfloat16
    rounded = (lambda x: x.to(torch.bfloat16).double()) if bf16 else (lambda x: x.double())
    k, v = k_cache[slots].double().transpose(0, 1), v_cache[slots].double().transpose(0, 1)  # [KV, S, d]
    scores = rounded(q_rows) @ k.transpose(1, 2)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    weights = (scores - scores.amax(dim=-1, keepdim=True)).exp()
    out = (rounded(weights) @ v) / weights.sum(dim=-1, keepdim=True)
    return rounded(out).float(), lse.float()


@needs_kernels
@pytest.mark.parametrize("dtype, tolerance", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128, 48])
@pytest.mark.parametrize("num_keys", [1, 65, 700])
@pytest.mark.parametrize("rows", [1, 3, 17, 64])
def test_the_attention_matches_plain_attention(dtype, tolerance, head_dim, num_keys, rows):
    """head_dim 64 and 128 through the unrolled loops, 48 through the plain ones; slot runs and lists."""
    k_cache, v_cache = filled_cache(800, 2, head_dim, dtype, seed=num_keys)
    gen = torch.Generator().manual_seed(rows)
    q_rows = torch.randn(2, rows, head_dim, generator=gen) * head_dim ** -0.5 * 3  # peaked and flat rows
    index = torch.randperm(800, generator=gen)[:num_keys]
    for slots, args in ((torch.arange(50, 50 + num_keys), (50, 50 + num_keys, None)), (index, (0, 0, index))):
        out, lse = torch.ops.widebeam.dense_attention(q_rows, k_cache, v_cache, *args)
        expected_out, expected_lse = reference_attention(q_rows, k_cache, v_cache, slots)
        assert out.shape == (2, rows, head_dim) and lse.shape == (2, rows, 1)
        torch.testing.assert_close(out, expected_out, atol=tolerance, rtol=tolerance)
        torch.testing.assert_close(lse, expected_lse, atol=1e-4, rtol=1e-5)


@needs_kernels
def test_the_attention_checks_its_arguments():
    k_cache, v_cache = filled_cache(16, 2, 64, torch.float32, seed=0)
    q_rows = torch.randn(2, 3, 64)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.widebeam.dense_attention(q_rows, k_cache, v_cache, 10, 17, None)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.widebeam.dense_attention(q_rows, k_cache, v_cache, 0, 0, torch.tensor([3, 16]))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.widebeam.dense_attention(q_rows, k_cache.half(), v_cache.half(), 0, 4, None)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.widebeam.dense_attention(q_rows, k_cache.transpose(0, 1), v_cache.transpose(0, 1), 0, 2,
                                           None)
    with pytest.raises(RuntimeError, match="one dtype"):
        torch.ops.widebeam.dense_attention(q_rows, k_cache, v_cache.bfloat16(), 0, 4, None)
    out, lse = torch.ops.widebeam.dense_attention(q_rows, k_cache, v_cache, 4, 4, None)  # no keys
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))


def decode_group(beams: int, prefix_tokens: int, own_keys: list[int], consecutive: bool, seed: int):
    """A request's beams over a shared prefix (slots 100.. or a shuffled list) and their own keys, beam b
    holding own_keys[b] of them (0: the prefix alone), padded to the longest."""
    gen = torch.Generator().manual_seed(seed)
    width = max(max(own_keys), 1)
    suffix_slots = torch.arange(3000, 3000 + beams * width).view(beams, width)
    suffix_mask = torch.arange(width)[None, :] < torch.tensor(own_keys)[:, None]
    shuffled = torch.randperm(2900, generator=gen)[:prefix_tokens]
    prefix_slots = torch.arange(100, 100 + prefix_tokens) if consecutive else shuffled
    return DecodeGroup(token_index=torch.arange(beams), prefix_slots=prefix_slots, suffix_slots=suffix_slots,
                       suffix_mask=suffix_mask, suffix_hidden=~suffix_mask[:, None, :],
                       prefix_tokens=prefix_tokens, prefix_start=100 if consecutive else None)


@needs_kernels
@pytest.mark.parametrize("dtype, tolerance", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("consecutive", [True, False], ids=["prefix a run of slots", "prefix gathered"])
@pytest.mark.parametrize("beams, own_keys", [(1, [5]), (4, [3, 0, 7, 1]), (16, [9] * 16)])
@pytest.mark.parametrize("num_heads", [9, 3], ids=["3 heads a KV head", "one head a KV head"])
def test_a_decode_group_reads_the_same_through_the_kernel(monkeypatch, dtype, tolerance, consecutive, beams,
                                                          own_keys, num_heads):
    """`_attend_group` with the kernel against the torch path (a beam with no own keys included); a spy
    proves which ran. With one head a KV head (BART, Marian) the rows' reshape is a strided view."""
    k_cache, v_cache = filled_cache(3200, 3, 64, dtype, seed=beams)
    group = decode_group(beams, 600, own_keys, consecutive, seed=beams)
    q = (torch.randn(beams, num_heads, 64, generator=torch.Generator().manual_seed(7)) * 0.5).to(dtype)
    calls = []
    monkeypatch.setattr(backends, "_kernel_group", lambda *a: calls.append(1) or KERNEL_GROUP(*a))
    results = {}
    for on in (True, False):
        monkeypatch.setattr(kernels, "DENSE_ATTENTION_ENABLED", on)
        results[on] = backends._attend_group(q, k_cache, v_cache, group, 0.125)
    assert calls == [1], "the kernel serves the group with it on, the torch path with it off"
    torch.testing.assert_close(results[True], results[False], atol=tolerance, rtol=tolerance)


@needs_kernels
@pytest.mark.parametrize("dtype, kernel_in_place", [(torch.float32, False), (torch.bfloat16, True)])
def test_which_reads_go_through_the_dense_kernel(monkeypatch, dtype, kernel_in_place):
    """Groups up to DENSE_KERNEL_MAX_ROWS rows; one row in place only for bfloat16 (a float32 row reads
    as fast through PyTorch's fused kernel); off when switched off; the same answer every way."""
    k_cache, v_cache = filled_cache(600, 3, 64, dtype, seed=1)
    monkeypatch.setattr(kernels, "DENSE_ATTENTION_ENABLED", True)
    assert backends._use_kernel(k_cache, v_cache, backends.DENSE_KERNEL_MAX_ROWS)
    # past the cap only tiled (test_flash_rows_kernel.py)
    monkeypatch.setattr(kernels, "FLASH_ROWS_ENABLED", False)
    assert not backends._use_kernel(k_cache, v_cache, backends.DENSE_KERNEL_MAX_ROWS + 1)
    assert not backends._use_kernel(k_cache.half(), v_cache.half(), 3)
    calls = []
    monkeypatch.setattr(backends, "_kernel_attention", lambda *a: calls.append(1) or KERNEL_ATTENTION(*a))
    q = (torch.randn(1, 9, 64, generator=torch.Generator().manual_seed(2)) * 0.5).to(dtype)
    on = backends._attend_in_place(q, k_cache, v_cache, [(40, 300)], 0.125)
    assert len(calls) == int(kernel_in_place)
    monkeypatch.setattr(kernels, "DENSE_ATTENTION_ENABLED", False)
    assert not backends._use_kernel(k_cache, v_cache, 3)
    off = backends._attend_in_place(q, k_cache, v_cache, [(40, 300)], 0.125)
    assert len(calls) == int(kernel_in_place)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(on, off, atol=tolerance, rtol=tolerance)


PROMPTS = [[(i * 31 + k) % 120 + 3 for i in range(n)] for k, n in ((1, 9), (5, 23), (11, 70))]


@needs_kernels
def test_the_dense_reads_serve_only_builds_of_a_listed_capability(monkeypatch, tiny_llama_head64_dir):
    """`kernels.DENSE_ATTENTION_CAPABILITIES` keeps the dense-cache reads to the builds where they pay
    (AVX-512; on AVX2 they lost to the torch path): built for another capability, a beam search reads
    through the torch path, not one call of the kernel; built for a listed one, through the kernel; the
    same beams either way."""
    llm = LLM(str(tiny_llama_head64_dir), device="cpu", dtype="float32", kv_cache_memory="4MiB",
              tokens_per_block=4, enable_prefix_caching=False)
    calls = []
    monkeypatch.setattr(backends, "_kernel_group", lambda *a: calls.append(1) or KERNEL_GROUP(*a))
    requests = [{"prompt_token_ids": p} for p in PROMPTS]
    params = BeamSearchParams(beam_width=4, max_new_tokens=8)
    outputs = {}
    for listed in (False, True):
        built = kernels._BUILT_FOR
        listed_capabilities = (built,) if listed else ("NOT_" + built,)
        monkeypatch.setattr(kernels, "DENSE_ATTENTION_CAPABILITIES", listed_capabilities)
        assert kernels.dense_attention_enabled() is listed
        calls.clear()
        outputs[listed] = llm.generate(requests, params, use_tqdm=False)
        assert bool(calls) is listed
    for on, off in zip(outputs[True], outputs[False], strict=True):
        assert on.outputs[0].token_ids == off.outputs[0].token_ids


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_generates_the_same_with_the_kernel_on_and_off(monkeypatch, tiny_llama_head64_dir, dtype):
    """Greedy (W=1 rows in place) and beam search at W=4 (decode groups) through the public engine, the
    prefix cache off, 4-token blocks (a prefix over several blocks)."""
    llm = LLM(str(tiny_llama_head64_dir), device="cpu", dtype=dtype, kv_cache_memory="4MiB",
              tokens_per_block=4, enable_prefix_caching=False)
    requests = [{"prompt_token_ids": p} for p in PROMPTS]
    tolerance = 1e-4 if dtype == "float32" else 3e-2
    outputs = {}
    for on in (True, False):
        monkeypatch.setattr(kernels, "DENSE_ATTENTION_ENABLED", on)
        outputs[on] = (
            llm.generate(requests, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True),
                         use_tqdm=False),
            llm.generate(requests, BeamSearchParams(beam_width=4, max_new_tokens=12, num_return_sequences=4),
                         use_tqdm=False))
    for kind in (0, 1):
        for on, off in zip(outputs[True][kind], outputs[False][kind], strict=True):
            assert on.outputs[0].token_ids == off.outputs[0].token_ids
            if kind == 1:
                assert [a.score for a in on.outputs] == pytest.approx([b.score for b in off.outputs],
                                                                      abs=tolerance)


class FixedBias:
    """A position bias with set values for a group's own keys ([H, B, S]) and its shared prefix ([H, B, P],
    if any), as PositionBias hands them."""

    def __init__(self, suffix: torch.Tensor, prefix: torch.Tensor | None = None):
        self.suffix, self.prefix = suffix, prefix

    def group_suffix(self, group):
        return self.suffix

    def group_prefix(self, group):
        assert self.prefix is not None, "a group with no shared prefix has no prefix bias"
        return self.prefix

    def group_keys(self, group):
        return self.suffix if self.prefix is None else torch.cat((self.prefix, self.suffix), dim=2)


@needs_kernels
@pytest.mark.parametrize("dtype, tolerance", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("beams, own_keys", [(1, [5]), (4, [3, 1, 7, 2]), (16, [9] * 16)])
@pytest.mark.parametrize("num_heads", [8, 6], ids=["T5: one head a KV head", "3 heads a KV head"])
def test_a_position_bias_over_own_keys_reads_the_same_through_the_kernel(monkeypatch, dtype, tolerance, beams,
                                                                         own_keys, num_heads):
    """A group with no shared prefix and a position bias (T5's decoder at W=1, or beams that share nothing
    yet) goes through the group op with the bias added to each head's own-key scores, as the torch path
    adds it to its mask; a spy proves which ran."""
    kv_heads = num_heads if num_heads == 8 else 2
    k_cache, v_cache = filled_cache(3200, kv_heads, 64, dtype, seed=beams)
    group = decode_group(beams, 0, own_keys, True, seed=beams)
    gen = torch.Generator().manual_seed(11)
    q = (torch.randn(beams, num_heads, 64, generator=gen) * 0.5).to(dtype)
    # a bfloat16 model's bias table is bfloat16: its values are exact in it
    bias = FixedBias((torch.randn(num_heads, beams, max(own_keys), generator=gen) * 3).to(dtype).float())
    calls = []
    real = backends._kernel_biased_group
    monkeypatch.setattr(backends, "_kernel_biased_group", lambda *a: calls.append(True) or real(*a))
    results = {}
    for on in (True, False):
        monkeypatch.setattr(kernels, "DENSE_ATTENTION_ENABLED", on)
        results[on] = backends._attend_group(q, k_cache, v_cache, group, 1.0, bias)
    assert calls == [True], "the kernel serves the biased group with it on, the torch path with it off"
    torch.testing.assert_close(results[True], results[False], atol=tolerance, rtol=tolerance)


@needs_kernels
def test_the_suffix_bias_checks_its_shape_and_reaches_an_int8_pool():
    """A bias of the wrong shape is refused with the reason; through an int8 pool a bias that hides all
    but one own key leaves that key's V (dequantized) as each head's output."""
    k_cache, v_cache = filled_cache(64, 2, 64, torch.float32, seed=1)
    q = torch.randn(2, 2, 64)
    slots = torch.tensor([[3, 4, 5], [6, 7, 0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    with pytest.raises(RuntimeError, match="suffix_bias"):
        torch.ops.widebeam.dense_group_attention(q, 1.0, k_cache, v_cache, 0, 0, None, slots, mask,
                                                 torch.zeros(2, 3, 2))
    k_values, k_scales = quantize(k_cache)
    v_values, v_scales = quantize(v_cache)
    values, scales = torch.stack((k_values, v_values)), torch.stack((k_scales, v_scales))  # the pool's pair
    bias = torch.full((2, 2, 3), -1e4)
    bias[:, 0, 1] = 0.0  # beam 0 sees key 1 (slot 4) only
    bias[:, 1, 0] = 0.0  # beam 1 key 0 (slot 6)
    out = torch.ops.widebeam.int8_group_attention(q, 1.0, values, scales, 0, 0, None, slots, mask, False,
                                                  bias)
    dequantized_v = dequantize(v_values, v_scales, torch.float32)
    torch.testing.assert_close(out[0], dequantized_v[4], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1], dequantized_v[6], atol=1e-5, rtol=1e-5)


def biased_reference(q, k_cache, v_cache, group, bias):
    """Each beam's attention over the prefix and its own keys in float64 (q, K, V as stored), the bias
    added to the scores: [B, H, d]."""
    beams, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    out = torch.empty(beams, heads, head_dim, dtype=torch.float64)
    for b in range(beams):
        slots = torch.cat((group.prefix_slots, group.suffix_slots[b][group.suffix_mask[b]]))
        keys = group.prefix_tokens + int(group.suffix_mask[b].sum())
        real = torch.cat((torch.ones(group.prefix_tokens, dtype=torch.bool), group.suffix_mask[b]))
        row_bias = bias.group_keys(group)[:, b, :][:, real]
        k = k_cache[slots].double().repeat_interleave(heads // kv_heads, dim=1)  # [S, H, d]
        v = v_cache[slots].double().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,shd->hs", q[b].double(), k) + row_bias.double()
        assert scores.shape[1] == keys
        out[b] = torch.einsum("hs,shd->hd", scores.softmax(dim=-1), v)
    return out


@needs_kernels
@pytest.mark.parametrize("dtype, tolerance", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("consecutive", [True, False], ids=["prefix a run of slots", "prefix gathered"])
@pytest.mark.parametrize("beams, own_keys", [(1, [2]), (4, [3, 0, 7, 1]), (16, [5] * 16)])
def test_a_biased_group_with_a_shared_prefix_reads_it_per_beam_through_the_kernel(
        monkeypatch, dtype, tolerance, consecutive, beams, own_keys):
    """T5's beams share their first tokens' blocks: the group op reads the prefix as each beam's own keys
    with each key's bias, as plain attention in float64 gives (and as the torch path gives in float32;
    in bfloat16 the torch path rounds its prefix scores to bfloat16 where the kernel keeps float32); past
    BIASED_GROUP_MAX_KEYS beams x keys the torch path serves."""
    k_cache, v_cache = filled_cache(3200, 8, 64, dtype, seed=beams)
    group = decode_group(beams, 40, own_keys, consecutive, seed=beams)
    gen = torch.Generator().manual_seed(13)
    q = (torch.randn(beams, 8, 64, generator=gen) * 0.5).to(dtype)
    # a bfloat16 model's bias table is bfloat16: its values are exact in it
    bias = FixedBias((torch.randn(8, beams, max(own_keys), generator=gen) * 3).to(dtype).float(),
                     (torch.randn(8, beams, 40, generator=gen) * 3).to(dtype).float())
    calls = []
    real = backends._kernel_biased_group
    monkeypatch.setattr(backends, "_kernel_biased_group", lambda *a: calls.append(1) or real(*a))
    results = {}
    for on in (True, False):
        monkeypatch.setattr(kernels, "DENSE_ATTENTION_ENABLED", on)
        results[on] = backends._attend_group(q, k_cache, v_cache, group, 1.0, bias)
    assert calls == [1]
    expected = biased_reference(q, k_cache, v_cache, group, bias)
    torch.testing.assert_close(results[True].double(), expected, atol=tolerance, rtol=tolerance)
    if dtype == torch.float32:
        torch.testing.assert_close(results[True], results[False], atol=tolerance, rtol=tolerance)
    monkeypatch.setattr(kernels, "DENSE_ATTENTION_ENABLED", True)
    monkeypatch.setattr(backends, "BIASED_GROUP_MAX_KEYS", beams * (40 + max(own_keys)) - 1)
    calls.clear()
    torch.testing.assert_close(backends._attend_group(q, k_cache, v_cache, group, 1.0, bias), results[False])
    assert not calls, "past the bound the torch path serves"
