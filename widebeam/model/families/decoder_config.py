"""One parse per model family: a Hugging Face config dict -> (ModelArch, the family's settings).

Torch-free: `widebeam plan` reads configs through these functions as the engine does, so the two
can never disagree on pools. Optional fields get the defaults of the installed transformers'
config class of the family (checked on transformers 5.24), because Hub configs omit fields that
equal them; shape fields stay required (`{"model_type": "llama"}` alone is refused).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from widebeam.errors import ConfigError, UnsupportedModelError
from widebeam.model.families.arch import ModelArch

log = logging.getLogger(__name__)

LAYER_TYPES = ("full_attention", "sliding_attention")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_ROPE_REQUIRED_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
# The names widebeam.model.families.layers.ACTIVATIONS implements (a unit test holds the two equal).
SUPPORTED_ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "gelu_new")


@dataclass(frozen=True)
class DecoderSettings:
    """What a decoder-only family's layers need beyond the KV shape (widebeam.model.families.decoder)."""

    rms_norm_eps: float
    hidden_act: str
    rope: dict[str, dict]  # layer type (LAYER_TYPES) -> normalised RoPE parameters
    rotary_dims: int  # leading dims of each head RoPE rotates; the rest pass through (Phi-3)
    attention_scale: float
    qkv_bias: bool = False
    output_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # q and k RMS-normed per head before RoPE (Qwen3, Gemma 3)
    unit_offset_norms: bool = False  # RMSNorm scales by 1 + w (Gemma)
    sandwich_norms: bool = False  # Gemma's four norms: attention and MLP outputs normed before the add
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size), rounded to the model dtype
    final_logit_softcap: float | None = None


def rope_parameters(config: dict, rope_theta_key: str = "rope_theta") -> dict:
    """The RoPE settings from either config style (transformers 5 `rope_parameters`, or 4.x
    `rope_theta` + `rope_scaling`), normalised to one dict with `rope_type` and `rope_theta`."""
    params = dict(config.get("rope_parameters") or {})
    if "rope_type" not in params and "type" in params:
        params["rope_type"] = params.pop("type")
    scaling = config.get("rope_scaling") or {}
    if scaling:
        params.update(scaling)
        params["rope_type"] = scaling.get("rope_type") or scaling.get("type") or "default"
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", config.get(rope_theta_key, 10000.0))
    return params


def checked_rope(params: dict, supported: tuple[str, ...] = SUPPORTED_ROPE_TYPES, family: str = "") -> dict:
    rope_type = params["rope_type"]
    if rope_type not in supported:
        raise UnsupportedModelError(
            f"{family + ' ' if family else ''}rope scaling type {rope_type!r} is not supported; "
            f"supported: {', '.join(supported)}")
    missing = [key for key in _ROPE_REQUIRED_KEYS[rope_type] if params.get(key) is None]
    if missing:
        raise ConfigError(f"rope scaling {rope_type!r} lacks {', '.join(missing)}")
    return params


def _checked_activation(name: str) -> str:
    if name not in SUPPORTED_ACTIVATIONS:
        raise UnsupportedModelError(f"activation {name!r} is not supported; supported: "
                                    f"{sorted(SUPPORTED_ACTIVATIONS)}")
    return name


def windows_from_layer_types(layer_types: list[str], window: int | None, num_layers: int,
                             ) -> tuple[int | None, ...]:
    """Per layer: the window of a sliding layer, None for a full one (and for a sliding one when
    the config has no window, as transformers then builds a causal mask)."""
    if len(layer_types) != num_layers:
        raise ConfigError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise UnsupportedModelError(f"layer types {unknown} are not supported; supported: "
                                    f"{', '.join(LAYER_TYPES)}")
    return tuple(int(window) if t == "sliding_attention" and window else None for t in layer_types)


def _arch(config: dict, name: str, model_type: str, windows: Callable[[dict, int], tuple[int | None, ...]],
          head_dim: int | None = None, **layout) -> ModelArch:
    num_layers = int(config["num_hidden_layers"])
    hidden_size = int(config["hidden_size"])
    num_heads = int(config["num_attention_heads"])
    return ModelArch(
        name=name,
        model_type=model_type,
        num_layers=num_layers,
        hidden_size=hidden_size,
        intermediate_size=int(config["intermediate_size"]),
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim or config.get("head_dim") or hidden_size // num_heads),
        vocab_size=int(config["vocab_size"]),
        max_position_embeddings=int(config["max_position_embeddings"]),
        tie_word_embeddings=bool(config["tie_word_embeddings"]),
        layer_windows=windows(config, num_layers),
        **layout,
    )


def _llama_like(config: dict, name: str, model_type: str, defaults: dict,
                windows: Callable[[dict, int], tuple[int | None, ...]], *, qkv_bias: bool, output_bias: bool,
                mlp_bias: bool = False, qk_norm: bool = False, partial_rotary: bool = False,
                rope_types: tuple[str, ...] = SUPPORTED_ROPE_TYPES) -> tuple[ModelArch, DecoderSettings]:
    """The pre-norm RoPE decoders (Llama, Qwen2, Mistral, Qwen3, Phi-3): one parse, family switches."""
    config = {**defaults, **config}
    arch = _arch(config, name, model_type, windows, qkv_bias=qkv_bias, output_bias=output_bias,
                 mlp_bias=mlp_bias, qk_norm=qk_norm)
    rope = checked_rope(rope_parameters(config), rope_types, model_type)
    rotary_dims = arch.head_dim
    if partial_rotary:
        # transformers 5 keeps the factor in rope_parameters; 4.x configs at the top level
        factor = float(rope.get("partial_rotary_factor") or config.get("partial_rotary_factor") or 1.0)
        rotary_dims = int(arch.head_dim * factor)
        if not 0 < rotary_dims <= arch.head_dim or rotary_dims % 2:
            raise UnsupportedModelError(f"partial_rotary_factor {factor} gives {rotary_dims} rotary dims of "
                                        f"{arch.head_dim}; supported: an even number in (0, head_dim]")
    settings = DecoderSettings(
        rms_norm_eps=float(config["rms_norm_eps"]),
        hidden_act=_checked_activation(str(config.get("hidden_act") or "silu")),
        rope={kind: rope for kind in LAYER_TYPES},
        rotary_dims=rotary_dims,
        attention_scale=arch.head_dim**-0.5,
        qkv_bias=qkv_bias,
        output_bias=output_bias,
        mlp_bias=mlp_bias,
        qk_norm=qk_norm,
    )
    return arch, settings


def _no_window(config: dict, num_layers: int) -> tuple[int | None, ...]:
    return (None,) * num_layers


def _every_layer_window(config: dict, num_layers: int) -> tuple[int | None, ...]:
    window = config.get("sliding_window")
    return (int(window) if window else None,) * num_layers


def _qwen_windows(config: dict, num_layers: int) -> tuple[int | None, ...]:
    """Qwen2/Qwen3Config: the window counts only with use_sliding_window (default off), and then
    for layers from max_window_layers on, unless layer_types says otherwise."""
    window = config.get("sliding_window") if config.get("use_sliding_window") else None
    layer_types = config.get("layer_types") or [
        "sliding_attention" if window and i >= int(config["max_window_layers"]) else "full_attention"
        for i in range(num_layers)
    ]
    return windows_from_layer_types(layer_types, window, num_layers)


_LLAMA_DEFAULTS = {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
_QWEN_DEFAULTS = {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                  "use_sliding_window": False, "max_window_layers": 28}


def parse_llama(config: dict, name: str) -> tuple[ModelArch, DecoderSettings]:
    """Llama and SmolLM2. transformers' Llama never windows attention, whatever the config says."""
    bias = bool(config.get("attention_bias", False))
    return _llama_like(config, name, "llama", _LLAMA_DEFAULTS, _no_window, qkv_bias=bias, output_bias=bias,
                       mlp_bias=bool(config.get("mlp_bias", False)))


def parse_qwen2(config: dict, name: str) -> tuple[ModelArch, DecoderSettings]:
    """Qwen2: q/k/v always carry a bias, o_proj never."""
    return _llama_like(config, name, "qwen2", _QWEN_DEFAULTS, _qwen_windows, qkv_bias=True, output_bias=False)


def parse_mistral(config: dict, name: str) -> tuple[ModelArch, DecoderSettings]:
    """Mistral: one window for every layer; MistralConfig's default window is 4096 (null: none)."""
    defaults = {**_LLAMA_DEFAULTS, "max_position_embeddings": 131072, "sliding_window": 4096}
    return _llama_like(config, name, "mistral", defaults, _every_layer_window, qkv_bias=False,
                       output_bias=False)


def parse_qwen3(config: dict, name: str) -> tuple[ModelArch, DecoderSettings]:
    """Qwen3: Qwen2's windows, q and k RMS-normed per head before RoPE, biases only with
    attention_bias, and head_dim 128 by default (not hidden_size / heads)."""
    bias = bool(config.get("attention_bias", False))
    return _llama_like(config, name, "qwen3", {**_QWEN_DEFAULTS, "head_dim": 128}, _qwen_windows,
                       qkv_bias=bias, output_bias=bias, qk_norm=True)


def parse_phi3(config: dict, name: str) -> tuple[ModelArch, DecoderSettings]:
    """Phi-3: Llama's layer with fused checkpoint tensors (split at load time, see table.py),
    an optional partial rotary, and `sliding_window` on every layer when set. transformers' Phi-3
    mask keeps key j for query i when j > i - sliding_window, which is widebeam's i - j < window,
    so the window passes through unchanged. Phi3Config accepts only default and LongRoPE
    (su/yarn); LongRoPE is not implemented here."""
    defaults = {**_LLAMA_DEFAULTS, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5}
    return _llama_like(config, name, "phi3", defaults, _every_layer_window, qkv_bias=False, output_bias=False,
                       partial_rotary=True, rope_types=("default",))


# transformers' Gemma3TextConfig defaults: multimodal checkpoints store only the fields of their
# `text_config` that differ from these.
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "use_bidirectional_attention": False,
}
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_ROPE_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


def gemma3_text_config(config: dict) -> dict:
    """The Gemma 3 decoder's config as one flat dict, Gemma3TextConfig defaults filled in.

    A "gemma3" (multimodal) config contributes its `text_config`; `tie_word_embeddings` is then
    read from the top level, where transformers keeps it for the whole model.
    """
    if config.get("model_type") == "gemma3":
        text = dict(config.get("text_config") or {})
        if "tie_word_embeddings" in config:
            text["tie_word_embeddings"] = config["tie_word_embeddings"]
        text.setdefault("_name_or_path", config.get("_name_or_path"))
    else:
        text = dict(config)
    for key, value in GEMMA3_TEXT_DEFAULTS.items():
        if key not in text or (text[key] is None and key != "sliding_window"):
            text[key] = value
    text["model_type"] = "gemma3_text"
    num_layers = int(text["num_hidden_layers"])
    if not text.get("layer_types"):
        pattern = int(text.get("sliding_window_pattern") or text.get("_sliding_window_pattern")
                      or GEMMA3_SLIDING_WINDOW_PATTERN)
        text["layer_types"] = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)
        ]
    if text["use_bidirectional_attention"]:
        raise UnsupportedModelError("Gemma 3 with use_bidirectional_attention (an embedding model) is not "
                                    "supported; widebeam runs causal decoders only")
    return text


def gemma3_rope_parameters(config: dict) -> dict[str, dict]:
    """RoPE settings per layer type, from either config style, each normalised like `rope_parameters`.

    transformers 5 stores `rope_parameters = {"full_attention": {...}, "sliding_attention": {...}}`;
    4.x configs have `rope_theta` (+ `rope_scaling`, applied to full-attention layers only) and
    `rope_local_base_freq` for sliding layers. A flat `rope_parameters` is the full-attention one.
    """
    stored = dict(config.get("rope_parameters") or {})
    if any(key in stored for key in LAYER_TYPES):
        per_type = {kind: dict(stored.get(kind) or {}) for kind in LAYER_TYPES}
    else:
        per_type = {"full_attention": stored, "sliding_attention": {}}
    if config.get("rope_scaling"):
        per_type["full_attention"].update(config["rope_scaling"])
    per_type["full_attention"].setdefault("rope_theta",
                                          config.get("rope_theta") or GEMMA3_ROPE_THETA["full_attention"])
    per_type["sliding_attention"].setdefault(
        "rope_theta", config.get("rope_local_base_freq") or GEMMA3_ROPE_THETA["sliding_attention"])
    return {kind: checked_rope(rope_parameters({"rope_parameters": params}), family="gemma3")
            for kind, params in per_type.items()}


def parse_gemma3(config: dict, name: str) -> tuple[ModelArch, DecoderSettings]:
    """Gemma 3 text decoders ("gemma3_text", and the text half of multimodal "gemma3").

    `attn_logit_softcapping` is read but not applied, as in transformers (checked on 5.24: its
    Gemma3Attention keeps the value and never passes it to the attention function). The sliding
    mask follows transformers (`kv_idx > q_idx - sliding_window`), widebeam's own convention.
    """
    text = gemma3_text_config(config)
    window = text.get("sliding_window")
    if "sliding_attention" in text["layer_types"] and not window:
        raise UnsupportedModelError("Gemma 3 config has sliding-attention layers but no sliding_window")
    bias = bool(text["attention_bias"])
    arch = _arch(text, name, "gemma3_text",
                 lambda c, n: windows_from_layer_types(c["layer_types"], window, n),
                 qkv_bias=bias, output_bias=bias, norms_per_layer=4, qk_norm=True)
    if text.get("attn_logit_softcapping") is not None:
        log.warning("Gemma 3 config sets attn_logit_softcapping=%s; like transformers, widebeam does not "
                    "apply it to attention scores", text["attn_logit_softcapping"])
    final_cap = text.get("final_logit_softcapping")
    settings = DecoderSettings(
        rms_norm_eps=float(text["rms_norm_eps"]),
        hidden_act=_checked_activation(str(text["hidden_activation"])),
        rope=gemma3_rope_parameters(text),
        rotary_dims=arch.head_dim,
        attention_scale=float(text["query_pre_attn_scalar"]) ** -0.5,
        qkv_bias=bias,
        output_bias=bias,
        qk_norm=True,
        unit_offset_norms=True,
        sandwich_norms=True,
        scale_embeddings=True,
        final_logit_softcap=float(final_cap) if final_cap is not None else None,
    )
    return arch, settings
