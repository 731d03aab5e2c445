"""int8 weights (`dtype="int8"`): every linear layer, lm_head included, an `Int8Linear` (int8
weights per output channel, activations quantized per row on each call), KV in float32. The
reference is transformers' model quantized the same way on the reference kernel
(`quantize_int8(..., kernel="int_mm")`, `torch._int_mm`) while the engine runs its default (FBGEMM
where exact): greedy tokens and beam search sequences and scores equal. Per-row activation scales
keep a request's outputs independent of what it is batched with."""

from __future__ import annotations

import pytest
import torch
from beam_checks import assert_beams_match, hf_beam_search

from widebeam.llm import LLM
from widebeam.model.int8_linear import quantize_int8
from widebeam.params import BeamSearchParams, SamplingParams

PROMPTS = [[(i * 31 + k) % 120 + 3 for i in range(n)] for k, n in ((1, 9), (5, 23), (11, 40))]


@pytest.fixture(scope="module")
def models(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    llm = LLM(str(tiny_llama_dir), dtype="int8", device="cpu", kv_cache_memory="2MiB",
              enable_prefix_caching=False)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    return llm, quantize_int8(hf, torch.device("cpu"), kernel="int_mm")


def test_the_linear_layers_hold_int8_weights_and_kv_stays_float32(models):
    from widebeam.model.int8_linear import Int8Linear, fbgemm_exact

    llm, _ = models
    model = llm.engine.model
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert layers and all(m.weight_q.dtype == torch.int8 for m in layers)
    assert isinstance(model.lm_head, Int8Linear)
    assert {m.kernel for m in layers} == {"fbgemm" if fbgemm_exact() else "int_mm"}  # the reference is int_mm
    assert llm.engine.cache["self"].spec.dtype == "float32"


def test_int8_linear_is_close_to_float32_with_outliers():
    """Per-row and per-channel scales: an outlier row or channel does not flatten the others."""
    from widebeam.model.int8_linear import Int8Linear

    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    with torch.no_grad():
        linear.weight[3] *= 50  # an outlier output channel
    x = torch.randn(5, 64)
    x[2] *= 100  # an outlier row
    exact, approx = linear(x), Int8Linear(linear)(x)
    for row in range(5):
        assert (approx[row] - exact[row]).norm() / exact[row].norm() < 0.03


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_equals_transformers_int8(models, prompt):
    llm, hf = models
    (out,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_new_tokens=16, temperature=0,
                                                                         ignore_eos=True), use_tqdm=False)
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(prompt):].tolist()
    assert out.outputs[0].token_ids == expected


@pytest.mark.parametrize("prompt", PROMPTS)
def test_beam_search_equals_transformers_int8(models, prompt):
    llm, hf = models
    params = BeamSearchParams(beam_width=4, max_new_tokens=12, length_penalty=1.0)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    expected = hf_beam_search(hf, prompt, params, eos=2, pad=0)
    assert_beams_match(out, expected, len(prompt), pad=0, eos=2, beam_width=4, label="int8")


def test_int8_needs_a_cpu():
    with pytest.raises(ValueError, match="CPU"):
        quantize_int8(torch.nn.Linear(2, 2), torch.device("meta"))
