"""The int8 KV cache's C++ kernels (widebeam/model/kernels/int8_kv.cpp, attention.cpp) against the torch
path they replace on the CPU: the write bit for bit (values and scales, K rotated, ties rounded half to even,
saturation, all-zero groups), the attention against float32 attention over the dequantized K/V (slot
ranges and index sets, 1-48 rows, 1-2,000 keys, head_dim 64 and 80), and the engine generating the
same tokens with the kernels on and off.

Tolerances: the kernel attends in float32 and the reference does too, in a different summation order
(and the kernel's exp is a polynomial within 2 ulp): 1e-5 absolute on outputs of order 1 and lse. Through
the engine the torch path reads an int8 cache as bfloat16 on a CPU with native bfloat16 products (this
one) and the kernel as float32; read as float32 both ways, tokens and scores agree within 1e-4; read
as bfloat16 by the torch path, greedy tokens and the best beam agree on these prompts, log-probs and
scores within 2e-2 (16-bit attention, as tests/parity/test_kv_cache_dtype_parity.py bounds it), and
two beams at a near tie may swap ranks."""

from __future__ import annotations

import shutil

import pytest
import torch

import widebeam.model.runner as runner_module
from widebeam.llm import LLM
from widebeam.model import kernels
from widebeam.model.attention import backends
from widebeam.model.attention.metadata import DecodeGroup
from widebeam.model.attention.quantized_kv import QuantizedKV, dequantize, write_pair
from widebeam.params import BeamSearchParams, SamplingParams

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="int8 KV kernels not built")


def test_the_kernels_are_built_wherever_a_compiler_is():
    """`make setup` builds them; a broken build (or a stale one) must fail here, not go quietly slow."""
    if shutil.which("g++") or shutil.which("c++"):
        assert kernels.available(), "run `python -m widebeam.model.kernels.build`"


def empty_pool(slots: int, heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    groups = max(head_dim // 32, 1)
    while head_dim % groups:
        groups -= 1
    return (torch.zeros(2, slots, heads, head_dim, dtype=torch.int8),
            torch.zeros(2, slots, heads, groups, dtype=torch.float16))


def awkward_kv(tokens: int, heads: int, head_dim: int, seed: int) -> torch.Tensor:
    """K or V of every magnitude, with the cases a quantizer gets wrong: an all-zero head, a group past
    float16's range (saturates), subnormal scales, and exact halves of a step (round half to even)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, heads, head_dim, generator=gen) * torch.logspace(-6, 4, tokens)[:, None, None]
    x[0, 0] = 0.0
    x[1 % tokens, :, : head_dim // 2] *= 1e4  # a group past 127 * 65504: clamped scale, saturated values
    halves = torch.arange(head_dim, dtype=torch.float32) - head_dim // 2 + 0.5  # k + 0.5 steps
    halves[0] = 127.0  # the group's max sets scale 1.0 exactly: every other value is a tie
    x[-1, -1] = halves
    return x


@needs_kernels
@pytest.mark.parametrize("head_dim", [64, 80, 8])
@pytest.mark.parametrize("rotated", [True, False], ids=["K rotated", "nothing rotated"])
@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_the_write_is_bit_exact(monkeypatch, head_dim, rotated, tokens):
    k, v = awkward_kv(tokens, 3, head_dim, 0), awkward_kv(tokens, 3, head_dim, 1)
    slots = torch.randperm(400, generator=torch.Generator().manual_seed(2))[:tokens]
    pools = {}
    for on in (True, False):
        monkeypatch.setattr(kernels, "ENABLED", on)
        values, scales = empty_pool(400, 3, head_dim)
        k_cache, v_cache = QuantizedKV.pair(values, scales, torch.float32)
        if not rotated:
            k_cache.rotation = None
        write_pair(k_cache, v_cache, slots, k, v)
        pools[on] = values, scales
    assert torch.equal(pools[True][0], pools[False][0])
    # float16 scales compared as bits: a -0.0 or NaN would compare equal as numbers and not as bits
    assert torch.equal(pools[True][1].view(torch.int16), pools[False][1].view(torch.int16))
    if not rotated:  # the exact halves stored half to even: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -0.5 -> 0
        group_size = head_dim // pools[True][1].shape[-1]  # the first group: scale 1.0, every value a tie
        ties = torch.arange(group_size) - head_dim // 2 + 0.5
        expected = torch.cat((torch.tensor([127.0]), torch.round(ties[1:])))
        assert torch.equal(pools[True][0][1, slots[-1], -1, :group_size].float(), expected)  # V
        assert torch.equal(pools[True][0][0, slots[-1], -1, :group_size].float(), expected)  # K


@needs_kernels
def test_the_write_checks_its_arguments():
    values, scales = empty_pool(8, 2, 64)
    k = torch.randn(2, 2, 64)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.widebeam.quantize_write(k, k, None, torch.tensor([1, 8]), values, scales)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.widebeam.quantize_write(k.double(), k.double(), None, torch.tensor([1, 2]), values, scales)
    with pytest.raises(RuntimeError, match="matching the pool"):
        torch.ops.widebeam.quantize_write(k[:, :1].contiguous(), k[:, :1].contiguous(), None,
                                          torch.tensor([1, 2]), values, scales)


def reference_attention(q_rows, values, scales, slots, bf16=False):
    """float32 attention over the dequantized K/V of `slots`, in the stored domain (as the kernel reads
    them): (out [KV, R, d], lse [KV, R, 1]). `bf16`: q, K, V, the weights and the output rounded to
    bfloat16, as a cache read as bfloat16 holds them (products and sums exact here)."""
    rounded = (lambda x: x.to(torch.bfloat16).double()) if bf16 else (lambda x: x.double())
    k = rounded(dequantize(values[0, slots], scales[0, slots], torch.float32).transpose(0, 1))  # [KV, S, d]
    v = rounded(dequantize(values[1, slots], scales[1, slots], torch.float32).transpose(0, 1))
    scores = rounded(q_rows) @ k.transpose(1, 2)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    weights = (scores - scores.amax(dim=-1, keepdim=True)).exp()
    out = (rounded(weights) @ v) / weights.sum(dim=-1, keepdim=True)
    return rounded(out).float(), lse.float()


def filled_pool(slots: int, heads: int, head_dim: int, seed: int):
    values, scales = empty_pool(slots, heads, head_dim)
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache = QuantizedKV.pair(values, scales, torch.float32)
    write_pair(k_cache, v_cache, torch.arange(slots), torch.randn(slots, heads, head_dim, generator=gen) * 2,
               torch.randn(slots, heads, head_dim, generator=gen))
    return values, scales


@needs_kernels
@pytest.mark.parametrize("bf16", [False, True], ids=["float32 reads", "bfloat16 reads"])
@pytest.mark.parametrize("head_dim", [64, 80, 48])
@pytest.mark.parametrize("num_keys", [1, 7, 64, 65, 513, 2000])
@pytest.mark.parametrize("rows", [1, 3, 17, 48, 96])
def test_the_attention_matches_float32_attention_over_the_dequantized_cache(head_dim, num_keys, rows, bf16):
    """head_dim 64 and 80 through the unrolled loops, 48 through the plain ones. Read as float32: within
    1e-5 (summation order, the polynomial exp). As bfloat16: a weight a summation order away from a
    rounding boundary rounds the other way (one bfloat16 step, 2^-8 of it), and the output too."""
    values, scales = filled_pool(2100, 3, head_dim, seed=num_keys)
    gen = torch.Generator().manual_seed(rows)
    q_rows = torch.randn(3, rows, head_dim, generator=gen) * head_dim ** -0.5 * 3  # peaked and flat rows
    start = 37
    index = torch.randperm(2100, generator=gen)[:num_keys]
    for slots, args in ((torch.arange(start, start + num_keys), (start, start + num_keys, None)),
                        (index, (0, 0, index))):
        out, lse = torch.ops.widebeam.int8_attention(q_rows, values, scales, *args, bf16)
        expected_out, expected_lse = reference_attention(q_rows, values, scales, slots, bf16)
        assert out.shape == (3, rows, head_dim) and lse.shape == (3, rows, 1)
        tolerance = 1e-2 if bf16 else 1e-5
        torch.testing.assert_close(out, expected_out, atol=tolerance, rtol=tolerance)
        torch.testing.assert_close(lse, expected_lse, atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_attention_does_not_depend_on_the_thread_count(threads):
    values, scales = filled_pool(700, 3, 64, seed=0)
    q_rows = torch.randn(3, 12, 64, generator=torch.Generator().manual_seed(0)) * 0.3
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out, lse = torch.ops.widebeam.int8_attention(q_rows, values, scales, 0, 700, None, False)
    finally:
        torch.set_num_threads(saved)
    expected_out, expected_lse = reference_attention(q_rows, values, scales, torch.arange(700))
    torch.testing.assert_close(out, expected_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, expected_lse, atol=1e-5, rtol=1e-5)


@needs_kernels
def test_the_attention_checks_its_arguments():
    values, scales = filled_pool(16, 2, 64, seed=0)
    q_rows = torch.randn(2, 3, 64)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.widebeam.int8_attention(q_rows, values, scales, 10, 17, None, False)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.widebeam.int8_attention(q_rows, values, scales, 0, 0, torch.tensor([3, 16]), False)
    with pytest.raises(RuntimeError, match="q_rows"):
        torch.ops.widebeam.int8_attention(q_rows[:1].contiguous(), values, scales, 0, 4, None, False)
    out, lse = torch.ops.widebeam.int8_attention(q_rows, values, scales, 4, 4, None, False)  # no keys
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))


@needs_kernels
@pytest.mark.parametrize("read_dtype, tolerance", [(torch.float32, 2e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("consecutive", [True, False], ids=["prefix a run of slots", "prefix gathered"])
def test_a_decode_groups_prefix_reads_the_same_through_the_kernel(monkeypatch, consecutive, read_dtype,
                                                                  tolerance):
    """`_prefix_attention` of an int8 cache: the kernel against the chunked dequantize and flash kernel
    (the two differ in summation order, and read as bfloat16 in which sums are rounded when)."""
    values, scales = filled_pool(1200, 3, 64, seed=3)
    k_cache, v_cache = (c.in_stored_domain() for c in QuantizedKV.pair(values, scales, read_dtype))
    prefix_slots = torch.arange(100, 1100) if consecutive else torch.randperm(1200)[:1000]
    group = DecodeGroup(token_index=torch.arange(4), prefix_slots=prefix_slots, suffix_slots=None,
                        suffix_mask=None, suffix_hidden=None, prefix_tokens=1000,
                        prefix_start=100 if consecutive else None)
    q_rows = (torch.randn(3, 12, 64, generator=torch.Generator().manual_seed(1)) * 0.2).to(read_dtype)
    results = {}
    for on in (True, False):
        monkeypatch.setattr(kernels, "ENABLED", on)
        results[on] = backends._prefix_attention(q_rows, k_cache, v_cache, group)
    for kernel_part, torch_part in zip(results[True], results[False], strict=True):
        torch.testing.assert_close(kernel_part, torch_part, atol=tolerance, rtol=tolerance)


@needs_kernels
@pytest.mark.parametrize("read_dtype, tolerance", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("consecutive", [True, False], ids=["prefix a run of slots", "prefix gathered"])
@pytest.mark.parametrize("beams", [1, 4, 16, 64])
def test_a_decode_group_attends_the_same_through_the_kernel(monkeypatch, consecutive, beams, read_dtype,
                                                            tolerance):
    """`_attend_group` of an int8 cache (prefix and each beam's own keys, padded, merged by log-sum-exp):
    the kernel's one op against the torch path, 3 KV heads of 3 grouped heads each."""
    values, scales = filled_pool(1500, 3, 64, seed=4)
    k_cache, v_cache = (c.in_stored_domain() for c in QuantizedKV.pair(values, scales, read_dtype))
    gen = torch.Generator().manual_seed(beams)
    order = torch.randperm(1500, generator=gen)
    prefix_slots = torch.arange(100, 700) if consecutive else order[:600]
    suffix_slots = order[600:600 + beams * 9].view(beams, 9)
    suffix_mask = torch.arange(9)[None, :] < torch.randint(0, 10, (beams, 1), generator=gen)  # 0-9 real keys
    group = DecodeGroup(token_index=torch.arange(beams), prefix_slots=prefix_slots, suffix_slots=suffix_slots,
                        suffix_mask=suffix_mask, suffix_hidden=~suffix_mask[:, None, :], prefix_tokens=600,
                        prefix_start=100 if consecutive else None)
    q = torch.randn(beams, 9, 64, generator=gen)
    results = {}
    for on in (True, False):
        monkeypatch.setattr(kernels, "ENABLED", on)
        results[on] = backends._attend_group(q, k_cache, v_cache, group, 0.125)
    torch.testing.assert_close(results[True], results[False], atol=tolerance, rtol=tolerance)


PROMPTS = [[(i * 31 + k) % 120 + 3 for i in range(n)] for k, n in ((1, 9), (5, 23), (11, 70))]


def generate_both_ways(monkeypatch, llm, params):
    outputs = {}
    for on in (True, False):
        monkeypatch.setattr(kernels, "ENABLED", on)
        outputs[on] = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return outputs


@needs_kernels
@pytest.mark.parametrize("read_as", ["float32", "bfloat16"])
def test_the_engine_generates_the_same_with_the_kernels_on_and_off(monkeypatch, tiny_llama_head64_dir,
                                                                   read_as):
    """Greedy and beam search at W=4 through the public engine, prefix cache off (every prompt written
    and read back through the path under test), 4-token blocks (a prefix over several blocks)."""
    with monkeypatch.context() as patch:
        patch.setattr(runner_module, "int8_read_dtype", lambda model_dtype, device: getattr(torch, read_as))
        llm = LLM(str(tiny_llama_head64_dir), device="cpu", kv_cache_memory="4MiB", tokens_per_block=4,
                  enable_prefix_caching=False, kv_cache_dtype="int8")
    tolerance = 1e-4 if read_as == "float32" else 2e-2
    greedy = generate_both_ways(monkeypatch, llm, SamplingParams(max_new_tokens=12, temperature=0,
                                                                 ignore_eos=True, logprobs=0))
    for on, off in zip(greedy[True], greedy[False], strict=True):
        assert on.outputs[0].token_ids == off.outputs[0].token_ids
        for token, a, b in zip(on.outputs[0].token_ids, on.outputs[0].logprobs, off.outputs[0].logprobs):
            assert a[token].logprob == pytest.approx(b[token].logprob, abs=tolerance)
    beam = generate_both_ways(monkeypatch, llm, BeamSearchParams(beam_width=4, max_new_tokens=12,
                                                                 num_return_sequences=4))
    for on, off in zip(beam[True], beam[False], strict=True):
        if read_as == "float32":
            for a, b in zip(on.outputs, off.outputs, strict=True):
                assert a.token_ids == b.token_ids and a.score == pytest.approx(b.score, abs=tolerance)
            continue
        # bfloat16 reads against float32 ones: two hypotheses 4e-4 apart (measured: ranks 2 and 3 of the
        # third prompt) may swap, so the best must agree, the k-th best scores and every hypothesis both
        # searches kept within the tolerance.
        assert on.outputs[0].token_ids == off.outputs[0].token_ids
        assert [a.score for a in on.outputs] == pytest.approx([b.score for b in off.outputs], abs=tolerance)
        kept = {tuple(b.token_ids): b.score for b in off.outputs}
        for a in on.outputs:
            assert a.score == pytest.approx(kept.get(tuple(a.token_ids), a.score), abs=tolerance)


def test_which_reads_go_through_the_kernel(monkeypatch):
    """Few rows of a CPU pair read in the stored domain, kernels on; switched off (WIDEBEAM_KERNELS=0,
    or not built), wide groups, or a cache read un-rotated: the torch path."""
    values, scales = empty_pool(8, 2, 64)
    k_cache, v_cache = QuantizedKV.pair(values, scales, torch.float32)
    stored = k_cache.in_stored_domain(), v_cache.in_stored_domain()
    monkeypatch.setattr(kernels, "ENABLED", True)
    assert backends._use_kernel(*stored, backends.KERNEL_MAX_ROWS) == kernels.available()
    with monkeypatch.context() as patch:  # past the cap only tiled (test_flash_rows_kernel.py)
        patch.setattr(kernels, "FLASH_ROWS_ENABLED", False)
        assert not backends._use_kernel(*stored, backends.KERNEL_MAX_ROWS + 1)
    assert backends._use_kernel(*stored, backends.KERNEL_GROUP_MAX_ROWS,
                                backends.KERNEL_GROUP_MAX_ROWS) == kernels.available()
    assert not backends._use_kernel(k_cache, v_cache, 4)  # K un-rotated as read: not what the kernel does
    monkeypatch.setattr(kernels, "ENABLED", False)
    assert not kernels.enabled() and not backends._use_kernel(*stored, 4)
