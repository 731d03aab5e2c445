"""int8 weights (`dtype="int8"`): every linear layer, lm_head included, an `Int8Linear` (int8
weights per output channel, activations quantized per row on each call), KV in float32. The
reference is transformers' model whose linear layers are `DefinitionInt8Linear`: the int8 scheme
written out here from its definition with plain torch ops (no widebeam code): per-output-channel
weight scale max|w_j| / 127, per-row activation scale max|x| / 127, round half to even, clamp to
[-127, 127], an int32 matmul, then `(acc * c_j) * s` in float32. The engine runs its default kernel
(FBGEMM where exact): `Int8Linear` equals the definition bit for bit, and greedy tokens and beam
search sequences and scores equal the reference model's. Per-row activation scales keep a request's
outputs independent of what it is batched with."""

from __future__ import annotations

import pytest
import torch
from beam_checks import assert_beams_match, hf_beam_search

from widebeam.llm import LLM
from widebeam.model.linears.int8 import quantize_int8
from widebeam.params import BeamSearchParams, SamplingParams

PROMPTS = [[(i * 31 + k) % 120 + 3 for i in range(n)] for k, n in ((1, 9), (5, 23), (11, 40))]


class DefinitionInt8Linear(torch.nn.Module):
    """The int8 linear layer from its definition, independent of widebeam's quantize functions."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        # per output channel j: c_j = max|w_j| / 127, q_w = round_half_even(w / c_j) in [-127, 127]
        self.weight_scale = weight.abs().amax(dim=1) / 127.0
        self.weight_q = torch.round(weight / self.weight_scale[:, None]).clamp(-127, 127).to(torch.int32)
        self.bias = None if linear.bias is None else linear.bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()
        amax = rows.abs().amax(dim=1, keepdim=True)
        scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))  # a zero row: q = 0, out 0
        quantized = torch.round(rows / scale).clamp(-127, 127).to(torch.int32)
        accumulated = quantized @ self.weight_q.t()  # int32, exact: |sum| <= 127 * 127 * in < 2**31
        assert accumulated.dtype == torch.int32
        out = (accumulated.float() * self.weight_scale) * scale
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], -1).to(x.dtype)


def quantize_by_definition(model: torch.nn.Module) -> torch.nn.Module:
    """Every `nn.Linear` of `model` (lm_head included) replaced by a `DefinitionInt8Linear`, in place."""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(module, child_name, DefinitionInt8Linear(child))
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    return model


@pytest.fixture(scope="module")
def models(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    llm = LLM(str(tiny_llama_dir), dtype="int8", device="cpu", kv_cache_memory="2MiB",
              enable_prefix_caching=False)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    return llm, quantize_by_definition(hf)


@pytest.mark.parametrize("kernel", ["fbgemm", "int_mm"])
def test_int8_linear_equals_the_definition_bit_for_bit(kernel):
    """Random rows with outliers, a zero row, and a row whose scale is exactly 1 holding halves
    (2.5, -3.5, 0.5: round half to even gives 2, -4, 0), through both kernels and a bias."""
    from widebeam.model.linears.int8 import Int8Linear

    torch.manual_seed(1)
    linear = torch.nn.Linear(96, 40)
    with torch.no_grad():
        linear.weight[5] *= 30  # an outlier output channel
        linear.weight[7, :3] = torch.tensor([1.0, 0.5, -0.5])  # weight halves: scale 1/127, w / c = 63.5
        linear.weight[7, 3:] = 0.0
    x = torch.randn(2, 6, 96)
    x[0, 2] *= 80  # an outlier row
    x[1, 0] = 0.0
    x[1, 1] = 0.0
    x[1, 1, :4] = torch.tensor([127.0, 2.5, -3.5, 0.5])
    expected = DefinitionInt8Linear(linear)(x)
    assert torch.equal(Int8Linear(linear, kernel)(x), expected)


def test_the_linear_layers_hold_int8_weights_and_kv_stays_float32(models):
    from widebeam.model.linears.int8 import Int8Linear, fbgemm_exact

    llm, _ = models
    model = llm.engine.model
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert layers and all(m.weight_q.dtype == torch.int8 for m in layers)
    assert isinstance(model.lm_head, Int8Linear)
    # FBGEMM where exact, else the float32 products in exact chunks (the reference, int_mm, is neither)
    assert {m.kernel for m in layers} == {"fbgemm" if fbgemm_exact() else "float_exact"}
    assert llm.engine.cache["self"].spec.dtype == "float32"


def test_int8_linear_is_close_to_float32_with_outliers():
    """Per-row and per-channel scales: an outlier row or channel does not flatten the others."""
    from widebeam.model.linears.int8 import Int8Linear

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
