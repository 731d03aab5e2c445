"""Int8 linear kernels (widebeam/model/linears/int8.py): one definition of the math, three kernels
that must compute it bit for bit. The reference here is the definition itself in float64 (int32
products are exact there), not either kernel."""

from __future__ import annotations

import pytest
import torch

from widebeam.model import kernels
from widebeam.model.linears.int8 import (
    Int8Linear,
    fbgemm_exact,
    float_exact_product,
    int8_few_rows,
    int_mm_product,
    quantize_int8,
    quantize_rows,
    quantize_weight,
)

needs_fbgemm = pytest.mark.skipif(not fbgemm_exact(), reason="FBGEMM's int8 linear is not exact on this CPU")

SHAPES = [(64, 48), (576, 192), (576, 1536), (1536, 576), (7, 5)]
ROW_COUNTS = [1, 2, 3, 4, 16, 17, 33, 64, 65, 129]


def definition(x: torch.Tensor, linear: torch.nn.Linear) -> torch.Tensor:
    """((q_x . q_w[j]) * c_j) * s (+ bias), the dot product in float64 (exact)."""
    weight_q, weight_scale = quantize_weight(linear.weight)
    scale = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0
    q_x = torch.round(x / scale)
    products = (q_x.double() @ weight_q.double().t()).float()
    out = products * weight_scale * scale
    return out if linear.bias is None else out + linear.bias.detach()


def inputs(rows: int, in_features: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=generator) * 3
    x[0] *= 100  # an outlier row
    if rows > 1 and in_features >= 4:
        # exact ties once scaled (max 127 -> scale 1): half to even in every kernel
        x[1, :4] = torch.tensor([127.0, 0.5, 1.5, -2.5])
        x[1, 4:] = x[1, 4:].clamp(-100, 100)
    if rows > 2 and in_features >= 3:
        # a near-tie that float32 rounds to a tie once 128 is added (205.4999924 -> 205.5)
        x[2, :3] = torch.tensor([127.0, 77.49999237060547, -40.50000762939453])
        x[2, 3:] = x[2, 3:].clamp(-100, 100)
    return x


@pytest.mark.parametrize("in_features, out_features", SHAPES)
@pytest.mark.parametrize("kernel", ["int_mm", "float_exact", pytest.param("fbgemm", marks=needs_fbgemm)])
def test_each_kernel_computes_the_definition_exactly(kernel, in_features, out_features):
    torch.manual_seed(in_features * 7 + out_features)
    linear = torch.nn.Linear(in_features, out_features)
    layer = Int8Linear(linear, kernel)
    assert layer.kernel == kernel
    for rows in ROW_COUNTS:
        x = inputs(rows, in_features, seed=rows)
        assert torch.equal(layer(x), definition(x, linear)), \
            f"{kernel} {in_features}x{out_features} at {rows} rows"


@needs_fbgemm
def test_fbgemm_is_the_default_where_exact_and_holds_one_int8_copy():
    linear = torch.nn.Linear(32, 16)
    layer = Int8Linear(linear)
    assert layer.kernel == "fbgemm"
    assert not [name for name, _ in layer.named_buffers() if name == "weight_t"]  # no second copy
    assert torch.equal(layer.weight_q, Int8Linear(linear, "int_mm").weight_q)
    assert layer.weight_q.dtype == torch.int8


def test_without_an_exact_fbgemm_the_float_exact_kernel_serves_then_the_reference(monkeypatch):
    from widebeam.model.linears import int8 as int8_linear

    monkeypatch.setattr(int8_linear, "fbgemm_exact", lambda: False)
    assert Int8Linear(torch.nn.Linear(8, 4)).kernel == "float_exact"
    assert Int8Linear(torch.nn.Linear(8, 4), "fbgemm").kernel == "float_exact"
    assert Int8Linear(torch.nn.Linear(8, 4), "int_mm").kernel == "int_mm"
    # float32 products that may round (TF32 / bfloat16 shortcuts) are not exact: the reference serves
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "medium")
    assert Int8Linear(torch.nn.Linear(8, 4)).kernel == "int_mm"
    assert Int8Linear(torch.nn.Linear(8, 4), "float_exact").kernel == "int_mm"


@pytest.mark.parametrize("rows", [1, 5, 17, 64])
@pytest.mark.parametrize("in_features", [1024, 1025, 1536, 4100])
def test_the_float_exact_product_is_the_int32_one_at_the_extremes(rows, in_features):
    """Every input at +-127 times a weight of +-127 (the largest sums the quantizer allows, past 2^24 once
    more than 1,040 inputs add up): the chunked float32 product equals `_int_mm`'s, bit for bit."""
    generator = torch.Generator().manual_seed(rows * 31 + in_features)
    q_x = (torch.randint(0, 2, (rows, in_features), generator=generator) * 254 - 127).float()
    weight_q = torch.full((24, in_features), 127, dtype=torch.int8)
    weight_q[1::2] = -127
    weight_q[2, ::3] = 5  # one channel with mixed signs
    q_x[0] = 127.0  # its sum with channel 0 is in x 127 x 127: past float32's whole numbers at 1,041 inputs
    weight_t, weight_scale = weight_q.t().contiguous(), torch.rand(24, generator=generator) + 0.5
    reference = int_mm_product(q_x, weight_t, weight_scale)
    assert torch.equal(float_exact_product(q_x, weight_t, weight_scale), reference)
    if rows <= 8:  # the few-row kernel reads the int8 weight itself: the same int32 sums
        assert kernels.int8_rows_enabled() == kernels.available()
        if kernels.available():
            assert torch.equal(int8_few_rows(q_x, weight_q, weight_scale), reference)


@pytest.mark.skipif(not kernels.available(), reason="C++ kernels not built")
def test_the_float_exact_layer_reads_few_rows_through_the_int8_kernel(monkeypatch):
    """At 1-8 rows a "float_exact" layer calls `int8_few_rows` on its own int8 weight (no float32 copy),
    past them the chunked float32 product; both give the reference's output bit for bit."""
    from widebeam.model.linears import int8 as int8_linear

    monkeypatch.setattr(int8_linear, "fbgemm_exact", lambda: False)
    linear = torch.nn.Linear(1100, 72)
    layer, reference = Int8Linear(linear), Int8Linear(linear, "int_mm")
    assert layer.kernel == "float_exact" and layer.weight_t.t().is_contiguous()
    calls = []
    real = int8_linear.int8_few_rows
    monkeypatch.setattr(int8_linear, "int8_few_rows", lambda *a: calls.append(1) or real(*a))
    for rows in (1, 3, 8, 9, 40):
        x = inputs(rows, 1100, seed=rows)
        calls.clear()
        assert torch.equal(layer(x), reference(x)), f"{rows} rows"
        assert bool(calls) == (rows <= 8)
    assert layer(torch.zeros(0, 1100)).shape == (0, 72)  # no rows: nothing for the kernel, no error


@pytest.mark.parametrize("kernel", ["int_mm", "float_exact", pytest.param("fbgemm", marks=needs_fbgemm)])
def test_a_rows_output_does_not_depend_on_its_batch(kernel):
    linear = torch.nn.Linear(96, 40)
    layer = Int8Linear(linear, kernel)
    x = inputs(40, 96, seed=3)
    batched = layer(x)
    for row in (0, 1, 2, 39):
        assert torch.equal(layer(x[row:row + 1]), batched[row:row + 1])


def test_rows_quantize_half_to_even_within_127():
    q_x, scale = quantize_rows(torch.tensor([[254.0, 1.0, 3.0, -5.0, -254.0]]))  # scale 2: 0.5, 1.5, -2.5
    assert scale.item() == 2.0
    assert q_x.tolist() == [[127.0, 0.0, 2.0, -2.0, -127.0]]


def test_the_reference_product_pads_few_rows():
    weight_q = torch.randint(-127, 128, (3, 8), dtype=torch.int8)
    q_x = torch.randint(-127, 128, (2, 8)).float()
    out = int_mm_product(q_x, weight_q.t().contiguous(), torch.ones(3))
    assert out.shape == (2, 3)
    assert torch.equal(out, (q_x.double() @ weight_q.double().t()).float())


def test_an_unknown_kernel_is_named():
    message = "int8 kernel must be one of fbgemm, float_exact, int_mm, got 'vnni'"
    with pytest.raises(ValueError, match=message):
        Int8Linear(torch.nn.Linear(4, 4), "vnni")


def test_quantize_int8_swaps_every_linear_and_needs_a_cpu():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    quantize_int8(model, torch.device("cpu"), "int_mm")
    assert [type(m).__name__ for m in model] == ["Int8Linear", "ReLU", "Int8Linear"]
    assert all(m.kernel == "int_mm" for m in model if isinstance(m, Int8Linear))
    with pytest.raises(ValueError, match="CPU"):
        quantize_int8(torch.nn.Linear(2, 2), torch.device("meta"))


@pytest.mark.parametrize("kernel", ["int_mm", "float_exact", pytest.param("fbgemm", marks=needs_fbgemm)])
@pytest.mark.parametrize("biases", [(True, True, True), (False, False, False), (True, False, True)])
def test_concatenated_layers_equal_the_parts_bit_for_bit(kernel, biases):
    torch.manual_seed(5)
    linears = [torch.nn.Linear(96, out, bias=bias) for out, bias in zip((96, 32, 32), biases)]
    parts = [Int8Linear(linear, kernel) for linear in linears]
    fused = Int8Linear.concat(parts)
    assert fused.kernel == kernel and (fused.in_features, fused.out_features) == (96, 160)
    for rows in (1, 4, 33):
        x = inputs(rows, 96, seed=rows)
        assert torch.equal(fused(x), torch.cat([part(x) for part in parts], dim=-1))


def test_concat_refuses_mixed_inputs_or_kernels():
    with pytest.raises(ValueError, match="one kernel and one input size"):
        Int8Linear.concat([Int8Linear(torch.nn.Linear(8, 4), "int_mm"),
                           Int8Linear(torch.nn.Linear(6, 4), "int_mm")])


def test_an_int8_engine_runs_fused_projections_and_holds_each_weight_once(tiny_llama_dir):
    from widebeam.llm import LLM
    from widebeam.model.families.layers import FusedProjections

    model = LLM(str(tiny_llama_dir), dtype="int8", device="cpu", kv_cache_memory="1MiB").engine.model
    layer = model.model.layers[0]
    assert (isinstance(layer.self_attn.qkv, FusedProjections)
            and isinstance(layer.mlp.gate_up, FusedProjections))
    assert not hasattr(layer.self_attn, "q_proj") and not hasattr(layer.mlp, "gate_proj")
    arch = model.arch
    assert (layer.self_attn.qkv.sizes
            == [arch.num_heads * arch.head_dim] + [arch.num_kv_heads * arch.head_dim] * 2)
    # 4 int8 layers a decoder layer (qkv, o, gate_up, down) and the lm_head
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == 4 * arch.num_layers + 1


def _torch_quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The formula `quantize_rows` runs where the C++ op does not serve (switched off here)."""
    scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0
    return torch.round(rows / scale).clamp_(-127, 127), scale


@pytest.mark.skipif(not kernels.available(), reason="C++ kernels not built")
@pytest.mark.parametrize("width", [1, 15, 16, 17, 576, 1000])
def test_the_row_quantizer_op_is_the_torch_formula_bit_for_bit(monkeypatch, width):
    """Ties (x / s exactly half-way: rounded to even), an all-zero row, a row of one value, huge and tiny
    magnitudes, a NaN and an infinity (propagated as torch propagates them), any width."""
    gen = torch.Generator().manual_seed(width)
    rows = torch.randn(9, width, generator=gen) * torch.logspace(-30, 30, 9)[:, None]
    rows[1] = 0.0
    rows[2] = 3.0
    rows[3, 0] = 127.0
    rows[3, 1:] = torch.arange(1, width) % 7 - 3.5  # halves: ties to even after / (127 / 127)
    rows[4, width // 2] = float("nan")
    rows[5, -1] = float("inf")
    calls = []
    real = torch.ops.widebeam.quantize_rows
    monkeypatch.setattr(torch.ops.widebeam, "quantize_rows", lambda r: calls.append(1) or real(r))
    q, scale = quantize_rows(rows)
    assert calls == [1]
    expected_q, expected_scale = _torch_quantize_rows(rows)
    assert torch.equal(scale.isnan(), expected_scale.isnan()) and torch.equal(q.isnan(), expected_q.isnan())
    assert torch.equal(torch.nan_to_num(scale), torch.nan_to_num(expected_scale))
    assert torch.equal(torch.nan_to_num(q), torch.nan_to_num(expected_q))
    monkeypatch.setattr(kernels, "QUANTIZE_ROWS_ENABLED", False)
    q_off, _ = quantize_rows(rows)
    assert calls == [1] and torch.equal(torch.nan_to_num(q_off), torch.nan_to_num(q))


@pytest.mark.skipif(not kernels.available(), reason="C++ kernels not built")
def test_an_int8_engine_generates_bit_equal_with_the_row_quantizer_on_and_off(monkeypatch, tiny_llama_dir):
    from widebeam.llm import LLM
    from widebeam.params import BeamSearchParams

    llm = LLM(str(tiny_llama_dir), dtype="int8", device="cpu", kv_cache_memory="2MiB")
    prompts = [{"prompt_token_ids": [(i * 13 + k) % 100 + 3 for i in range(n)]} for k, n in ((1, 7), (3, 20))]
    outputs = {}
    for on in (True, False):
        monkeypatch.setattr(kernels, "QUANTIZE_ROWS_ENABLED", on)
        outputs[on] = llm.generate(prompts, BeamSearchParams(beam_width=4, max_new_tokens=8), use_tqdm=False)
    for a, b in zip(outputs[True], outputs[False], strict=True):
        assert [(o.token_ids, o.score) for o in a.outputs] == [(o.token_ids, o.score) for o in b.outputs]
