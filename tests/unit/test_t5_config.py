"""T5 / mT5 configs through the family table: the torch-free parse (head_dim is d_kv, decoder layers
hold the pools), the feed-forward and head-scaling rules transformers applies, the decoder start
token, `widebeam plan` on a T5 config.json (self and cross pools, cross charged once at any beam
width), and the runtime model's contract."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from widebeam.errors import ConfigError, UnsupportedModelError
from widebeam.model.contract import EncoderDecoderModel
from widebeam.model.families.t5_config import T5_ACTIVATIONS, parse_feed_forward_proj
from widebeam.model.families.table import generation_settings, parse_config
from widebeam.model.loading.build import build_model

# t5-small's config.json (as published), and mt5-small's (6 heads of 64 beside d_model 512).
T5_SMALL = {"model_type": "t5", "d_model": 512, "d_kv": 64, "d_ff": 2048, "num_layers": 6, "num_heads": 8,
            "vocab_size": 32128, "relative_attention_num_buckets": 32, "n_positions": 512,
            "feed_forward_proj": "relu", "decoder_start_token_id": 0, "eos_token_id": 1, "pad_token_id": 0,
            "is_encoder_decoder": True, "layer_norm_epsilon": 1e-6}
MT5_SMALL = {"model_type": "mt5", "d_model": 512, "d_kv": 64, "d_ff": 1024, "num_layers": 8,
             "num_decoder_layers": 8, "num_heads": 6, "vocab_size": 250112, "feed_forward_proj": "gated-gelu",
             "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
             "tie_word_embeddings": False, "decoder_start_token_id": 0, "eos_token_id": 1, "pad_token_id": 0}


def test_t5_small_parses_to_the_decoders_pools():
    parsed = parse_config(T5_SMALL)
    arch, settings = parsed.arch, parsed.settings
    assert parsed.family.name == "t5"
    assert (arch.num_layers, arch.num_encoder_layers, arch.num_heads, arch.head_dim) == (6, 6, 8, 64)
    assert [(s.name, s.kind, s.num_layers) for s in arch.kv_pool_specs("float32")] == [
        ("self", "full", 6), ("cross", "cross", 6)]
    assert (settings.activation, settings.gated, settings.scale_decoder_outputs) == ("relu", False, True)
    assert (settings.relative_attention_num_buckets, settings.relative_attention_max_distance) == (32, 128)
    assert arch.max_position_embeddings == 512 and settings.decoder_start_token_id == 0


def test_mt5_head_dim_is_d_kv_not_d_model_over_heads():
    arch, settings = parse_config(MT5_SMALL).arch, parse_config(MT5_SMALL).settings
    assert (arch.head_dim, arch.num_heads, arch.hidden_size) == (64, 6, 512)
    assert arch.kv_pool_specs("float32")[0].bytes_per_token == 8 * 2 * 6 * 64 * 4
    assert (settings.activation, settings.gated, settings.scale_decoder_outputs) == ("gelu_new", True, False)
    assert not arch.tie_word_embeddings


@pytest.mark.parametrize("overrides, scaled, tied", [
    ({}, True, True),  # T5 v1.0
    ({"tie_word_embeddings": False, "feed_forward_proj": "gated-gelu"}, False, False),  # v1.1 / flan-T5
    ({"tie_word_embeddings": True, "scale_decoder_outputs": False}, False, True),  # saved by transformers 5
    ({"model_type": "mt5", "tie_word_embeddings": True}, False, True),  # MT5 never scales
])
def test_output_scaling_follows_transformers(overrides, scaled, tied):
    parsed = parse_config({**T5_SMALL, **overrides})
    assert parsed.settings.scale_decoder_outputs == scaled and parsed.arch.tie_word_embeddings == tied


@pytest.mark.parametrize("value, expected", [
    ("relu", ("relu", False)), ("gated-gelu", ("gelu_new", True)), ("gated-silu", ("silu", True)),
    ("gelu_new", ("gelu_new", False))])
def test_feed_forward_proj(value, expected):
    assert parse_feed_forward_proj(value) == expected


def test_bad_feed_forward_proj_is_named():
    with pytest.raises(ConfigError, match="feed_forward_proj 'ungated-gelu'"):
        parse_config({**T5_SMALL, "feed_forward_proj": "ungated-gelu"})
    with pytest.raises(UnsupportedModelError, match="feed_forward_proj 'gated-mish'.*'mish'"):
        parse_config({**T5_SMALL, "feed_forward_proj": "gated-mish"})
    with pytest.raises(ConfigError, match="d_kv"):
        parse_config({k: v for k, v in T5_SMALL.items() if k != "d_kv"})


def test_activation_names_match_the_implementation():
    from widebeam.model.families import t5

    assert set(T5_ACTIVATIONS) == set(t5.T5_ACTIVATIONS)


def test_generation_settings_start_from_pad():
    settings = generation_settings({k: v for k, v in T5_SMALL.items() if k != "decoder_start_token_id"}, {})
    assert settings.decoder_start_token_id == 0 and settings.eos_token_ids == {1}


def test_model_satisfies_the_encoder_decoder_contract():
    tiny = {**T5_SMALL, "d_model": 16, "d_kv": 4, "num_heads": 2, "d_ff": 8, "vocab_size": 32,
            "num_layers": 3, "num_decoder_layers": 2, "feed_forward_proj": "gated-gelu"}
    with torch.device("meta"):
        model = build_model(tiny)
    assert isinstance(model, EncoderDecoderModel)
    assert model.layer_pool_names == ["self", "self", "cross", "cross"]
    assert len(model.encoder.block) == 3 and len(model.decoder.block) == 2
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    assert {"shared.weight", "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
            "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
            "decoder.block.1.layer.1.EncDecAttention.q.weight",
            "decoder.block.1.layer.2.DenseReluDense.wi_1.weight",
            "encoder.final_layer_norm.weight", "lm_head.weight"} <= names
    assert "decoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight" not in names


def test_plan_shows_self_and_cross_pools_without_torch(tmp_path):
    """`widebeam plan --model config.json`: the cross pool is ceil(E/T) blocks at W=1 and W=16 alike."""
    (tmp_path / "config.json").write_text(json.dumps(T5_SMALL))
    plans = {}
    for width in (1, 16):
        out = subprocess.run([sys.executable, "-X", "importtime", "-m", "widebeam", "plan", "--model",
                              str(tmp_path / "config.json"), "--json", "--beam-width", str(width),
                              "--encoder-len", "100", "--tokens-per-block", "16"],
                             check=True, capture_output=True, text=True, timeout=120)
        assert "| torch\n" not in out.stderr and " torch\n" not in out.stderr  # the plan stays torch-free
        plans[width] = {pool["name"]: pool for pool in json.loads(out.stdout)["pools"]}
    for pools in plans.values():
        assert set(pools) == {"self", "cross"}
        assert pools["cross"]["required_blocks"] == math.ceil(100 / 16)
        assert pools["self"]["bytes_per_token"] == pools["cross"]["bytes_per_token"] == 6 * 2 * 8 * 64 * 2
    assert plans[16]["self"]["required_blocks"] > plans[1]["self"]["required_blocks"]


TINY_T5 = {"model_type": "t5", "d_model": 64, "d_kv": 8, "d_ff": 96, "num_layers": 2,
           "num_decoder_layers": 3, "num_heads": 6, "vocab_size": 128, "relative_attention_num_buckets": 32,
           "feed_forward_proj": "relu", "decoder_start_token_id": 0, "eos_token_id": 1, "pad_token_id": 0}


@pytest.mark.parametrize("overrides", [
    {},  # T5 v1.0: ReLU, tied head
    {"feed_forward_proj": "gated-gelu", "tie_word_embeddings": False},  # v1.1 / flan-T5
    {"model_type": "mt5", "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False,
     "relative_attention_num_buckets": 16},
], ids=["t5", "t5-v1.1", "mt5"])
def test_plan_weight_count_is_the_built_models(overrides):
    """Heads x d_kv wide projections without biases, RMS norms, gated or not, one relative position
    table per stack, each stack's final norm, tied or untied head: the plan's weight bytes are the
    model's."""
    config = {**TINY_T5, **overrides}
    with torch.device("meta"):
        model = build_model(config)
    assert parse_config(config).arch.num_params == sum(p.numel() for p in model.parameters())
