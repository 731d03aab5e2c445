"""Float32 linears split at 1-4 rows (`linear_backend="split"`, the default; widebeam/model/linears/
split.py), by either split product (the C++ `few_rows_linear` where built, else batched blocks of output
rows): equal to `F.linear` within float32 rounding where the split runs, the very same kernel elsewhere;
the weight shared, never copied; a tiny model's greedy tokens and beams equal the `F.linear` engine's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from widebeam.defaults import DEFAULT_LINEAR_BACKEND
from widebeam.model import kernels
from widebeam.model.linears import split as split_linear
from widebeam.model.linears.packed import pack_linears
from widebeam.model.linears.split import (
    SPLIT_BLOCKS,
    SPLIT_ROWS,
    SplitLinear,
    probe_split_rows,
    split_linears,
)


@pytest.fixture(params=["kernel", "blocks"])
def product(request, monkeypatch):
    """Which split product runs: the C++ kernel (built by `make setup` wherever a compiler is) or the
    batched blocks; yields the op a split call goes through, to spy on."""
    if request.param == "kernel" and not kernels.available():
        pytest.skip("C++ kernels not built (tests/unit/test_few_rows_kernel.py fails where a compiler is)")
    monkeypatch.setattr(kernels, "LINEAR_ENABLED", request.param == "kernel")
    return request.param


def spy_split_products(monkeypatch) -> list[str]:
    calls = []
    bmm, few_rows = torch.bmm, torch.ops.widebeam.few_rows_linear if kernels.available() else None
    monkeypatch.setattr(torch, "bmm", lambda *a: calls.append("blocks") or bmm(*a))
    if few_rows is not None:
        monkeypatch.setattr(torch.ops.widebeam, "few_rows_linear",
                            lambda *a: calls.append("kernel") or few_rows(*a))
    return calls


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 17, 64])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("in_features, out_features", [(64, 48), (576, 192), (37, 104), (37, 101), (7, 1),
                                                       (1536, 76)])
def test_split_linear_equals_f_linear(rows, bias, in_features, out_features, product, monkeypatch):
    torch.manual_seed(rows * 1000 + in_features + out_features)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    if bias:
        with torch.no_grad():
            linear.bias.mul_(10)  # a bias that matters next to the product
    layer = SplitLinear(linear)
    calls = spy_split_products(monkeypatch)
    x = torch.randn(rows, in_features)
    with torch.inference_mode():
        expected, got = F.linear(x, linear.weight, linear.bias), layer(x)
    # the kernel takes any shape; the blocks need whole blocks of output rows
    split = rows in SPLIT_ROWS and (product == "kernel" or out_features % SPLIT_BLOCKS == 0)
    assert calls == ([product] if split else [])
    assert got.shape == expected.shape and got.dtype == torch.float32 and got.is_contiguous()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    if not split:
        assert torch.equal(got, expected)  # the very same kernel


def test_split_linear_takes_leading_dims_and_strided_input(product):
    torch.manual_seed(0)
    linear = torch.nn.Linear(24, 40)
    layer = SplitLinear(linear)
    x = torch.randn(2, 1, 48)[..., ::2]  # [2, 1, 24], not contiguous
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)
        assert layer(x).shape == (2, 1, 40)


def test_the_weight_is_shared_and_a_tied_one_stays_tied():
    embed, head = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16, bias=False)
    head.weight = embed.weight
    model = pack_linears(torch.nn.ModuleDict({"embed": embed, "head": head}), torch.device("cpu"), "split")
    assert isinstance(model["head"], SplitLinear)
    assert model["head"].weight is embed.weight  # no copy: the embedding's own tensor


def test_split_is_the_default_and_stays_off_other_devices_and_dtypes(monkeypatch):
    assert DEFAULT_LINEAR_BACKEND == "split"
    monkeypatch.setattr(kernels, "LINEAR_ENABLED", False)  # 16-bit linears split only through the kernel
    bf16 = pack_linears(torch.nn.Sequential(torch.nn.Linear(8, 8).bfloat16()), torch.device("cpu"), "split")
    assert type(bf16[0]) is torch.nn.Linear
    with torch.device("meta"):
        meta = torch.nn.Sequential(torch.nn.Linear(8, 8))
    assert type(pack_linears(meta, torch.device("meta"), "split")[0]) is torch.nn.Linear


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 8, 9])
def test_16_bit_linears_split_through_the_kernel(dtype, rows, monkeypatch):
    """Where the kernel is built a bfloat16/float16 model's linears are `SplitLinear`s that run it at
    the probed row counts: the output in the model's dtype, within one rounding of `F.linear`'s."""
    if not kernels.available():
        pytest.skip("C++ kernels not built (tests/unit/test_few_rows_kernel.py fails where a compiler is)")
    monkeypatch.setattr(kernels, "LINEAR_ENABLED", True)
    monkeypatch.setattr(split_linear, "probe_split_rows", lambda layers: tuple(SPLIT_ROWS))
    torch.manual_seed(rows)
    model = pack_linears(torch.nn.Sequential(torch.nn.Linear(96, 80).to(dtype)), torch.device("cpu"), "split")
    assert isinstance(model[0], SplitLinear) and model[0].split_rows == tuple(SPLIT_ROWS)
    calls = spy_split_products(monkeypatch)
    x = torch.randn(rows, 96).to(dtype)
    with torch.inference_mode():
        got, expected = model(x), F.linear(x, model[0].weight, model[0].bias)
    assert got.dtype == dtype and calls == (["kernel"] if rows in SPLIT_ROWS else [])
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)


PROMPTS = [[(i * 31 + k) % 120 + 3 for i in range(n)] for k, n in ((1, 9), (5, 23), (11, 40))]


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    """The F.linear engine and the split engine (its product: the kernel where built, as by default)."""
    from widebeam.llm import LLM

    with pytest.MonkeyPatch.context() as patch:
        # the split product at every row count it takes, whatever the start-up probe finds on this CPU
        patch.setattr(split_linear, "probe_split_rows", lambda layers: tuple(SPLIT_ROWS))
        return [LLM(str(tiny_llama_dir), device="cpu", linear_backend=backend, kv_cache_memory="2MiB",
                    enable_prefix_caching=False) for backend in ("torch", "split")]


def test_the_default_engine_holds_split_linears(tiny_llama_dir, engines):
    from widebeam.llm import LLM

    default = LLM(str(tiny_llama_dir), device="cpu", kv_cache_memory="1MiB").engine.model
    assert isinstance(default.lm_head, SplitLinear)
    assert not any(type(m) is torch.nn.Linear for m in default.modules())
    assert type(engines[0].engine.model.lm_head) is torch.nn.Linear


def test_greedy_tokens_equal_the_f_linear_engines(engines):
    from widebeam.params import SamplingParams

    params = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in PROMPTS]
    plain, split = (llm.generate(inputs, params, use_tqdm=False) for llm in engines)
    assert len(plain) == len(split) == len(PROMPTS)
    assert all(len(o.outputs) == 1 and len(o.outputs[0].token_ids) == 16 for o in plain + split)
    assert [o.outputs[0].token_ids for o in split] == [o.outputs[0].token_ids for o in plain]


@pytest.mark.parametrize("width", [1, 2, 4])
def test_beam_sequences_equal_the_f_linear_engines(engines, width):
    from widebeam.params import BeamSearchParams

    params = BeamSearchParams(beam_width=width, max_new_tokens=12, length_penalty=1.0)
    inputs = [{"prompt_token_ids": p} for p in PROMPTS]
    plain, split = (llm.generate(inputs, params, use_tqdm=False) for llm in engines)
    assert len(plain) == len(split) == len(PROMPTS)
    for a, b in zip(plain, split, strict=True):
        assert len(a.outputs) == len(b.outputs) == width  # every beam returned, none dropped
        assert [s.token_ids for s in b.outputs] == [s.token_ids for s in a.outputs]
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert y.score == pytest.approx(x.score, rel=1e-4, abs=1e-4)


@pytest.mark.parametrize("rows", [1, 4, 9])
@pytest.mark.parametrize("biases", [(True, True, True), (True, False, True), (False, False, False)])
def test_concatenated_split_linears_equal_their_parts(rows, biases, product):
    """q/k/v (or gate/up) stacked as one layer: each part of the output is the part's own product."""
    torch.manual_seed(rows)
    parts = [torch.nn.Linear(24, out, bias=bias) for out, bias in zip((32, 8, 8), biases)]
    fused = SplitLinear.concat([SplitLinear(p) for p in parts])
    assert fused.out_features == 48 and (fused.bias is None) == (not any(biases))
    x = torch.randn(rows, 24)
    with torch.inference_mode():
        got = fused(x).split([32, 8, 8], dim=-1)
        for part, out in zip(parts, got):
            torch.testing.assert_close(out, F.linear(x, part.weight, part.bias), rtol=1e-5, atol=1e-5)


def test_float32_decoders_fuse_their_projections_and_bfloat16_ones_do_not(tiny_llama_dir):
    """`split_linears` stacks q/k/v and gate/up of every layer (float32); a bfloat16 model keeps its
    separate `nn.Linear`s (the split backend is float32 only)."""
    from widebeam.model.loading.build import load_model
    from widebeam.model.loading.sources import resolve_model

    source = resolve_model(str(tiny_llama_dir))
    model = load_model(source, "float32", torch.device("cpu"))
    for layer in model.model.layers:
        assert isinstance(layer.self_attn.qkv.linear, SplitLinear)
        assert isinstance(layer.mlp.gate_up.linear, SplitLinear)
        assert not hasattr(layer.self_attn, "q_proj") and not hasattr(layer.mlp, "gate_proj")
    bf16 = load_model(source, "bfloat16", torch.device("cpu"))
    assert bf16.model.layers[0].self_attn.qkv is None and bf16.model.layers[0].mlp.gate_up is None


def test_the_probe_answers_row_counts_once_per_shape():
    layers = [SplitLinear(torch.nn.Linear(64, 128)) for _ in range(3)]
    found = probe_split_rows(layers)
    buckets = [(1, 2), (3, 4), (5, 6, 7, 8)]  # each decided by one timing (at 1, 4 and 8 rows)
    assert all(set(bucket) <= set(found) or not set(bucket) & set(found) for bucket in buckets)
    assert found == tuple(sorted(found)) and set(found) <= set(SPLIT_ROWS)
    assert probe_split_rows(layers) is found  # kept: every engine of the process runs the same kernels


@pytest.mark.parametrize("split_rows", [(), (1, 2), tuple(SPLIT_ROWS)])
def test_split_linears_run_the_product_the_probe_chose(split_rows, product, monkeypatch):
    """Where the probe found the split product slower, `F.linear` runs at every row count."""
    monkeypatch.setattr(split_linear, "probe_split_rows", lambda layers: split_rows)
    model = split_linears(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64)))
    assert all(layer.split_rows == split_rows for layer in model)
    calls = spy_split_products(monkeypatch)
    for rows in SPLIT_ROWS:
        calls.clear()
        x = torch.randn(rows, 64)
        with torch.inference_mode():  # as the engine runs (the kernel serves no gradient)
            got = model(x)
        torch.testing.assert_close(got, F.linear(F.linear(x, model[0].weight, model[0].bias),
                                                 model[1].weight, model[1].bias))
        assert calls == ([product] * 2 if rows in split_rows else []), rows


def test_a_gradient_wanted_takes_the_blocks(monkeypatch):
    """The kernel has no backward: with a gradient wanted the layer runs the batched blocks (torch ops),
    and the gradient is F.linear's."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 128)
    layer = SplitLinear(linear)
    calls = spy_split_products(monkeypatch)
    monkeypatch.setattr(kernels, "LINEAR_ENABLED", True)
    x = torch.randn(2, 64)
    layer(x).square().sum().backward()
    assert calls == ["blocks"]
    got = linear.weight.grad.clone()
    linear.weight.grad = None
    F.linear(x, linear.weight, linear.bias).square().sum().backward()
    torch.testing.assert_close(got, linear.weight.grad, rtol=1e-5, atol=1e-5)


def test_the_probe_streams_a_bounded_sample(monkeypatch):
    """A large model's probe reads its first `_PROBE_BYTES` of weights, not all of them."""
    monkeypatch.setattr(split_linear, "_PROBE_BYTES", 3 * 128 * 64 * 4)  # three of these layers
    layers = [SplitLinear(torch.nn.Linear(64, 128)) for _ in range(10)]
    assert split_linear._probe_sample(layers) == layers[:3]
    assert split_linear._probe_sample(layers[:2]) == layers[:2]


needs_onednn = pytest.mark.skipif(not split_linear.onednn_plain_available(),
                                  reason="this torch build has no oneDNN inner product")


def test_onednn_is_found_wherever_torch_has_it():
    """The oneDNN tests below skip without it: a build that has it must not look as if it had not."""
    if torch.backends.mkldnn.is_available():
        assert split_linear.onednn_plain_available()


def spy_inner_product(monkeypatch) -> list[int]:
    calls = []
    inner_product = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                        lambda *a: calls.append(1) or inner_product(*a))
    return calls


@needs_onednn
@pytest.mark.parametrize("rows", [9, 64, 300])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("in_features, out_features", [(576, 192), (37, 101)])
def test_past_the_split_rows_onednn_equals_f_linear(monkeypatch, rows, bias, in_features, out_features):
    """Rows past `SPLIT_ROWS` through oneDNN's inner product where the probe chose it (a spy proves it
    ran), within float32 rounding of `F.linear`; a 3-D input keeps its leading shape."""
    torch.manual_seed(rows + in_features)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    layer = SplitLinear(linear)
    layer.onednn_many_rows = True
    calls = spy_inner_product(monkeypatch)
    x = torch.randn(rows, 1, in_features)
    with torch.inference_mode():
        got, expected = layer(x), F.linear(x, linear.weight, linear.bias)
    assert calls == [1] and got.shape == (rows, 1, out_features)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@needs_onednn
def test_onednn_serves_no_gradient_and_no_empty_input(monkeypatch):
    layer = SplitLinear(torch.nn.Linear(16, 8))
    layer.onednn_many_rows = True
    calls = spy_inner_product(monkeypatch)
    layer(torch.randn(20, 16)).sum().backward()  # the weight wants a gradient: F.linear
    assert layer.weight.grad is not None
    with torch.inference_mode():
        assert layer(torch.randn(0, 16)).shape == (0, 8)
    assert calls == []


@needs_onednn
@pytest.mark.parametrize("pays", [True, False])
def test_the_probe_decides_oneDNN_past_the_split_rows(monkeypatch, pays):
    """`split_linears` gives every float32 layer oneDNN past 8 rows exactly when the probe finds it faster
    (timed here with the probe's passes replaced: oneDNN's pass 1 s or 3 s against F.linear's 2 s)."""
    monkeypatch.setattr(split_linear, "_PROBED", {})
    monkeypatch.setattr(split_linear, "_interleaved_best_s",
                        lambda candidate, reference, repeats=5: (candidate(), reference(),
                                                                 (1.0 if pays else 3.0, 2.0))[-1])
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    split_linears(model)
    assert [layer.onednn_many_rows for layer in model] == [pays, pays]


@needs_onednn
def test_a_model_class_may_keep_f_linear_past_the_split_rows(monkeypatch):
    """`onednn_many_rows = False` on the model (T5: large activations, a parity bound MKL's sums meet)."""
    monkeypatch.setattr(split_linear, "probe_many_rows", lambda layers: True)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32))
    model.onednn_many_rows = False
    split_linears(model)
    assert not model[0].onednn_many_rows


@needs_onednn
def test_a_model_class_may_keep_f_linear_for_some_of_its_linears(monkeypatch):
    """`keeps_f_linear(name)` on the model: the named linears keep F.linear, the rest take oneDNN where the
    probe finds it faster (T5's encoder and cross K/V: tests/parity/test_t5_parity.py)."""
    monkeypatch.setattr(split_linear, "probe_many_rows", lambda layers: True)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    model.keeps_f_linear = lambda name: name == "0"
    split_linears(model)
    assert [layer.onednn_many_rows for layer in model] == [False, True]
