"""`kv_cache_dtype` against transformers whose cache stores K/V the same way, written out here from its
definition with plain torch ops (no widebeam code): `DefinitionCache` rounds every K and V it is given
(after RoPE, as both engines store them) to bfloat16 / float16, or quantizes it to int8 per token and KV
head (scale max|x| / 127 over head_dim, round half to even, clamp to [-127, 127], dequantized in float32),
then attends in float32 as usual. Both engines run the tiny float32 Llama.

- int8: widebeam stores int8 + scale and reads back float32 (chunk by chunk for a shared prefix):
  greedy tokens and every beam's sequence equal the reference's, log-probs and beam scores within 2e-3.
  Not 1e-4 as in float32: quantization is a step function, so the 1e-7 by which the fused attention
  kernel differs from transformers' upstream can move a K or V value across a rounding boundary, one
  quantization step (max|x| / 127) away (the "reference" attention backend, closer to transformers'
  arithmetic, agrees to 2e-6 on these prompts).
- bfloat16 / float16: widebeam also computes attention in the cache's dtype (q rounded to it; PyTorch's
  fused kernel accumulates in float32); the reference keeps q in float32, so log-probs agree to 2e-2
  (tiny model) and greedy tokens are equal on these prompts. Beam searches may part at a near tie
  (bfloat16 keeps 8 bits of mantissa, and this random model's logits are peaky): each of widebeam's beams
  is checked instead by the reference teacher-forced on it (its cumulative log-prob within 1e-2 a token),
  and widebeam's best scores no worse than the reference's best, less 5e-2.
"""

from __future__ import annotations

import pytest
import torch

from widebeam.llm import LLM
from widebeam.params import BeamSearchParams, SamplingParams

PROMPTS = [[(i * 31 + k) % 120 + 3 for i in range(n)] for k, n in ((1, 9), (5, 23), (11, 40))]
KV_DTYPES = ["int8", "bfloat16", "float16"]


def stored_by_definition(x: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    """x [batch, kv_heads, tokens, head_dim] as the cache gives it back."""
    if kv_cache_dtype == "int8":
        scale = (x.abs().amax(dim=-1, keepdim=True) / 127.0).clamp_min(1e-12)
        return torch.round(x / scale).clamp(-127, 127) * scale
    return x.to(getattr(torch, kv_cache_dtype)).to(x.dtype)


def definition_cache(kv_cache_dtype: str):
    from transformers import DynamicCache

    class DefinitionCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return super().update(stored_by_definition(key_states, kv_cache_dtype),
                                  stored_by_definition(value_states, kv_cache_dtype), layer_idx,
                                  *args, **kwargs)

    return DefinitionCache()


def teacher_forced_logprob(hf, prompt: list[int], token_ids: list[int], kv_cache_dtype: str) -> float:
    """The reference's log-prob of `token_ids` after `prompt`, one forward over both."""
    ids = torch.tensor([prompt + token_ids])
    with torch.no_grad():
        logits = hf(ids, past_key_values=definition_cache(kv_cache_dtype)).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    return float(logprobs.gather(1, torch.tensor(token_ids)[:, None]).sum())


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=KV_DTYPES)
def llm(request, tiny_llama_dir):
    # 4-token blocks: the beams' shared prefix spans several blocks, the prefix cache off so every
    # prompt is computed and read back from the dtype under test
    return LLM(str(tiny_llama_dir), device="cpu", kv_cache_memory="2MiB", tokens_per_block=4,
               enable_prefix_caching=False, kv_cache_dtype=request.param), request.param


def hf_generate(hf, prompt, kv_cache_dtype, **kwargs):
    with torch.no_grad():
        return hf.generate(torch.tensor([prompt]), do_sample=False, pad_token_id=0,
                           past_key_values=definition_cache(kv_cache_dtype), **kwargs)


def test_the_pools_store_the_dtype(llm):
    llm, kv_cache_dtype = llm
    assert llm.engine.cache["self"].spec.dtype == kv_cache_dtype
    runner = llm.engine.workers[0].runner
    assert runner.kv_tensors["self"].dtype == (torch.int8 if kv_cache_dtype == "int8"
                                               else getattr(torch, kv_cache_dtype))
    assert ("self" in runner.kv_scales) == (kv_cache_dtype == "int8")


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_match_the_definition(llm, hf, prompt):
    """Every generated step's logits (greedy, 8 steps: each step reads all earlier K/V back)."""
    llm, kv_cache_dtype = llm
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    expected = hf_generate(hf, prompt, kv_cache_dtype, max_new_tokens=8, eos_token_id=None,
                           output_logits=True, return_dict_in_generate=True)
    assert out.outputs[0].token_ids == expected.sequences[0, len(prompt):].tolist()
    tolerance = 2e-3 if kv_cache_dtype == "int8" else 2e-2
    for token, entry, logits in zip(out.outputs[0].token_ids, out.outputs[0].logprobs, expected.logits):
        reference = torch.log_softmax(logits[0].float(), dim=-1)[token].item()
        assert abs(entry[token].logprob - reference) <= tolerance, kv_cache_dtype


@pytest.mark.parametrize("prompt", PROMPTS)
def test_beam_search_matches_the_definition(llm, hf, prompt):
    llm, kv_cache_dtype = llm
    params = BeamSearchParams(beam_width=4, max_new_tokens=12, length_penalty=1.0, num_return_sequences=4)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    expected = hf_generate(hf, prompt, kv_cache_dtype, num_beams=4, max_new_tokens=12, length_penalty=1.0,
                           num_return_sequences=4, eos_token_id=2, output_scores=True,
                           return_dict_in_generate=True)
    assert len(out.outputs) == 4
    if kv_cache_dtype != "int8":
        # attention in bfloat16 / float16 on one side only: the two searches may part at a near tie.
        # Each of widebeam's beams is then a real hypothesis scored right: the reference, teacher-forced
        # on it, gives its cumulative log-prob; and the best is no worse than the reference's best.
        for beam in out.outputs:
            reference = teacher_forced_logprob(hf, prompt, beam.token_ids, kv_cache_dtype)
            assert abs(beam.cumulative_logprob - reference) < 1e-2 * len(beam.token_ids), kv_cache_dtype
        assert out.outputs[0].score >= float(expected.sequences_scores[0]) - 5e-2
        return
    for rank, beam in enumerate(out.outputs):
        hf_sequence = expected.sequences[rank, len(prompt):].tolist()
        assert beam.token_ids == hf_sequence[:len(beam.token_ids)], rank
        assert abs(beam.score - float(expected.sequences_scores[rank])) < 2e-3, rank
