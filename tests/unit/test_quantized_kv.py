"""The int8 KV cache (model/attention/quantized_kv.py) on its own and through the engine: the
quantization's error bound, a shared prefix read in chunks equal to one read whole, and a prefix-cache
hit reading back what the first request wrote (scales included)."""

from __future__ import annotations

import pytest
import torch

from widebeam.llm import LLM
from widebeam.model.attention import backends
from widebeam.model.attention.quantized_kv import (
    QuantizedKV,
    dequantize,
    is_pair,
    quantize,
    read_pair,
    write_pair,
)
from widebeam.params import BeamSearchParams


def test_quantization_error_is_at_most_half_a_step():
    torch.manual_seed(0)
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 3, 50)[:, None, None]  # heads of every magnitude
    x[:, :, 40:] *= 20  # the second group of each head louder: its own scale
    x[7, 1] = 0.0  # an all-zero head
    values, scales = quantize(x)
    assert values.dtype == torch.int8 and scales.dtype == torch.float16 and scales.shape == (50, 3, 2)
    back = dequantize(values, scales, torch.float32)
    step = scales.float().repeat_interleave(32, dim=-1)  # each value's own group's scale
    # half a step, and the float16 rounding of the scale at a group's largest value
    assert torch.all((back - x).abs() <= step / 2 + x.abs() * 2.0 ** -10)
    assert torch.equal(back[7, 1], torch.zeros(64))
    quiet = dequantize(*quantize(x[:, :, :32].contiguous()), torch.float32)  # the quiet half alone
    assert torch.equal(back[:, :, :32], quiet)  # a louder group does not coarsen a quieter one


def test_a_layers_k_and_v_read_back_what_was_written():
    k_cache, v_cache = QuantizedKV.pair(torch.zeros(2, 16, 2, 8, dtype=torch.int8),
                                        torch.zeros(2, 16, 2, 1, dtype=torch.float16), torch.float32)
    assert is_pair(k_cache, v_cache) and not is_pair(k_cache, k_cache.values)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8) * 5
    slots = torch.tensor([9, 2, 14])
    write_pair(k_cache, v_cache, slots, k, v)
    assert torch.allclose(k_cache.index_select(0, slots), k, atol=k.abs().max().item() / 127)
    assert torch.allclose(v_cache.index_select(0, slots), v, atol=v.abs().max().item() / 127)
    assert torch.equal(k_cache[2:3], k_cache.index_select(0, torch.tensor([2])))
    pair_k, pair_v = read_pair(k_cache, v_cache, index=slots)  # one pass: the same as two
    assert torch.equal(pair_k, k_cache.index_select(0, slots))
    assert torch.equal(pair_v, v_cache.index_select(0, slots))
    range_k, range_v = read_pair(k_cache, v_cache, 2, 10)
    assert torch.equal(range_k, k_cache[2:10]) and torch.equal(range_v, v_cache[2:10])
    assert k_cache.dtype == torch.float32 and k_cache.shape == (16, 2, 8)


def beams(llm, prompt, width=4):
    params = BeamSearchParams(beam_width=width, max_new_tokens=6, num_return_sequences=width)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return out


@pytest.mark.parametrize("read_dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_a_shared_prefix_read_in_chunks_equals_one_read(monkeypatch, tiny_llama_dir, read_dtype, tolerance):
    """W=4 over a 60-token prompt: the beams' shared prefix dequantized 8 tokens at a time (8 chunks,
    the last one short) attends as one 512-token chunk does. Read as float32 the merge is exact to
    float32 rounding; read as bfloat16 each chunk's output is rounded to bfloat16 before the merge."""
    import widebeam.model.runner as runner_module

    monkeypatch.setattr(runner_module, "int8_read_dtype", lambda model_dtype, device: read_dtype)
    llm = LLM(str(tiny_llama_dir), device="cpu", kv_cache_memory="2MiB", tokens_per_block=4,
              enable_prefix_caching=False, kv_cache_dtype="int8")
    prompt = [(i * 17 + 5) % 120 + 3 for i in range(60)]
    whole = beams(llm, prompt)
    monkeypatch.setattr(backends, "PREFIX_CHUNK_TOKENS", 8)
    chunked = beams(llm, prompt)
    if read_dtype == torch.float32:
        assert [b.token_ids for b in chunked.outputs] == [b.token_ids for b in whole.outputs]
    for a, b in zip(chunked.outputs, whole.outputs):
        assert a.score == pytest.approx(b.score, abs=tolerance)


def test_a_prefix_cache_hit_reads_back_the_first_requests_kv(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", kv_cache_memory="2MiB", tokens_per_block=4,
              kv_cache_dtype="int8")
    prompt = [(i * 13 + 1) % 120 + 3 for i in range(41)]
    first, second = beams(llm, prompt), beams(llm, prompt)
    assert second.num_cached_tokens >= 40 - 4  # whole blocks of the prompt came from the cache
    assert [b.token_ids for b in second.outputs] == [b.token_ids for b in first.outputs]
    for a, b in zip(second.outputs, first.outputs):  # the last prompt token alone: another kernel call
        assert a.score == pytest.approx(b.score, abs=1e-5)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_a_chunk_attends_the_same_through_the_fused_kernel_and_the_plain_products(dtype, tolerance):
    """The plain products are what an int8 cache's prefix chunks take off the CPU (a GPU has no flash
    kernel returning the log-sum-exp); on the CPU both must agree."""
    torch.manual_seed(0)
    q = (torch.randn(3, 12, 64) / 8).to(dtype)
    k, v = torch.randn(40, 3, 64).to(dtype), torch.randn(40, 3, 64).to(dtype)
    fused_out, fused_lse = backends.chunk_attention(q, k, v, fused=True)
    plain_out, plain_lse = backends.chunk_attention(q, k, v, fused=False)
    assert torch.allclose(fused_out, plain_out, atol=tolerance) and torch.allclose(fused_lse, plain_lse,
                                                                                   atol=tolerance)
