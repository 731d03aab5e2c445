"""`kv_cache_dtype` against transformers whose cache stores K/V the same way and whose attention computes
in the dtype widebeam reads them back as, both written out here from their definitions with plain torch
ops (no widebeam code):

- `DefinitionCache` rounds every K and V it is given (after RoPE, as both engines store them) to
  bfloat16 / float16, or quantizes it to int8 per token, KV head and group of 32 values (llama.cpp's
  q8_0: scale max|x| / 127 over the group, rounded to float16; value round_half_even(x / scale)
  clamped to [-127, 127]; dequantized in float32), K rotated first by the normalized 64 x 64
  Walsh-Hadamard matrix (Sylvester's construction) and rotated back after (H @ H = I); V not rotated.
- The "compute_dtype_sdpa" attention casts q, K and V to the compute dtype, runs transformers' own SDPA
  attention there and casts the output back: the cache's dtype for bfloat16 / float16, and for int8 what
  widebeam reads it as (bfloat16 on CUDA or a CPU with AMX tiles, float32 elsewhere:
  `QuantizedKV.read_dtype`, asked of the engine). The int8 path is also checked read as
  float32 (`int8_read_dtype` patched). For int8, q and K are multiplied by H (in float32) before the
  cast: attention in the domain K is stored in (q @ H . k @ H = q . k), so that both engines round the
  same products to bfloat16 (rounding q and k instead moves a log-prob by up to 0.04 on this model).

Both engines run a tiny float32 Llama with head_dim 64 (two scale groups a head). Greedy tokens must be
equal. With float32 attention (int8 read as float32): log-probs and every beam's score within 2e-3 and
every beam's sequence equal; not 1e-4 as for float32 KV: quantization is a step function, so the 1e-7
by which the fused kernels differ from transformers' upstream can move a value across a rounding
boundary, one step away. With 16-bit attention: log-probs within 2e-2 (two kernels accumulating
rounded products in different orders); beam searches may part at a near tie, so each of widebeam's
beams is teacher-forced through the reference instead (its cumulative log-prob within 1e-2 a token)
and widebeam's best may be no worse than the reference's, less 2e-2.
"""

from __future__ import annotations

import pytest
import torch

import widebeam.model.runner as runner_module
from widebeam.llm import LLM
from widebeam.params import BeamSearchParams, SamplingParams

PROMPTS = [[(i * 31 + k) % 120 + 3 for i in range(n)] for k, n in ((1, 9), (5, 23), (11, 40))]
KV_DTYPES = ["int8", "bfloat16", "float16"]


def walsh_hadamard(n: int) -> torch.Tensor:
    """The normalized n x n Walsh-Hadamard matrix (n a power of two), float32: H_2n = [[H, H], [H, -H]]."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)))
    return h / n ** 0.5


def stored_by_definition(x: torch.Tensor, kv_cache_dtype: str, rotate: bool = False) -> torch.Tensor:
    """x [batch, kv_heads, tokens, head_dim] as the cache gives it back; `rotate` (K of int8): stored as
    x @ H, read back times H."""
    if kv_cache_dtype == "int8":
        h = walsh_hadamard(x.shape[-1]) if rotate else None
        rotated = x if h is None else x @ h
        groups = rotated.reshape(*x.shape[:-1], -1, 32)  # head_dim 64: two groups of 32
        scale = (groups.abs().amax(dim=-1, keepdim=True) / 127.0).to(torch.float16).float()
        back = (torch.round(groups / scale).clamp(-127, 127) * scale).reshape(x.shape)
        return back if h is None else back @ h
    return x.to(getattr(torch, kv_cache_dtype)).to(x.dtype)


# what "compute_dtype_sdpa" computes in, and the rotation of q and K's domain (int8), set per test
COMPUTE_DTYPE = {"dtype": torch.float32, "rotation": None}


def compute_dtype_sdpa(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dtype, rotation = COMPUTE_DTYPE["dtype"], COMPUTE_DTYPE["rotation"]
    if rotation is not None:
        query, key = query @ rotation, key @ rotation
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask.to(dtype)
    out, weights = sdpa_attention_forward(module, query.to(dtype), key.to(dtype), value.to(dtype),
                                          attention_mask, **kwargs)
    return out.to(query.dtype), weights


def definition_cache(kv_cache_dtype: str):
    from transformers import DynamicCache

    class DefinitionCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return super().update(stored_by_definition(key_states, kv_cache_dtype, rotate=True),
                                  stored_by_definition(value_states, kv_cache_dtype), layer_idx,
                                  *args, **kwargs)

    return DefinitionCache()


def teacher_forced_logprob(hf, prompt: list[int], token_ids: list[int], kv_cache_dtype: str) -> float:
    """The reference's log-prob of `token_ids` after `prompt`, one forward over both."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + token_ids]),
                    past_key_values=definition_cache(kv_cache_dtype)).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    return float(logprobs.gather(1, torch.tensor(token_ids)[:, None]).sum())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tiny_models import save_tiny_model

    path = tmp_path_factory.mktemp("tiny-llama-d64")
    save_tiny_model(path, "llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    return path


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AttentionInterface, AutoModelForCausalLM

    AttentionInterface.register("compute_dtype_sdpa", compute_dtype_sdpa)
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                attn_implementation="compute_dtype_sdpa").eval()


@pytest.fixture(scope="module", params=[*KV_DTYPES, "int8 read as float32"])
def llm(request, model_dir):
    # 4-token blocks: the beams' shared prefix spans several blocks, the prefix cache off so every
    # prompt is computed and read back from the dtype under test
    kv_cache_dtype = request.param.split()[0]
    with pytest.MonkeyPatch.context() as patch:
        if request.param == "int8 read as float32":
            patch.setattr(runner_module, "int8_read_dtype", lambda model_dtype, device: torch.float32)
        llm = LLM(str(model_dir), device="cpu", kv_cache_memory="2MiB", tokens_per_block=4,
                  enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
    k_cache = llm.engine.workers[0].runner.kv_caches[0][0]
    COMPUTE_DTYPE["dtype"] = k_cache.dtype  # the cache's own dtype, or what an int8 one is read as
    COMPUTE_DTYPE["rotation"] = walsh_hadamard(64) if kv_cache_dtype == "int8" else None
    return llm, kv_cache_dtype


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
    tolerance = 2e-3 if COMPUTE_DTYPE["dtype"] == torch.float32 else 2e-2
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
    if COMPUTE_DTYPE["dtype"] == torch.float32:
        for rank, beam in enumerate(out.outputs):
            hf_sequence = expected.sequences[rank, len(prompt):].tolist()
            assert beam.token_ids == hf_sequence[:len(beam.token_ids)], (kv_cache_dtype, rank)
            assert abs(beam.score - float(expected.sequences_scores[rank])) < 2e-3, (kv_cache_dtype, rank)
        return
    # 16-bit attention: two searches whose per-token log-probs differ by rounding part at near ties, so
    # their hypotheses may differ. Each of widebeam's is then checked as a hypothesis of the reference:
    # teacher-forced on it, the reference gives its cumulative log-prob (within 1e-2 a token); and
    # widebeam's best scores no worse than the reference's best, less 2e-2.
    for beam in out.outputs:
        reference = teacher_forced_logprob(hf, prompt, beam.token_ids, kv_cache_dtype)
        assert abs(beam.cumulative_logprob - reference) < 1e-2 * len(beam.token_ids), kv_cache_dtype
    assert out.outputs[0].score >= float(expected.sequences_scores[0]) - 2e-2, kv_cache_dtype
