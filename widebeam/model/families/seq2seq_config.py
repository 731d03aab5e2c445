"""Config parses of the BART-shaped encoder-decoders beside Marian: M2M100 / NLLB-200, BART, mBART.

Torch-free, like decoder_config.py: `widebeam plan` reads these configs through the same functions as
the engine. Optional fields take the defaults of the installed transformers' config classes (checked on
transformers 5.24: M2M100Config, BartConfig, MBartConfig); shape fields stay required. The settings
say which switches of widebeam.model.families.seq2seq the family turns on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from widebeam.errors import UnsupportedModelError
from widebeam.model.families.arch import ModelArch

# families/seq2seq.py: ACTIVATIONS' names (tests/unit/test_bart_family_configs.py holds them equal).
SEQ2SEQ_ACTIVATIONS = ("swish", "silu", "gelu", "relu", "gelu_new")
# How a stack embeds position p: Marian's sinusoids (sin | cos halves, float64), fairseq's (M2M100:
# frequencies over dim/2 - 1, float32, a zero row at padding_idx), or a learned table in the checkpoint.
MARIAN_SINUSOIDAL, M2M100_SINUSOIDAL, LEARNED = "marian_sinusoidal", "m2m100_sinusoidal", "learned"
POSITION_KINDS = (MARIAN_SINUSOIDAL, M2M100_SINUSOIDAL, LEARNED)
# BartLearnedPositionalEmbedding / MBartLearnedPositionalEmbedding: position p reads row p + 2.
LEARNED_POSITION_OFFSET = 2


@dataclass(frozen=True)
class Seq2SeqSettings:
    """widebeam.model.families.seq2seq.Seq2SeqConfig's fields beside the architecture."""

    encoder_heads: int
    activation: str
    embed_scale: float  # token embeddings times this (sqrt(d_model) with scale_embedding, else 1)
    decoder_start_token_id: int  # families.generation_settings reads it
    normalize_before: bool  # pre-norm layers and a final layer_norm after each stack
    layernorm_embedding: bool  # a LayerNorm over token + position embeddings
    positions: str  # one of POSITION_KINDS
    position_offset: int  # the table row of position 0
    final_logits_bias: bool  # the checkpoint carries `final_logits_bias` added to the logits


def _activation(config: dict, default: str) -> str:
    name = str(config.get("activation_function") or default)
    if name not in SEQ2SEQ_ACTIVATIONS:
        raise UnsupportedModelError(f"activation_function {name!r} is not supported; supported: "
                                    f"{sorted(SEQ2SEQ_ACTIVATIONS)}")
    return name


def _seq2seq_arch(config: dict, name: str, model_type: str, *, learned_positions: bool,
                  norms_per_stack: int, final_logits_bias: bool) -> ModelArch:
    """The decoder's layers, heads and vocabulary hold the KV and make the logits; every decoder layer
    also keeps the encoder output's K/V in the cross pool."""
    hidden_size = int(config["d_model"])
    heads = int(config["decoder_attention_heads"])
    num_layers = int(config["decoder_layers"])
    max_positions = int(config.get("max_position_embeddings") or 1024)
    if hidden_size % heads or hidden_size % int(config["encoder_attention_heads"]):
        raise UnsupportedModelError(f"d_model {hidden_size} is not a multiple of the attention heads")
    return ModelArch(
        name=name,
        model_type=model_type,
        num_layers=num_layers,
        hidden_size=hidden_size,
        intermediate_size=int(config["decoder_ffn_dim"]),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden_size // heads,
        vocab_size=int(config["vocab_size"]),
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
        layer_windows=(None,) * num_layers,
        num_encoder_layers=int(config["encoder_layers"]),
        encoder_intermediate_size=int(config["encoder_ffn_dim"]),
        learned_position_rows=max_positions + LEARNED_POSITION_OFFSET if learned_positions else 0,
        norms_per_stack=norms_per_stack,
        final_logits_bias=final_logits_bias,
    )


def _start_token(config: dict, default: int | None) -> int:
    """transformers' generate starts the decoder at decoder_start_token_id, else at bos_token_id."""
    start = config.get("decoder_start_token_id", default)
    if start is None:
        start = config.get("bos_token_id", 0)
    return int(start)


def _embed_scale(config: dict, default: bool) -> float:
    scale = config.get("scale_embedding")
    return math.sqrt(int(config["d_model"])) if (default if scale is None else scale) else 1.0


def parse_m2m100(config: dict, name: str) -> tuple[ModelArch, Seq2SeqSettings]:
    """M2M100 and NLLB-200 (model_type "m2m_100"): pre-norm layers with a final layer_norm in encoder
    and decoder, fairseq's sinusoidal positions starting at padding_idx + 1, embeddings scaled by
    sqrt(d_model), relu, no final_logits_bias, the decoder starting at EOS (2)."""
    arch = _seq2seq_arch(config, name, "m2m_100", learned_positions=False, norms_per_stack=1,
                         final_logits_bias=False)
    pad = config.get("pad_token_id")
    pad = 1 if pad is None else int(pad)
    return arch, Seq2SeqSettings(
        encoder_heads=int(config["encoder_attention_heads"]),
        activation=_activation(config, "relu"),
        embed_scale=_embed_scale(config, True),
        decoder_start_token_id=_start_token(config, 2),
        normalize_before=True,
        layernorm_embedding=False,
        positions=M2M100_SINUSOIDAL,
        position_offset=pad + 1,
        final_logits_bias=False,
    )


def parse_bart(config: dict, name: str) -> tuple[ModelArch, Seq2SeqSettings]:
    """BART: post-norm layers, learned positions with offset 2, layernorm_embedding, gelu,
    final_logits_bias, unscaled embeddings unless scale_embedding."""
    arch = _seq2seq_arch(config, name, "bart", learned_positions=True, norms_per_stack=1,
                         final_logits_bias=True)
    return arch, _learned_settings(config, normalize_before=False)


def parse_mbart(config: dict, name: str) -> tuple[ModelArch, Seq2SeqSettings]:
    """mBART (-cc25, -50): BART with pre-norm layers and a final layer_norm in encoder and decoder
    (layernorm_embedding kept); its checkpoints set scale_embedding. MBartConfig has no decoder start,
    so, as in transformers' generate, the decoder starts at bos_token_id unless the config names one."""
    arch = _seq2seq_arch(config, name, "mbart", learned_positions=True, norms_per_stack=2,
                         final_logits_bias=True)
    return arch, _learned_settings(config, normalize_before=True, start_default=None)


def _learned_settings(config: dict, normalize_before: bool, start_default: int | None = 2) -> Seq2SeqSettings:
    return Seq2SeqSettings(
        encoder_heads=int(config["encoder_attention_heads"]),
        activation=_activation(config, "gelu"),
        embed_scale=_embed_scale(config, False),
        decoder_start_token_id=_start_token(config, start_default),
        normalize_before=normalize_before,
        layernorm_embedding=True,
        positions=LEARNED,
        position_offset=LEARNED_POSITION_OFFSET,
        final_logits_bias=True,
    )


@dataclass(frozen=True)
class MarianSettings:
    """Marian's fields of `Seq2SeqConfig` (families/seq2seq.py) beside the architecture."""

    encoder_heads: int
    activation: str
    embed_scale: float
    decoder_start_token_id: int


def parse_marian(config: dict, name: str) -> tuple[ModelArch, MarianSettings]:
    """Marian (opus-mt): the decoder's layers, heads and vocabulary hold the KV and make the logits;
    every decoder layer also keeps the encoder output's K/V in the cross pool."""
    if not config.get("share_encoder_decoder_embeddings", True):
        raise UnsupportedModelError("Marian with separate encoder and decoder embeddings is not supported")
    if not config.get("static_position_embeddings", True) or config.get("normalize_before", False):
        raise UnsupportedModelError("only the opus-mt Marian layout (static positions, post-norm) is "
                                    "supported")
    activation = str(config.get("activation_function", "gelu"))
    if activation not in SEQ2SEQ_ACTIVATIONS:
        raise UnsupportedModelError(f"activation {activation!r} is not supported; supported: "
                                    f"{sorted(SEQ2SEQ_ACTIVATIONS)}")
    hidden_size = int(config["d_model"])
    heads = int(config["decoder_attention_heads"])
    num_layers = int(config["decoder_layers"])
    arch = ModelArch(
        name=name,
        model_type="marian",
        num_layers=num_layers,
        hidden_size=hidden_size,
        intermediate_size=int(config["decoder_ffn_dim"]),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden_size // heads,
        vocab_size=int(config.get("decoder_vocab_size") or config["vocab_size"]),
        max_position_embeddings=int(config.get("max_position_embeddings") or 1024),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
        layer_windows=(None,) * num_layers,
        num_encoder_layers=int(config["encoder_layers"]),
        encoder_intermediate_size=int(config["encoder_ffn_dim"]),
    )
    start = config.get("decoder_start_token_id")
    settings = MarianSettings(
        encoder_heads=int(config.get("encoder_attention_heads") or heads),
        activation=activation,
        embed_scale=math.sqrt(hidden_size) if config.get("scale_embedding", False) else 1.0,
        decoder_start_token_id=int(start if start is not None else config["pad_token_id"]),
    )
    return arch, settings
