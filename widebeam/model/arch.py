"""Architecture facts a capacity plan needs, read from a Hugging Face `config.json`.

Built-in entries carry the configs of the models widebeam ships aliases for and of a few well-known
large models, so `widebeam plan` works without downloading anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from widebeam.kv.spec import CrossAttentionSpec, FullAttentionSpec, PoolSpec, SlidingWindowSpec, dtype_bytes

# The pool of an encoder-decoder model's cross-attention K/V (see CrossAttentionSpec).
CROSS_POOL = "cross"
# Model types with an encoder and a decoder: the decoder's self-attention K/V go in "self", the
# encoder output's K/V (one copy per decoder layer) in CROSS_POOL.
ENCODER_DECODER_TYPES = ("marian",)

BUILTIN_CONFIGS: dict[str, dict] = {
    "smollm2-135m-instruct": {
        "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
        "max_position_embeddings": 8192, "tie_word_embeddings": True,
    },
    "gemma3-270m": {
        "model_type": "gemma3_text", "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262144,
        "max_position_embeddings": 32768, "tie_word_embeddings": True, "sliding_window": 512,
        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3,
    },
    # Helsinki-NLP/opus-mt-en-de: 6 + 6 layers, d_model 512, shared 58101-token vocabulary.
    "opus-mt-en-de": {
        "model_type": "marian", "is_encoder_decoder": True, "d_model": 512, "encoder_layers": 6,
        "decoder_layers": 6, "encoder_attention_heads": 8, "decoder_attention_heads": 8,
        "encoder_ffn_dim": 2048, "decoder_ffn_dim": 2048, "vocab_size": 58101, "decoder_vocab_size": 58101,
        "max_position_embeddings": 512, "share_encoder_decoder_embeddings": True, "tie_word_embeddings": True,
        "activation_function": "swish", "scale_embedding": True, "pad_token_id": 58100,
        "decoder_start_token_id": 58100, "eos_token_id": 0,
    },
    "llama-3-8b": {
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "max_position_embeddings": 8192, "tie_word_embeddings": False,
    },
    "llama-3.1-70b": {
        "model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
        "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
        "max_position_embeddings": 131072, "tie_word_embeddings": False,
    },
    "qwen2.5-7b": {
        "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
        "max_position_embeddings": 32768, "tie_word_embeddings": False,
    },
    "mistral-7b-v0.1": {
        "model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
        "max_position_embeddings": 32768, "tie_word_embeddings": False, "sliding_window": 4096,
    },
}

# Model types whose q/k/v projections carry a bias.
_QKV_BIAS_TYPES = {"qwen2"}


class ConfigError(ValueError):
    """A model config that is missing or cannot be read."""


@dataclass(frozen=True)
class ModelArch:
    name: str
    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    # One entry per layer: None for full attention, else the window in tokens.
    layer_windows: tuple[int | None, ...]
    # Encoder-decoder models only (0 otherwise): the layers above are the decoder's.
    num_encoder_layers: int = 0
    encoder_intermediate_size: int = 0

    @property
    def is_encoder_decoder(self) -> bool:
        return self.num_encoder_layers > 0

    @classmethod
    def from_hf_config(cls, config: dict, name: str = "model") -> ModelArch:
        config = dict(config.get("text_config") or config)
        if config.get("is_encoder_decoder") or config.get("model_type") in ENCODER_DECODER_TYPES:
            config = _encoder_decoder_fields(config)
        try:
            num_layers = int(config["num_hidden_layers"])
            hidden_size = int(config["hidden_size"])
            num_heads = int(config["num_attention_heads"])
            arch = cls(
                name=name,
                model_type=str(config.get("model_type", "llama")),
                num_layers=num_layers,
                hidden_size=hidden_size,
                intermediate_size=int(config["intermediate_size"]),
                num_heads=num_heads,
                num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
                head_dim=int(config.get("head_dim") or hidden_size // num_heads),
                vocab_size=int(config["vocab_size"]),
                max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                layer_windows=_layer_windows(config, num_layers),
                num_encoder_layers=int(config.get("num_encoder_layers", 0)),
                encoder_intermediate_size=int(config.get("encoder_intermediate_size", 0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"config for {name!r} lacks or mangles a required field: {exc}") from None
        return arch

    @property
    def num_params(self) -> int:
        """Parameter count of a Llama-family decoder with this shape (norm weights included)."""
        if self.is_encoder_decoder:
            return self._encoder_decoder_params()
        h, kv_dim, q_dim = self.hidden_size, self.num_kv_heads * self.head_dim, self.num_heads * self.head_dim
        attention = h * q_dim + 2 * h * kv_dim + q_dim * h
        if self.model_type in _QKV_BIAS_TYPES:
            attention += q_dim + 2 * kv_dim
        mlp = 3 * h * self.intermediate_size
        norms = 2 * h + (4 * h + 2 * self.head_dim if self.model_type.startswith("gemma3") else 0)
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_layers * (attention + mlp + norms) + h

    def _encoder_decoder_params(self) -> int:
        """Marian/BART-style: biased projections, LayerNorms (weight + bias), one shared embedding
        matrix, a final logits bias; sinusoidal positions are computed, not stored."""
        h = self.hidden_size
        attention = 4 * (h * h + h)
        layer_norm = 2 * h

        def ffn(size: int) -> int:
            return 2 * h * size + size + h

        encoder = self.num_encoder_layers * (attention + ffn(self.encoder_intermediate_size) + 2 * layer_norm)
        decoder = self.num_layers * (2 * attention + ffn(self.intermediate_size) + 3 * layer_norm)
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + self.vocab_size
        return embeddings + encoder + decoder

    def weight_bytes(self, dtype: str) -> int:
        return self.num_params * dtype_bytes(dtype)

    def layer_pool_names(self) -> list[str]:
        """The pool each layer's K/V live in, named as in `kv_pool_specs`. An encoder-decoder model
        lists its decoder layers twice: their self-attention K/V, then their cross-attention K/V."""
        names = ["self" if w is None else f"sliding_{w}" for w in self.layer_windows]
        if self.is_encoder_decoder:
            names += [CROSS_POOL] * self.num_layers
        return names

    def kv_pool_specs(self, dtype: str) -> list[PoolSpec]:
        """One pool per attention kind: full-attention layers, and one pool per distinct window."""
        specs: list[PoolSpec] = []
        num_full_layers = sum(1 for w in self.layer_windows if w is None)
        common = {"num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim, "dtype": dtype}
        if num_full_layers:
            specs.append(FullAttentionSpec(name="self", num_layers=num_full_layers, **common))
        for window in sorted({w for w in self.layer_windows if w is not None}):
            num_layers = sum(1 for w in self.layer_windows if w == window)
            specs.append(
                SlidingWindowSpec(name=f"sliding_{window}", num_layers=num_layers, window_tokens=window, **common)
            )
        if self.is_encoder_decoder:
            # every decoder layer attends the encoder output through its own K/V projections
            specs.append(CrossAttentionSpec(name=CROSS_POOL, num_layers=self.num_layers, **common))
        return specs


def _encoder_decoder_fields(config: dict) -> dict:
    """Marian/BART config names mapped onto the decoder-only names ModelArch reads: the decoder's
    layers, heads and vocabulary are the ones that hold KV and produce logits."""
    if "d_model" not in config:
        return config
    heads = config.get("decoder_attention_heads")
    return {
        **config,
        "hidden_size": config["d_model"],
        "num_hidden_layers": config.get("decoder_layers"),
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "intermediate_size": config.get("decoder_ffn_dim"),
        "vocab_size": config.get("decoder_vocab_size") or config.get("vocab_size"),
        "tie_word_embeddings": config.get("tie_word_embeddings", True),
        "num_encoder_layers": config.get("encoder_layers"),
        "encoder_intermediate_size": config.get("encoder_ffn_dim"),
    }


def _layer_windows(config: dict, num_layers: int) -> tuple[int | None, ...]:
    window = config.get("sliding_window")
    layer_types = config.get("layer_types")
    if layer_types:
        if len(layer_types) != num_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
        return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
    if window and config.get("use_sliding_window", True):
        pattern = config.get("sliding_window_pattern")
        if pattern:  # Gemma 2/3 style: every `pattern`-th layer is global
            return tuple(None if (i + 1) % int(pattern) == 0 else int(window) for i in range(num_layers))
        return (int(window),) * num_layers
    return (None,) * num_layers


def load_arch(model: str) -> ModelArch:
    """A built-in name, a `config.json` path, or a directory holding one."""
    if model in BUILTIN_CONFIGS:
        return ModelArch.from_hf_config(BUILTIN_CONFIGS[model], name=model)
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix != ".json" or not path.exists():
        raise ConfigError(
            f"unknown model {model!r}: use one of {', '.join(BUILTIN_CONFIGS)}, "
            "a Hugging Face model directory, or a config.json path"
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read model config {str(path)!r}: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"model config {str(path)!r} is not a JSON object")
    return ModelArch.from_hf_config(config, name=str(model))
