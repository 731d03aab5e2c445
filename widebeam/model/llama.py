"""Llama-family decoders (Llama, SmolLM2, Qwen2, Mistral) on widebeam's paged KV cache.

Module and parameter names follow the Hugging Face checkpoints, so a safetensors state dict loads
as is. Attention reads and writes K/V only through `widebeam.model.attention`.
"""

from __future__ import annotations

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

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


@dataclass(frozen=True)
class LlamaConfig:
    arch: ModelArch
    rms_norm_eps: float
    hidden_act: str
    rope: dict
    attention_bias: bool
    output_bias: bool
    mlp_bias: bool

    @classmethod
    def from_hf_config(cls, config: dict) -> LlamaConfig:
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model type {model_type!r} is not supported by the Llama-family code; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        arch = ModelArch.from_hf_config(config, name=str(config.get("_name_or_path") or model_type))
        qkv_bias = model_type == "qwen2" or bool(config.get("attention_bias", False))
        return cls(
            arch=arch,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            hidden_act=str(config.get("hidden_act", "silu")),
            rope=rope_parameters(config),
            attention_bias=qkv_bias,
            output_bias=model_type != "qwen2" and bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
        )


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_index: int):
        super().__init__()
        arch = cfg.arch
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_proj = nn.Linear(arch.hidden_size, self.num_heads * self.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(arch.hidden_size, self.num_kv_heads * self.head_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(arch.hidden_size, self.num_kv_heads * self.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, arch.hidden_size, bias=cfg.output_bias)
        self.sliding_window = arch.layer_windows[layer_index]
        self.scale = self.head_dim**-0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        write_kv(kv_cache[0], kv_cache[1], k, v, meta.slot_mapping)
        out = paged_attention(q, kv_cache[0], kv_cache[1], meta, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_index: int):
        super().__init__()
        arch = cfg.arch
        self.input_layernorm = RMSNorm(arch.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_index)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(arch.hidden_size, arch.intermediate_size, cfg.hidden_act, cfg.mlp_bias)

    def forward(self, x, cos, sin, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        arch = cfg.arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.rope, arch.head_dim)


class LlamaForCausalLM(nn.Module):
    """The decoder and its LM head. `forward` returns hidden states; `compute_logits` the float32 logits."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.arch = cfg.arch
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.arch.hidden_size, cfg.arch.vocab_size, bias=False)
        if cfg.arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.layer_pool_names = cfg.arch.layer_pool_names()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                metadata: dict[str, AttentionMetadata]) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # [num_tokens, hidden]
        cos, sin = self.model.rotary(positions, x.dtype)
        for layer, kv_cache, pool_name in zip(self.model.layers, kv_caches, self.layer_pool_names):
            x = layer(x, cos, sin, kv_cache, metadata[pool_name])
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        copy_checkpoint(self, state_dict)
