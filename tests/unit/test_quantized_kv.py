"""The int8 KV cache (model/attention/quantized_kv.py) on its own and through the engine: the
quantization's error bound (in the rotated domain K is stored in), the rotation (the Walsh-Hadamard
matrix; an outlier channel spread over the head; every read un-rotated, attention in the stored domain
equal to attention over the un-rotated reads), a shared prefix read in chunks equal to one read whole,
and a prefix-cache hit reading back what the first request wrote (scales included)."""

from __future__ import annotations

import pytest
import torch

from widebeam.llm import LLM
from widebeam.model.attention import backends, quantized_kv
from widebeam.model.attention.quantized_kv import (
    QuantizedKV,
    dequantize,
    hadamard,
    is_pair,
    quantize,
    read_pair,
    write_pair,
)
from widebeam.params import BeamSearchParams


def test_the_rotation_is_the_normalized_walsh_hadamard_matrix():
    h = hadamard(64)
    assert h.dtype == torch.float32 and torch.equal(h.abs(), torch.full((64, 64), 1 / 8))  # exact entries
    i, j = torch.meshgrid(torch.arange(64), torch.arange(64), indexing="ij")
    parity = torch.tensor([n.bit_count() % 2 for n in range(64)])
    assert torch.equal(h < 0, parity[i & j].bool())  # Sylvester: sign (-1)^popcount(i & j)
    assert torch.equal(h, h.T) and torch.allclose(h @ h, torch.eye(64), atol=1e-6)  # its own inverse
    blocks = hadamard(80)  # not a power of two: five blocks of 16 on the diagonal
    assert torch.equal(blocks, torch.block_diag(*[hadamard(16)] * 5))
    assert hadamard(9) is None and hadamard(64) is h  # odd: not rotated; built once


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_pool_is_rotated_by_the_same_matrix():
    assert torch.equal(hadamard(64, "cuda").cpu(), hadamard(64))
    x = torch.randn(20, 3, 64)
    back = dequantize(*quantize(x.cuda(), hadamard(64, "cuda")), torch.float32, hadamard(64, "cuda"))
    assert torch.allclose(back.cpu(), dequantize(*quantize(x, hadamard(64)), torch.float32, hadamard(64)),
                          atol=1e-5)


def test_quantization_error_is_at_most_half_a_step():
    """In the domain the values are stored in (x @ H for a rotated cache, x itself otherwise) each
    value is within half its group's step; the rotation preserves norms, so each token's head read
    back is within the norm of those half steps."""
    torch.manual_seed(0)
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 3, 50)[:, None, None]  # heads of every magnitude
    x[:, :, 40:] *= 20  # the second group of each head louder: its own scale
    x[7, 1] = 0.0  # an all-zero head
    for h in (None, hadamard(64)):
        stored = x if h is None else x @ h
        values, scales = quantize(x, h)
        assert values.dtype == torch.int8 and scales.dtype == torch.float16 and scales.shape == (50, 3, 2)
        back = dequantize(values, scales, torch.float32)  # not un-rotated: the stored domain
        step = scales.float().repeat_interleave(32, dim=-1)  # each value's own group's scale
        # half a step, and the float16 rounding of the scale at a group's largest value
        bound = step / 2 + stored.abs() * 2.0 ** -10
        assert torch.all((back - stored).abs() <= bound)
        read = dequantize(values, scales, torch.float32, h)  # as a cache reads it
        assert torch.all((read - x).norm(dim=-1) <= bound.norm(dim=-1) * (1 + 1e-5) + 1e-30)
        assert torch.equal(read[7, 1], torch.zeros(64))
        quiet = dequantize(*quantize(stored[:, :, :32].contiguous()), torch.float32)  # the first group alone
        assert torch.equal(back[:, :, :32], quiet)  # a louder group does not coarsen a quieter one


def int8_pair(slots: int, heads: int, head_dim: int, read_dtype=torch.float32):
    """An empty layer of an int8 pool, as the runner makes one: (K, V)."""
    groups = max(head_dim // 32, 1)
    return QuantizedKV.pair(torch.zeros(2, slots, heads, head_dim, dtype=torch.int8),
                            torch.zeros(2, slots, heads, groups, dtype=torch.float16), read_dtype)


def test_an_outlier_channel_no_longer_coarsens_the_others():
    """K has a few channels far louder than the rest. Unrotated, a loud channel sets its group's scale
    and its 31 group-mates are stored in its coarse steps; the pool stores K rotated, which spreads the
    channel over the whole head, so the others' error is several times smaller (measured: 20x less in
    mean square here). V is stored as it is."""
    torch.manual_seed(0)
    k = torch.randn(200, 3, 64)
    k[:, :, 5] *= 50
    others = torch.arange(64) != 5
    k_cache, v_cache = int8_pair(200, 3, 64)
    slots = torch.arange(200)
    write_pair(k_cache, v_cache, slots, k, k)  # the same values as K and as V
    k_error = (k_cache.index_select(0, slots) - k)[..., others].pow(2).mean()
    v_error = (v_cache.index_select(0, slots) - k)[..., others].pow(2).mean()
    plain_error = (dequantize(*quantize(k), torch.float32) - k)[..., others].pow(2).mean()
    assert torch.equal(v_error, plain_error)  # V: not rotated
    assert k_error < plain_error / 8


def test_every_read_of_a_rotated_cache_is_un_rotated():
    """Whatever reads the pool (a gather of slots, a run of slots, both of a layer at once) gets back
    K as it was written, within the quantization's error, not K @ H."""
    torch.manual_seed(0)
    k_cache, v_cache = int8_pair(16, 2, 64)
    assert k_cache.rotation is not None and v_cache.rotation is None
    k, v = torch.randn(16, 2, 64), torch.randn(16, 2, 64)
    write_pair(k_cache, v_cache, torch.arange(16), k, v)
    index = torch.tensor([9, 2, 14])

    def within_the_bound(read, expected):  # half a step in each of 64 values: 8 / 254 of the norm at most
        return torch.all((read - expected).norm(dim=-1) <= expected.norm(dim=-1) * 0.032)

    for read, expected in ((k_cache.index_select(0, index), k[index]), (k_cache[3:11], k[3:11]),
                           (read_pair(k_cache, v_cache, index=index)[0], k[index]),
                           (read_pair(k_cache, v_cache, 3, 11)[0], k[3:11])):
        assert within_the_bound(read, expected)
    stored = k_cache.in_stored_domain()[3:11]  # what the sdpa backend reads: rotated
    assert within_the_bound(stored, k[3:11] @ hadamard(64)) and not within_the_bound(stored, k[3:11])


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


@pytest.mark.parametrize("rotate_v", [False, True], ids=["K rotated", "K and V rotated"])
@pytest.mark.parametrize("read_dtype, tolerance", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_attention_in_the_stored_domain_equals_attention_over_the_un_rotated_reads(monkeypatch, rotate_v,
                                                                                    read_dtype, tolerance):
    """The "sdpa" backend attends a rotated cache in its stored domain (q rotated as K is, the output
    un-rotated as V is); the same layouts as test_attention_backends (shared prefixes, loose decodes,
    prefill chunks) attended over a float cache holding the un-rotated reads must come out the same.
    V is not rotated by default (ROTATE_V, measured); rotated, the output is un-rotated once."""
    from test_attention_backends import random_layout

    monkeypatch.setattr(quantized_kv, "ROTATE_V", rotate_v)

    for seed in range(3):
        lay = random_layout(seed, 4, 3, 64, torch.float32)
        written = torch.nan_to_num(lay.k_cache), torch.nan_to_num(lay.v_cache)  # NaN: slots never written
        k_cache, v_cache = int8_pair(written[0].shape[0], 3, 64, read_dtype)
        write_pair(k_cache, v_cache, torch.arange(written[0].shape[0]), *written)
        backend = backends.get_attention_backend("sdpa")
        meta = lay.metadata(backend, None)
        q = torch.randn(meta.query_start_loc[-1], 9, 64, generator=torch.Generator().manual_seed(seed))
        actual = backend.forward(q, k_cache, v_cache, meta, 0.125)
        expected = backend.forward(q, k_cache[:], v_cache[:], meta, 0.125)  # un-rotated, as floats
        torch.testing.assert_close(actual, expected, atol=tolerance, rtol=tolerance)


def test_every_pool_of_an_int8_engine_stores_k_rotated(tiny_llama_dir, tiny_marian_dir):
    """The rotation is the pools' stored format: a draft model's pool and an encoder-decoder's self and
    cross pools are built by the same runner code, K rotated by the head's H, V not."""
    from widebeam.engine import LLMEngine

    draft_engine = LLMEngine(str(tiny_llama_dir), device="cpu", kv_cache_memory="2MiB", kv_cache_dtype="int8",
                             speculative_model=str(tiny_llama_dir))
    seq2seq = LLM(str(tiny_marian_dir), device="cpu", kv_cache_memory="2MiB", kv_cache_dtype="int8").engine
    runners = [draft_engine.workers[0].runner, draft_engine.drafting.drafter.worker.runner,
               seq2seq.workers[0].runner]
    assert "cross" in runners[2].kv_tensors
    for runner in runners:
        for k_cache, v_cache in runner.kv_caches:
            assert torch.equal(k_cache.rotation, hadamard(k_cache.shape[-1])) and v_cache.rotation is None


def test_an_encoder_decoder_attends_its_rotated_pools_as_the_reference_backend_does(monkeypatch,
                                                                                      tiny_marian_dir):
    """Self and cross pools: "sdpa" attends them in the stored domain, "reference" un-rotates every read
    (read as float32 here). Beams equal, scores within 2e-3 (a 1e-7 difference in a K can move it
    across a rounding boundary: test_kv_cache_dtype_parity's tolerance)."""
    import widebeam.model.runner as runner_module

    monkeypatch.setattr(runner_module, "int8_read_dtype", lambda model_dtype, device: torch.float32)
    outputs = {}
    for backend in ("sdpa", "reference"):
        llm = LLM(str(tiny_marian_dir), device="cpu", kv_cache_memory="2MiB", tokens_per_block=4,
                  kv_cache_dtype="int8", attention_backend=backend)
        outputs[backend] = beams(llm, [(i * 7 + 3) % 50 + 5 for i in range(30)] + [2])
    for a, b in zip(outputs["sdpa"].outputs, outputs["reference"].outputs, strict=True):
        assert a.token_ids == b.token_ids and a.score == pytest.approx(b.score, abs=2e-3)


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
