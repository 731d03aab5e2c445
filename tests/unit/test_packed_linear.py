"""Float32 linears with the weight packed once for oneDNN (`linear_backend="onednn"`,
widebeam/model/linears/packed.py): the same results as `F.linear` within float32 rounding, at the
row counts decode (1, 4), odd batches (17) and prefill chunks (64) give, with and without bias, on
odd shapes; a tiny model's greedy tokens and beam sequences equal the `F.linear` path's; no oneDNN
or no CPU: the model keeps `nn.Linear`, no error."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from widebeam.model.linears.packed import PACKED_ROWS, PackedLinear, onednn_available, pack_linears

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 4, 17, 64])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("in_features,out_features", [(64, 48), (37, 101), (576, 192), (7, 1)])
def test_packed_linear_equals_f_linear(rows, bias, in_features, out_features):
    torch.manual_seed(rows * 1000 + in_features + out_features)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    if bias:
        with torch.no_grad():
            linear.bias.mul_(10)  # a bias that matters next to the product
    packed = PackedLinear(linear)
    x = torch.randn(rows, in_features)
    with torch.inference_mode():
        expected, got = F.linear(x, linear.weight, linear.bias), packed(x)
    assert got.shape == expected.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 2, 4, 17, 256, 257, 512])
def test_auto_runs_f_linear_outside_its_row_counts_and_the_packed_weight_inside(rows, monkeypatch):
    torch.manual_seed(rows)
    linear = torch.nn.Linear(40, 24)
    packed = PackedLinear(linear, keep_weight=True, packed_rows=PACKED_ROWS)
    calls = []
    pointwise = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(1) or pointwise(*a))
    x = torch.randn(rows, 40)
    with torch.inference_mode():
        got, expected = packed(x), F.linear(x, linear.weight, linear.bias)
    assert bool(calls) == (rows in PACKED_ROWS)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    if rows not in PACKED_ROWS:
        assert torch.equal(got, expected)  # the very same kernel
    with pytest.raises(ValueError, match="keep_weight"):
        PackedLinear(linear, packed_rows=PACKED_ROWS)


@needs_onednn
def test_packed_linear_takes_leading_dims_and_strided_input():
    torch.manual_seed(0)
    linear = torch.nn.Linear(24, 40)
    packed = PackedLinear(linear)
    x = torch.randn(3, 5, 48)[..., ::2]  # [3, 5, 24], not contiguous
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    assert packed(torch.randn(0, 24)).shape == (0, 40)


@needs_onednn
def test_pack_linears_swaps_every_float32_linear_lm_head_included():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                torch.nn.Sequential(torch.nn.Linear(16, 4)))
    pack_linears(model, torch.device("cpu"), "onednn")
    assert isinstance(model[0], PackedLinear) and isinstance(model[2][0], PackedLinear)
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())


def test_torch_backend_no_onednn_and_other_devices_keep_f_linear(monkeypatch):
    def linears(backend, device="cpu", dtype=torch.float32):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8)).to(dtype)
        return [type(m) for m in pack_linears(model, torch.device(device), backend).modules()][1:]

    assert linears("torch") == [torch.nn.Linear]
    assert linears("auto", device="meta") == [torch.nn.Linear]
    assert linears("onednn", dtype=torch.bfloat16) == [torch.nn.Linear]
    assert linears("onednn", device="meta") == [torch.nn.Linear]
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert linears("onednn") == [torch.nn.Linear]
    with pytest.raises(ValueError, match="linear_backend"):
        linears("mkl")


def test_a_build_whose_kernels_fail_keeps_f_linear(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no oneDNN kernel")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", broken, raising=False)
    model = pack_linears(torch.nn.Sequential(torch.nn.Linear(8, 8)), torch.device("cpu"), "onednn")
    assert isinstance(model[0], torch.nn.Linear)


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    from widebeam.llm import LLM

    def llm(backend):
        return LLM(str(tiny_llama_dir), device="cpu", linear_backend=backend, kv_cache_memory="2MiB",
                   enable_prefix_caching=False)

    return llm("torch"), llm("onednn"), llm("auto")


@needs_onednn
def test_engine_model_holds_packed_linears_only_under_onednn_and_auto(engines):
    plain, packed, auto = engines
    assert isinstance(plain.engine.model.lm_head, torch.nn.Linear)
    for llm in (packed, auto):
        assert isinstance(llm.engine.model.lm_head, PackedLinear)
        assert not any(isinstance(m, torch.nn.Linear) for m in llm.engine.model.modules())
    assert all(m.packed_rows is None for m in packed.engine.model.modules() if isinstance(m, PackedLinear))
    assert all(m.packed_rows == PACKED_ROWS
               for m in auto.engine.model.modules() if isinstance(m, PackedLinear))


PROMPTS = [[(i * 31 + k) % 120 + 3 for i in range(n)] for k, n in ((1, 9), (5, 23), (11, 40))]


@needs_onednn
def test_greedy_tokens_equal_the_f_linear_path(engines):
    from widebeam.params import SamplingParams

    params = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in PROMPTS]
    plain, *others = (llm.generate(inputs, params, use_tqdm=False) for llm in engines)
    for packed in others:
        assert [o.outputs[0].token_ids for o in packed] == [o.outputs[0].token_ids for o in plain]


@needs_onednn
@pytest.mark.parametrize("width", [1, 4, 8])
def test_beam_sequences_equal_the_f_linear_path(engines, width):
    from widebeam.params import BeamSearchParams

    params = BeamSearchParams(beam_width=width, max_new_tokens=12, length_penalty=1.0)
    inputs = [{"prompt_token_ids": p} for p in PROMPTS]
    plain, *others = (llm.generate(inputs, params, use_tqdm=False) for llm in engines)
    for a, b in (pair for packed in others for pair in zip(plain, packed)):
        assert len(b.outputs) == len(a.outputs) >= 1
        assert [s.token_ids for s in b.outputs] == [s.token_ids for s in a.outputs]
        for x, y in zip(a.outputs, b.outputs):
            assert y.score == pytest.approx(x.score, rel=1e-4, abs=1e-4)


@needs_onednn
def test_a_tied_weight_stays_reachable_and_an_untied_one_is_freed():
    embed, head, proj = torch.nn.Embedding(10, 8), torch.nn.Linear(8, 10, bias=False), torch.nn.Linear(8, 8)
    head.weight = embed.weight
    model = pack_linears(torch.nn.ModuleDict({"embed": embed, "head": head, "proj": proj}),
                         torch.device("cpu"), "onednn")
    assert model["head"].weight is embed.weight
    assert [name for name, _ in model["proj"].named_parameters()] == []  # the float copy is freed
    assert torch.equal(model["proj"].weight, proj.weight.detach())  # unpacked on read
    auto = pack_linears(torch.nn.ModuleDict({"proj": torch.nn.Linear(8, 8)}), torch.device("cpu"), "auto")
    assert [name for name, _ in auto["proj"].named_parameters()] == ["weight"]  # F.linear's own
