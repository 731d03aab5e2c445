"""T5 / mT5 / T5 v1.1 / flan-T5 configs (model_type `t5`, `mt5`), parsed torch-free for the family table.

The KV layer sees the decoder: `num_decoder_layers` layers of `num_heads` heads of `d_kv` dims each
(T5's head_dim is its own field, not d_model / num_heads: mt5-small has 6 heads of 64 dims
beside d_model 512, t5-11b 128 heads of 128 beside d_model 1024). Every decoder layer also keeps
the encoder output's K/V in the cross pool.

T5 has no absolute positions (a relative bias instead), so `max_position_embeddings` is only the
longest source the engine plans for: `n_positions` when the config has one (t5-small: 512), else 512.
"""

from __future__ import annotations

from dataclasses import dataclass

from widebeam.errors import ConfigError, UnsupportedModelError
from widebeam.model.families.arch import ModelArch

# families/t5.py: T5_ACTIVATIONS' names: the activation after `feed_forward_proj`'s "gated-" (if any)
T5_ACTIVATIONS = ("relu", "gelu", "gelu_new", "gelu_pytorch_tanh", "silu", "swish")
DEFAULT_SOURCE_TOKENS = 512


@dataclass(frozen=True)
class T5Settings:
    """widebeam.model.families.t5's settings beside the architecture."""

    encoder_layers: int
    relative_attention_num_buckets: int
    relative_attention_max_distance: int
    layer_norm_epsilon: float
    activation: str  # the feed-forward's activation ("relu", "gelu_new", ...)
    gated: bool  # wi_0 (activated) * wi_1, as T5 v1.1 / mT5 / flan-T5; else one `wi` (T5 v1.0)
    scale_decoder_outputs: bool  # hidden * d_model**-0.5 before the LM head (T5 v1.0's tied head)
    decoder_start_token_id: int


def parse_feed_forward_proj(value: str) -> tuple[str, bool]:
    """transformers' reading of `feed_forward_proj`: "relu" or "gated-<act>"; "gated-gelu" means
    gelu_new (the tanh approximation), as T5 v1.1 was trained."""
    parts = value.split("-")
    if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
        raise ConfigError(f"feed_forward_proj {value!r} is not 'ACT' or 'gated-ACT'")
    gated = len(parts) == 2
    activation = "gelu_new" if value == "gated-gelu" else parts[-1]
    if activation not in T5_ACTIVATIONS:
        raise UnsupportedModelError(f"feed_forward_proj {value!r}: activation {activation!r} is not "
                                    f"supported; supported: {sorted(T5_ACTIVATIONS)}")
    return activation, gated


def _scale_decoder_outputs(config: dict, model_type: str, tied: bool) -> bool:
    """T5 v1.0 scales the decoder output by d_model**-0.5 before its tied head; v1.1, flan-T5 and
    mT5 (untied heads) do not. transformers 5 saves the choice as `scale_decoder_outputs` (and always
    writes tie_word_embeddings True); older configs say it with tie_word_embeddings. MT5's model never
    scales in transformers 5."""
    if "scale_decoder_outputs" in config and config["scale_decoder_outputs"] is not None:
        return bool(config["scale_decoder_outputs"])
    return model_type == "t5" and tied


def parse_t5(config: dict, name: str) -> tuple[ModelArch, T5Settings]:
    model_type = str(config["model_type"])
    d_model, d_kv, heads = int(config["d_model"]), int(config["d_kv"]), int(config["num_heads"])
    encoder_layers = int(config["num_layers"])
    decoder_layers = config.get("num_decoder_layers")
    decoder_layers = int(decoder_layers if decoder_layers is not None else encoder_layers)
    for field_name, value in (("d_model", d_model), ("d_kv", d_kv), ("num_heads", heads),
                              ("num_layers", encoder_layers), ("num_decoder_layers", decoder_layers)):
        if value < 1:
            raise ConfigError(f"config for {name!r}: {field_name} must be >= 1, got {value}")
    activation, gated = parse_feed_forward_proj(str(config.get("feed_forward_proj", "relu")))
    tied = bool(config.get("tie_word_embeddings", True))
    d_ff = int(config["d_ff"])
    arch = ModelArch(
        name=name,
        model_type=model_type,
        num_layers=decoder_layers,
        hidden_size=d_model,
        intermediate_size=d_ff,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=d_kv,
        vocab_size=int(config["vocab_size"]),
        max_position_embeddings=int(config.get("n_positions") or DEFAULT_SOURCE_TOKENS),
        tie_word_embeddings=tied,
        layer_windows=(None,) * decoder_layers,
        num_encoder_layers=encoder_layers,
        encoder_intermediate_size=d_ff,
        mlp_bias=False,
        final_logits_bias=False,
        norms_per_stack=1,  # each stack's final_layer_norm
        linear_bias=False,
        rms_norm=True,
        gated_mlp=gated,
        relative_attention_buckets=int(config.get("relative_attention_num_buckets", 32)),
    )
    start = config.get("decoder_start_token_id")
    pad = config.get("pad_token_id")
    settings = T5Settings(
        encoder_layers=encoder_layers,
        relative_attention_num_buckets=int(config.get("relative_attention_num_buckets", 32)),
        relative_attention_max_distance=int(config.get("relative_attention_max_distance", 128)),
        layer_norm_epsilon=float(config.get("layer_norm_epsilon", 1e-6)),
        activation=activation,
        gated=gated,
        scale_decoder_outputs=_scale_decoder_outputs(config, model_type, tied),
        decoder_start_token_id=int(start if start is not None else (pad if pad is not None else 0)),
    )
    return arch, settings
