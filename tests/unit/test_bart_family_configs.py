"""The BART-family rows of the family table (m2m_100, bart, mbart): torch-free parses that agree with
transformers' config classes, `widebeam plan` showing a self and a cross pool for each (cross charged
once per request at any beam width), the plan's weight count equal to the built model's, the
decoder start token, and errors that name the bad field."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from tiny_bart_family import BART_BASE_SHAPE, NLLB_600M_SHAPE, TINY_CONFIGS

from widebeam.errors import UnsupportedModelError
from widebeam.model.families.table import generation_settings, parse_config
from widebeam.model.loading.arch import load_arch
from widebeam.model.loading.build import build_model

SHAPES = {**TINY_CONFIGS, "nllb-600m-1-layer": NLLB_600M_SHAPE, "bart-base-1-layer": BART_BASE_SHAPE}


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_plan_cli_shows_self_and_cross_pools(name, tmp_path):
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(TINY_CONFIGS[name]))
    for width in (1, 8):
        proc = subprocess.run([sys.executable, "-m", "widebeam", "plan", "--model", str(config_path),
                               "--memory", "1GiB", "--beam-width", str(width), "--prompt-len", "100",
                               "--json"],
                              capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode == 0, proc.stderr
        pools = {p["name"]: p for p in json.loads(proc.stdout)["pools"]}
        assert set(pools) == {"self", "cross"}
        assert pools["cross"]["kind"] == "cross"
        assert pools["cross"]["required_blocks"] == math.ceil(100 / 16)  # once, whatever the width


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_plan_weight_count_is_the_built_models(name):
    """Learned position tables, embedding and final norms, and the final_logits_bias (absent in
    M2M100) all counted."""
    config = SHAPES[name]
    with torch.device("meta"):
        model = build_model(config)
    assert parse_config(config).arch.num_params == sum(p.numel() for p in model.parameters())


def test_real_shapes_have_the_known_sizes():
    nllb = load_arch_of({**NLLB_600M_SHAPE, "encoder_layers": 12, "decoder_layers": 12})
    assert 610_000_000 < nllb.num_params < 620_000_000  # nllb-200-distilled-600M: 615M parameters
    bart = load_arch_of({**BART_BASE_SHAPE, "encoder_layers": 6, "decoder_layers": 6})
    assert 139_000_000 < bart.num_params < 141_000_000  # bart-base: 140M parameters
    # decoder layers x K and V x d_model x float32 bytes, in the self pool and in the cross pool
    self_spec, cross_spec = nllb.kv_pool_specs("float32")
    assert self_spec.bytes_per_token == cross_spec.bytes_per_token == 12 * 2 * 1024 * 4


def load_arch_of(config: dict):
    return parse_config(config).arch


@pytest.mark.parametrize("model_type, hf_name", [("m2m_100", "M2M100Config"), ("bart", "BartConfig"),
                                                 ("mbart", "MBartConfig")])
def test_defaults_are_transformers(model_type, hf_name):
    """A config holding only the shape: the switches transformers' config class fills in."""
    import transformers

    shape = {k: TINY_CONFIGS["bart"][k] for k in ("vocab_size", "d_model", "encoder_layers", "decoder_layers",
                                                  "encoder_attention_heads", "decoder_attention_heads",
                                                  "encoder_ffn_dim", "decoder_ffn_dim")}
    parsed = parse_config({"model_type": model_type, **shape})
    hf = getattr(transformers, hf_name)(**shape)
    settings = parsed.settings
    assert settings.activation == hf.activation_function
    assert settings.embed_scale == (math.sqrt(hf.d_model) if hf.scale_embedding else 1.0)
    assert parsed.arch.max_position_embeddings == hf.max_position_embeddings
    assert parsed.arch.tie_word_embeddings == hf.tie_word_embeddings
    start = hf.decoder_start_token_id if hf.decoder_start_token_id is not None else hf.bos_token_id
    assert settings.decoder_start_token_id == start
    if model_type == "m2m_100":
        assert settings.position_offset == hf.pad_token_id + 1


def test_generation_settings_read_the_decoder_start():
    assert generation_settings(TINY_CONFIGS["m2m100"], {}).decoder_start_token_id == 2
    mbart = {k: v for k, v in TINY_CONFIGS["mbart"].items() if k != "decoder_start_token_id"}
    assert generation_settings({**mbart, "bos_token_id": 0}, {}).decoder_start_token_id == 0
    from_generation_config = generation_settings(TINY_CONFIGS["bart"], {"decoder_start_token_id": 7})
    assert from_generation_config.decoder_start_token_id == 7


def test_an_unsupported_activation_is_named(tmp_path):
    config = {**TINY_CONFIGS["bart"], "activation_function": "quick_gelu"}
    with pytest.raises(UnsupportedModelError, match="activation_function 'quick_gelu'"):
        parse_config(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quick_gelu"):
        load_arch(str(tmp_path))


def test_activation_names_match_the_implementation():
    from widebeam.model.families import seq2seq as bart_family
    from widebeam.model.families import seq2seq_config as configs_bart

    assert set(configs_bart.SEQ2SEQ_ACTIVATIONS) == set(bart_family.ACTIVATIONS)
