"""Architecture facts a capacity plan needs, read from a Hugging Face `config.json`.

Built-in entries carry the configs of the models widebeam ships aliases for and of a few well-known
large models, so `widebeam plan` works without downloading anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from widebeam.kv.spec import FullAttentionSpec, PoolSpec, SlidingWindowSpec, dtype_bytes

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

    @classmethod
    def from_hf_config(cls, config: dict, name: str = "model") -> ModelArch:
        config = dict(config.get("text_config") or config)
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
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"config for {name!r} lacks or mangles a required field: {exc}") from None
        return arch

    @property
    def num_params(self) -> int:
        """Parameter count of a Llama-family decoder with this shape (norm weights included)."""
        h, kv_dim, q_dim = self.hidden_size, self.num_kv_heads * self.head_dim, self.num_heads * self.head_dim
        attention = h * q_dim + 2 * h * kv_dim + q_dim * h
        if self.model_type in _QKV_BIAS_TYPES:
            attention += q_dim + 2 * kv_dim
        mlp = 3 * h * self.intermediate_size
        norms = 2 * h + (4 * h + 2 * self.head_dim if self.model_type.startswith("gemma3") else 0)
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_layers * (attention + mlp + norms) + h

    def weight_bytes(self, dtype: str) -> int:
        return self.num_params * dtype_bytes(dtype)

    def layer_pool_names(self) -> list[str]:
        """The pool each layer's K/V live in, named as in `kv_pool_specs`."""
        return ["self" if w is None else f"sliding_{w}" for w in self.layer_windows]

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
        return specs


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
