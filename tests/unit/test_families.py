"""The model-family table: one parse per family, shared by `widebeam plan` (load_arch) and the engine
(build_model), agreeing with transformers' config classes; generation settings; the model contract."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from tiny_bart_family import TINY_CONFIGS as SEQ2SEQ_CONFIGS

from widebeam.errors import ConfigError, UnsupportedModelError
from widebeam.model.contract import CausalModel, EncoderDecoderModel
from widebeam.model.families.arch import BUILTIN_CONFIGS
from widebeam.model.families.checkpoint import to_model_names
from widebeam.model.families.table import FAMILIES, PHI3_LAYOUT, generation_settings, parse_config
from widebeam.model.loading.arch import load_arch
from widebeam.model.loading.build import build_model

SMALL = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 6,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}
# Hub configs as they are stored: the Gemma 3 ones hold only what differs from Gemma3TextConfig.
GEMMA3_SPARSE_TEXT = {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                      "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                      "sliding_window": 1024}
VARIANTS = {
    **{name: dict(config) for name, config in BUILTIN_CONFIGS.items()},
    # (a) multimodal Gemma 3 whose text_config stores four fields; (b) gemma3_text without layer_types
    "gemma3-multimodal-sparse": {"model_type": "gemma3", "text_config": dict(GEMMA3_SPARSE_TEXT)},
    "gemma3-text-no-layer-types": dict(GEMMA3_SPARSE_TEXT),
    "gemma3-text-pattern-3": {**SMALL, "model_type": "gemma3_text", "sliding_window": 8,
                              "sliding_window_pattern": 3},
    "qwen2-window-off-by-default": {**SMALL, "model_type": "qwen2", "sliding_window": 16},
    "qwen2-window-from-layer-2": {**SMALL, "model_type": "qwen2", "sliding_window": 16,
                                  "use_sliding_window": True, "max_window_layers": 2},
    "qwen3-layer-types": {**SMALL, "model_type": "qwen3", "sliding_window": 8, "use_sliding_window": True,
                          "layer_types": ["full_attention", "sliding_attention"] * 3},
    "qwen3-default-head-dim": {**SMALL, "model_type": "qwen3"},
    "mistral-default-window": {**SMALL, "model_type": "mistral"},
    "mistral-no-window": {**SMALL, "model_type": "mistral", "sliding_window": None},
    "phi3-no-window": {**SMALL, "model_type": "phi3", "sliding_window": None},
    "phi3-partial-rotary": {**SMALL, "model_type": "phi3", "sliding_window": 8, "partial_rotary_factor": 0.5},
    "llama-ignores-window": {**SMALL, "model_type": "llama", "sliding_window": 8},
    "t5-small": {"model_type": "t5", "d_model": 512, "d_kv": 64, "d_ff": 2048, "num_layers": 6,
                 "num_heads": 8, "vocab_size": 32128, "feed_forward_proj": "relu"},
    **{f"seq2seq-{name}": dict(config) for name, config in SEQ2SEQ_CONFIGS.items()},
}


def pool_facts(specs):
    return [(s.name, s.kind, s.num_layers, s.bytes_per_token, getattr(s, "window_tokens", None))
            for s in specs]


def test_every_family_has_a_variant_here():
    families = {parse_config(config).family.name for config in VARIANTS.values()}
    assert families == {family.name for family in FAMILIES}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_plan_and_engine_agree_on_pools(variant, tmp_path):
    """The plan's path (a config.json on disk through load_arch) and the engine's (build_model) give
    the same pools: names, kinds, layers, bytes per token, windows; and the model's layers name them."""
    config = VARIANTS[variant]
    (tmp_path / "config.json").write_text(json.dumps(config))
    planned = load_arch(str(tmp_path))
    with torch.device("meta"):
        model = build_model(config)
    for dtype in ("bfloat16", "float32"):
        assert pool_facts(planned.kv_pool_specs(dtype)) == pool_facts(model.arch.kv_pool_specs(dtype))
    assert model.layer_pool_names == planned.layer_pool_names() == model.arch.layer_pool_names()
    assert planned.layer_windows == model.arch.layer_windows
    assert planned.num_params == model.arch.num_params
    assert planned.max_position_embeddings == model.arch.max_position_embeddings
    assert isinstance(model, CausalModel)


def hf_config(config: dict):
    from transformers import AutoConfig, Gemma3Config

    kwargs = {k: v for k, v in config.items() if k != "model_type"}
    if config["model_type"] == "gemma3":
        top = Gemma3Config(**kwargs)
        return top.text_config, top
    hf = AutoConfig.for_model(config["model_type"], **kwargs)
    return hf, hf


ENCODER_DECODER_VARIANTS = ("opus", "t5", "seq2seq-")


@pytest.mark.parametrize("variant", sorted(v for v in VARIANTS if not v.startswith(ENCODER_DECODER_VARIANTS)))
def test_decoder_shapes_and_windows_match_transformers(variant):
    """Defaults filled as transformers' config classes fill them, and each layer's window as its
    modeling code applies it (Llama: never; Mistral and Phi-3: every layer; Qwen and Gemma: by layer type)."""
    config = VARIANTS[variant]
    arch = parse_config(config).arch
    hf, top = hf_config(config)
    n = hf.num_hidden_layers
    if config["model_type"] == "llama":
        windows = (None,) * n
    elif config["model_type"] in ("mistral", "phi3"):
        windows = (hf.sliding_window,) * n
    else:
        windows = tuple(hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types)
    assert arch.layer_windows == windows
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert (arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.vocab_size) == (
        n, hf.num_attention_heads, hf.num_key_value_heads, head_dim, hf.vocab_size)
    assert arch.max_position_embeddings == hf.max_position_embeddings
    assert arch.tie_word_embeddings == top.tie_word_embeddings
    assert parse_config(config).settings.rms_norm_eps == hf.rms_norm_eps


def test_multimodal_gemma3_with_a_sparse_text_config_plans(tmp_path):
    """Was: ConfigError 'num_attention_heads' in load_arch, while the engine filled the defaults."""
    from transformers import Gemma3Config

    (tmp_path / "config.json").write_text(json.dumps(VARIANTS["gemma3-multimodal-sparse"]))
    arch = load_arch(str(tmp_path))
    text = Gemma3Config(text_config=dict(GEMMA3_SPARSE_TEXT)).text_config
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (
        text.num_attention_heads, text.num_key_value_heads, text.head_dim)
    assert arch.layer_windows == tuple(1024 if t == "sliding_attention" else None for t in text.layer_types)


def test_gemma3_text_without_layer_types_is_five_sliding_to_one_full(tmp_path):
    """Was: every layer sliding in the plan, 5 : 1 in the engine."""
    (tmp_path / "config.json").write_text(json.dumps(GEMMA3_SPARSE_TEXT))
    arch = load_arch(str(tmp_path))
    assert arch.layer_windows == (((1024,) * 5 + (None,)) * 6)[:34]
    assert ([(s.name, s.num_layers) for s in arch.kv_pool_specs("bfloat16")]
            == [("self", 5), ("sliding_1024", 29)])


TINY_EVERY_FAMILY = {
    "llama-biased": {**SMALL, "model_type": "llama", "attention_bias": True, "mlp_bias": True},
    "qwen2": {**SMALL, "model_type": "qwen2", "tie_word_embeddings": True},
    "mistral": {**SMALL, "model_type": "mistral"},
    "gemma3": {**SMALL, "model_type": "gemma3_text", "head_dim": 16, "sliding_window": 8},
    "qwen3-biased": {**SMALL, "model_type": "qwen3", "head_dim": 32, "attention_bias": True},
    "phi3": {**SMALL, "model_type": "phi3"},
    "marian": {"model_type": "marian", "d_model": 64, "encoder_layers": 2, "decoder_layers": 3,
               "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 96,
               "decoder_ffn_dim": 80, "vocab_size": 128, "max_position_embeddings": 128, "pad_token_id": 127},
}


@pytest.mark.parametrize("name", sorted(TINY_EVERY_FAMILY))
def test_plan_weight_count_is_the_built_models(name):
    config = TINY_EVERY_FAMILY[name]
    with torch.device("meta"):
        model = build_model(config)
    assert parse_config(config).arch.num_params == sum(p.numel() for p in model.parameters())


def test_activation_names_match_the_implementations():
    from widebeam.model.families import decoder_config, layers, seq2seq, seq2seq_config

    assert set(decoder_config.SUPPORTED_ACTIVATIONS) == set(layers.ACTIVATIONS)
    assert set(seq2seq_config.SEQ2SEQ_ACTIVATIONS) == set(seq2seq.ACTIVATIONS)


@pytest.mark.parametrize("config, match", [
    ({**SMALL, "model_type": "gpt2"},
     r"'gpt2'.*llama, qwen2, mistral, gemma3_text, gemma3, marian, qwen3, phi3"),
    ({**SMALL, "model_type": "phi3", "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8,
                                                      "long_factor": [1.0] * 8}},
     r"'longrope'.*supported: default$"),
    ({**SMALL, "model_type": "qwen3", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     r"'yarn'.*supported: default, linear, llama3"),
    ({**SMALL, "model_type": "phi3", "partial_rotary_factor": 0.2}, r"partial_rotary_factor 0.2 gives 3"),
    ({**SMALL, "model_type": "qwen2", "layer_types": ["chunked_attention"] * 6}, r"chunked_attention"),
])
def test_unsupported_features_are_named_in_both_paths(config, match, tmp_path):
    with pytest.raises(UnsupportedModelError, match=match):
        build_model(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=match):  # the plan's CLI turns ConfigError into exit code 2
        load_arch(str(tmp_path))


def test_missing_shape_field_is_a_config_error():
    with pytest.raises(ConfigError, match="lacks.*num_hidden_layers"):
        parse_config({"model_type": "qwen3"})


def test_family_table_and_plan_do_not_import_torch():
    code = ("import sys; from widebeam.model.loading.arch import load_arch; "
            "from widebeam.model.families import table, decoder_config, seq2seq_config, t5_config;"
            "[load_arch(m) for m in ('gemma3-270m', 'qwen3-0.6b', 'phi-3-mini-4k', 'opus-mt-en-de')];"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_phi3_packed_tensors_split_into_the_decoders_parameters():
    arch = parse_config({**SMALL, "model_type": "phi3", "num_key_value_heads": 1}).arch  # q 64 rows, k/v 16
    qkv = torch.arange(96 * 64, dtype=torch.float32).view(96, 64)
    gate_up = torch.randn(2 * 96, 64)
    out = to_model_names({"model.layers.3.self_attn.qkv_proj.weight": qkv,
                          "model.layers.3.mlp.gate_up_proj.weight": gate_up,
                          "model.norm.weight": torch.ones(64)}, PHI3_LAYOUT, arch)
    assert sorted(out) == sorted(["model.layers.3.self_attn.q_proj.weight",
                                  "model.layers.3.self_attn.k_proj.weight",
                                  "model.layers.3.self_attn.v_proj.weight",
                                  "model.layers.3.mlp.gate_proj.weight",
                                  "model.layers.3.mlp.up_proj.weight", "model.norm.weight"])
    assert torch.equal(out["model.layers.3.self_attn.q_proj.weight"], qkv[:64])
    assert torch.equal(out["model.layers.3.self_attn.k_proj.weight"], qkv[64:80])
    assert torch.equal(out["model.layers.3.self_attn.v_proj.weight"], qkv[80:])
    assert torch.equal(out["model.layers.3.mlp.gate_proj.weight"], gate_up[:96])
    assert torch.equal(out["model.layers.3.mlp.up_proj.weight"], gate_up[96:])
    with pytest.raises(UnsupportedModelError, match="rows"):
        to_model_names({"model.layers.0.self_attn.qkv_proj.weight": qkv[:90]}, PHI3_LAYOUT, arch)


def test_marian_model_satisfies_the_encoder_decoder_contract():
    with torch.device("meta"):
        model = build_model(TINY_EVERY_FAMILY["marian"])
    assert isinstance(model, EncoderDecoderModel)
    assert model.decoder_start_token_id == 127  # no decoder_start_token_id in the config: the pad token


MARIAN = TINY_EVERY_FAMILY["marian"]
GENERATION_CASES = [
    # (config, generation_config, expected (start, suppress, forced_eos, eos))
    ({**SMALL, "model_type": "llama", "eos_token_id": [2, 7]}, {"eos_token_id": 9, "bad_words_ids": [[5]]},
     (None, (), None, {2, 7, 9})),
    ({**SMALL, "model_type": "qwen3", "eos_token_id": 3}, {}, (None, (), None, {3})),
    ({**MARIAN, "eos_token_id": 0, "forced_eos_token_id": 0}, {}, (127, (), 0, {0})),
    # a saved generation config is the whole story: config.json's forced EOS does not leak in
    ({**MARIAN, "eos_token_id": 0, "forced_eos_token_id": 0, "decoder_start_token_id": 5},
     {"eos_token_id": 1, "bad_words_ids": [[127], [3, 4], [9]]}, (5, (9, 127), None, {0, 1})),
    ({**MARIAN, "eos_token_id": 0}, {"decoder_start_token_id": 6, "forced_eos_token_id": 0}, (6, (), 0, {0})),
]


@pytest.mark.parametrize("config, generation_config, expected", GENERATION_CASES)
def test_generation_settings(config, generation_config, expected, tmp_path):
    settings = generation_settings(config, generation_config)
    start, suppress, forced_eos, eos = expected
    assert (settings.decoder_start_token_id, settings.suppress_token_ids, settings.forced_eos_token_id,
            settings.eos_token_ids) == (start, suppress, forced_eos, frozenset(eos))
    from widebeam.engine import LLMEngine

    if not hasattr(LLMEngine, "_encoder_decoder_settings"):
        return  # the engine reads generation_settings itself now
    # Until then: the engine's own methods, on the same files, give the same answers.
    from widebeam.model.loading.sources import ModelSource

    (tmp_path / "config.json").write_text(json.dumps(config))
    with torch.device("meta"):
        model = build_model(config)
    engine = SimpleNamespace(arch=model.arch, model=model, tokenizer=None,
                             source=ModelSource(name="m", path=tmp_path, has_tokenizer=False),
                             _generation_config=lambda: generation_config)
    assert LLMEngine._encoder_decoder_settings(engine) == (start, suppress, forced_eos)
    assert frozenset(LLMEngine._eos_token_ids(engine)) == frozenset(eos)
