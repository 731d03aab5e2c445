"""Gemma 3 text decoder (`Gemma3ForCausalLM`, model type "gemma3_text") on widebeam's paged KV cache.

What sets it apart from the Llama family:
- layers alternate sliding-window and full attention (`layer_types`; five local to one global in
  released configs); the two kinds live in separate KV pools and use different RoPE bases
  (`rope_parameters["full_attention"]`, with its scaling, and `["sliding_attention"]`);
- RMSNorms scale by `1 + w`; each layer has four of them (input, post-attention, pre- and
  post-feed-forward) and q/k are RMS-normed per head before RoPE;
- embeddings are multiplied by sqrt(hidden_size), rounded to the model dtype first;
- attention scale is `query_pre_attn_scalar ** -0.5`; final logits may be soft-capped.

`attn_logit_softcapping` is read but not applied, as in transformers (checked on 5.24: its
Gemma3Attention keeps the value and never passes it to the attention function; Gemma 3 bounds its
scores with q/k norms instead, and released configs set it to null). A checkpoint whose config sets
it was therefore trained and evaluated without it; applying it would break parity.

The sliding mask follows transformers (`kv_idx > q_idx - sliding_window`): a query at position i
sees key j when 0 <= i - j < sliding_window, the same convention `paged_attention` uses, so the
config's window is passed through unchanged.

"gemma3" (the multimodal `Gemma3ForConditionalGeneration`) is served text-only: the decoder is read
from its `text_config` and the vision tower's weights are skipped.

Module and parameter names follow the Hugging Face checkpoints, so a safetensors state dict loads
as is. Attention reads and writes K/V only through `widebeam.model.attention`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from widebeam.model.arch import ModelArch
from widebeam.model.attention import AttentionMetadata, paged_attention, write_kv
from widebeam.model.layers import (
    GatedMLP,
    RMSNorm,
    RotaryEmbedding,
    UnsupportedModelError,
    apply_rotary,
    rope_parameters,
)
from widebeam.model.weights import copy_checkpoint

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("gemma3_text", "gemma3")

# transformers' Gemma3TextConfig defaults: multimodal checkpoints store only the fields of their
# `text_config` that differ from these.
TEXT_CONFIG_DEFAULTS = {
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
DEFAULT_SLIDING_WINDOW_PATTERN = 6
DEFAULT_ROPE_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
LAYER_TYPES = ("full_attention", "sliding_attention")

# Prefixes of a multimodal checkpoint: (old layout, transformers 5 layout) -> text-only names.
_MULTIMODAL_RENAMES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_MULTIMODAL_SKIPPED = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def text_config(config: dict) -> dict:
    """The decoder's config as one flat dict, Gemma3TextConfig defaults filled in.

    A "gemma3" (multimodal) config contributes its `text_config`; `tie_word_embeddings` is then
    read from the top level, where transformers keeps it for the whole model.
    """
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported by the Gemma 3 code; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if model_type == "gemma3":
        text = dict(config.get("text_config") or {})
        if "tie_word_embeddings" in config:
            text["tie_word_embeddings"] = config["tie_word_embeddings"]
        text.setdefault("_name_or_path", config.get("_name_or_path"))
    else:
        text = dict(config)
    for key, value in TEXT_CONFIG_DEFAULTS.items():
        if key not in text or (text[key] is None and key != "sliding_window"):
            text[key] = value
    text["model_type"] = "gemma3_text"
    num_layers = int(text["num_hidden_layers"])
    if not text.get("layer_types"):
        pattern = int(text.get("sliding_window_pattern") or text.get("_sliding_window_pattern")
                      or DEFAULT_SLIDING_WINDOW_PATTERN)
        text["layer_types"] = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)
        ]
    unknown = sorted(set(text["layer_types"]) - set(LAYER_TYPES))
    if unknown:
        raise UnsupportedModelError(f"Gemma 3 layer types {unknown} are not supported; supported: {LAYER_TYPES}")
    if text["use_bidirectional_attention"]:
        raise UnsupportedModelError("Gemma 3 with use_bidirectional_attention (an embedding model) is not supported; "
                                    "widebeam runs causal decoders only")
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
    per_type["full_attention"].setdefault("rope_theta", config.get("rope_theta") or DEFAULT_ROPE_THETA["full_attention"])
    per_type["sliding_attention"].setdefault(
        "rope_theta", config.get("rope_local_base_freq") or DEFAULT_ROPE_THETA["sliding_attention"])
    return {kind: rope_parameters({"rope_parameters": params}) for kind, params in per_type.items()}


@dataclass(frozen=True)
class Gemma3Config:
    arch: ModelArch
    rms_norm_eps: float
    hidden_activation: str
    rope: dict  # layer type -> normalised RoPE parameters
    attention_bias: bool
    query_pre_attn_scalar: float
    attn_logit_softcapping: float | None  # kept for reference only: transformers does not apply it
    final_logit_softcapping: float | None
    multimodal: bool  # weights come from a Gemma3ForConditionalGeneration checkpoint

    @classmethod
    def from_hf_config(cls, config: dict) -> Gemma3Config:
        text = text_config(config)
        if any(t == "sliding_attention" for t in text["layer_types"]) and not text.get("sliding_window"):
            raise UnsupportedModelError("Gemma 3 config has sliding-attention layers but no sliding_window")
        arch = ModelArch.from_hf_config(text, name=str(text.get("_name_or_path") or text["model_type"]))
        attn_cap, final_cap = text.get("attn_logit_softcapping"), text.get("final_logit_softcapping")
        if attn_cap is not None:
            log.warning("Gemma 3 config sets attn_logit_softcapping=%s; like transformers, widebeam does not "
                        "apply it to attention scores", attn_cap)
        return cls(
            arch=arch,
            rms_norm_eps=float(text["rms_norm_eps"]),
            hidden_activation=str(text["hidden_activation"]),
            rope=gemma3_rope_parameters(text),
            attention_bias=bool(text["attention_bias"]),
            query_pre_attn_scalar=float(text["query_pre_attn_scalar"]),
            attn_logit_softcapping=float(attn_cap) if attn_cap is not None else None,
            final_logit_softcapping=float(final_cap) if final_cap is not None else None,
            multimodal=config.get("model_type") == "gemma3",
        )


class Gemma3Attention(nn.Module):
    def __init__(self, cfg: Gemma3Config, layer_index: int):
        super().__init__()
        arch = cfg.arch
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(arch.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(arch.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(arch.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, arch.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, unit_offset=True)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, unit_offset=True)
        # transformers' mask keeps key j for query i when j > i - window: exactly paged_attention's rule.
        self.sliding_window = arch.layer_windows[layer_index]
        self.scale = cfg.query_pre_attn_scalar**-0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        write_kv(kv_cache[0], kv_cache[1], k, v, meta.slot_mapping)
        # No attention softcap: see the module docstring.
        out = paged_attention(q, kv_cache[0], kv_cache[1], meta, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: Gemma3Config, layer_index: int):
        super().__init__()
        arch, eps = cfg.arch, cfg.rms_norm_eps
        self.is_sliding = arch.layer_windows[layer_index] is not None
        self.input_layernorm = RMSNorm(arch.hidden_size, eps, unit_offset=True)
        self.self_attn = Gemma3Attention(cfg, layer_index)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(arch.hidden_size, eps, unit_offset=True)
        self.mlp = GatedMLP(arch.hidden_size, arch.intermediate_size, cfg.hidden_activation)
        self.post_feedforward_layernorm = RMSNorm(arch.hidden_size, eps, unit_offset=True)

    def forward(self, x, cos, sin, kv_cache, meta):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3TextModel(nn.Module):
    def __init__(self, cfg: Gemma3Config):
        super().__init__()
        arch = cfg.arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, cfg.rms_norm_eps, unit_offset=True)
        # Not checkpoint state: derived from the config, kept out of the module's parameters and buffers.
        self.rotary_global = RotaryEmbedding(cfg.rope["full_attention"], arch.head_dim)
        self.rotary_local = RotaryEmbedding(cfg.rope["sliding_attention"], arch.head_dim)
        # transformers multiplies by sqrt(hidden) rounded to the weights' dtype (55.4256 -> 55.5 in bf16).
        self.embed_scale = float(arch.hidden_size) ** 0.5


class Gemma3ForCausalLM(nn.Module):
    """The decoder and its LM head. `forward` returns hidden states; `compute_logits` the float32 logits."""

    def __init__(self, cfg: Gemma3Config):
        super().__init__()
        self.config = cfg
        self.arch = cfg.arch
        self.model = Gemma3TextModel(cfg)
        self.lm_head = nn.Linear(cfg.arch.hidden_size, cfg.arch.vocab_size, bias=False)
        if cfg.arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.layer_pool_names = cfg.arch.layer_pool_names()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                metadata: dict[str, AttentionMetadata]) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # [num_tokens, hidden]
        x = x * torch.tensor(self.model.embed_scale, dtype=torch.float32).to(x.dtype)
        rope = {
            False: self.model.rotary_global(positions, x.dtype),
            True: self.model.rotary_local(positions, x.dtype),
        }
        for layer, kv_cache, pool_name in zip(self.model.layers, kv_caches, self.layer_pool_names):
            cos, sin = rope[layer.is_sliding]
            x = layer(x, cos, sin, kv_cache, metadata[pool_name])
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def _text_state_dict(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A multimodal checkpoint's decoder weights under text-only names; the vision tower dropped."""
        if not self.config.multimodal:
            return dict(state_dict)
        out = {}
        for name, tensor in state_dict.items():
            if name.startswith(_MULTIMODAL_SKIPPED):
                continue
            for old, new in _MULTIMODAL_RENAMES:
                if name.startswith(old):
                    name = new + name[len(old):]
                    break
            out[name] = tensor
        return out

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        copy_checkpoint(self, self._text_state_dict(state_dict))
