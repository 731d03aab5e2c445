"""One decoder for every pre-norm RoPE family (Llama, SmolLM2, Qwen2, Mistral, Qwen3, Phi-3, Gemma 3),
configured by the family's `DecoderSettings` (decoder_config.py).

What the settings switch:
- q/k/v and output biases, MLP biases (Qwen2: q/k/v only; Llama with attention_bias: all four);
- q and k RMS-normed per head before RoPE (Qwen3, Gemma 3);
- RMSNorm scaling by `1 + w` (Gemma) instead of `w`;
- norm placement: Llama's two pre-norms, or Gemma's four (attention and MLP outputs normed before
  their residual add; `post_attention_layernorm` is then the attention output's norm, not the
  MLP's input norm);
- embeddings times sqrt(hidden_size), rounded to the model dtype first (Gemma);
- RoPE per layer type (Gemma: a global base for full layers, a local one for sliding layers), and a
  partial rotary (Phi-3: only the first `rotary_dims` of each head rotate);
- the attention scale (Gemma: query_pre_attn_scalar ** -0.5) and a final logit soft-cap (Gemma).

Module and parameter names follow the Hugging Face checkpoints (model.layers.N.self_attn.q_proj...),
so safetensors load as they are; Phi-3's fused tensors are split by its family's checkpoint layout.
Attention goes through `PagedAttention`, which writes this step's K/V and reads the window from the
pool's metadata.
"""

from __future__ import annotations

import torch
from torch import nn

from widebeam.model.attention.metadata import AttentionMetadata
from widebeam.model.attention.paged import PagedAttention
from widebeam.model.families.arch import ModelArch
from widebeam.model.families.checkpoint import copy_checkpoint
from widebeam.model.families.decoder_config import DecoderSettings
from widebeam.model.families.layers import (
    Embedding,
    FusedProjections,
    GatedMLP,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
    fuse_linears,
)
from widebeam.model.families.table import ParsedConfig


def _layer_type(window: int | None) -> str:
    return "full_attention" if window is None else "sliding_attention"


class DecoderAttention(nn.Module):
    FUSED_PARTS = ("q_proj", "k_proj", "v_proj")  # the linears `fuse_projections` stacks

    def __init__(self, arch: ModelArch, settings: DecoderSettings):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        q_rows, kv_rows = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(arch.hidden_size, q_rows, bias=settings.qkv_bias)
        self.k_proj = nn.Linear(arch.hidden_size, kv_rows, bias=settings.qkv_bias)
        self.v_proj = nn.Linear(arch.hidden_size, kv_rows, bias=settings.qkv_bias)
        self.o_proj = nn.Linear(q_rows, arch.hidden_size, bias=settings.output_bias)
        if settings.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, settings.rms_norm_eps, settings.unit_offset_norms)
            self.k_norm = RMSNorm(self.head_dim, settings.rms_norm_eps, settings.unit_offset_norms)
        self.qk_norm = settings.qk_norm
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, settings.attention_scale)
        self.qkv: FusedProjections | None = None

    def fuse_projections(self, concat) -> None:
        """q_proj, k_proj and v_proj as one layer (`concat`: a list of layers -> one); after loading."""
        self.qkv = fuse_linears(self, list(self.FUSED_PARTS), concat)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        if self.qkv is not None and not self.qk_norm:
            # q and k sit side by side in the fused output: one rotary call rotates both heads' rows.
            heads = self.qkv.linear(x).view(num_tokens, -1, self.head_dim)  # [T, H + 2 KV, d]
            num_qk = self.num_heads + self.num_kv_heads
            qk = apply_rotary(heads[:, :num_qk], cos, sin)
            q, k, v = qk[:, :self.num_heads], qk[:, self.num_heads:], heads[:, num_qk:]
            out = self.attn(q, k, v, kv_cache, meta)
            return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))
        q, k, v = self.qkv(x) if self.qkv is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.attn(q, k, v, kv_cache, meta)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, settings: DecoderSettings):
        super().__init__()
        h, eps, offset = arch.hidden_size, settings.rms_norm_eps, settings.unit_offset_norms
        self.input_layernorm = RMSNorm(h, eps, offset)
        self.self_attn = DecoderAttention(arch, settings)
        self.post_attention_layernorm = RMSNorm(h, eps, offset)
        self.sandwich_norms = settings.sandwich_norms
        if self.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(h, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(h, eps, offset)
        self.mlp = GatedMLP(h, arch.intermediate_size, settings.hidden_act, settings.mlp_bias)

    def forward(self, x, cos, sin, kv_cache, meta):
        attended = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        if self.sandwich_norms:
            x = x + self.post_attention_layernorm(attended)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        # in place on the fresh sums (bit-equal to x + ...): no new tensor per residual add
        x = attended.add_(x)
        return self.mlp(self.post_attention_layernorm(x)).add_(x)


class DecoderModel(nn.Module):
    def __init__(self, arch: ModelArch, settings: DecoderSettings):
        super().__init__()
        self.embed_tokens = Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, settings) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, settings.rms_norm_eps, settings.unit_offset_norms)
        # One table per distinct RoPE in use; families with one RoPE compute it once per forward.
        rope_keys = {}
        for kind in sorted({_layer_type(w) for w in arch.layer_windows}):
            same = [k for k in rope_keys.values() if settings.rope[k] == settings.rope[kind]]
            rope_keys[kind] = same[0] if same else kind
        self.layer_rope_keys = [rope_keys[_layer_type(w)] for w in arch.layer_windows]
        # No parameters or buffers: derived from the config, never in checkpoints.
        self.rotary = nn.ModuleDict({key: RotaryEmbedding(settings.rope[key], settings.rotary_dims)
                                     for key in sorted(set(rope_keys.values()))})
        # transformers rounds sqrt(hidden) to the weights' dtype first (55.4256 -> 55.5 in bf16).
        self.embed_scale = float(arch.hidden_size) ** 0.5 if settings.scale_embeddings else None


class DecoderForCausalLM(nn.Module):
    """The decoder and its LM head: the runtime model contract (contract.CausalModel)."""

    def __init__(self, parsed: ParsedConfig):
        super().__init__()
        self.arch: ModelArch = parsed.arch
        self.settings: DecoderSettings = parsed.settings
        self.checkpoint_layout = parsed.checkpoint_layout
        self.model = DecoderModel(self.arch, self.settings)
        self.lm_head = nn.Linear(self.arch.hidden_size, self.arch.vocab_size, bias=False)
        self.tie_weights()
        self.layer_pool_names = self.arch.layer_pool_names()

    def tie_weights(self) -> None:
        """With tied embeddings the LM head is the embedding matrix; re-run after `to_empty`."""
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                metadata: dict[str, AttentionMetadata]) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # [num_tokens, hidden]
        if self.model.embed_scale is not None:
            x = x * torch.tensor(self.model.embed_scale, dtype=torch.float32).to(x.dtype)
        rope = {key: rotary(positions, x.dtype) for key, rotary in self.model.rotary.items()}
        for layer, rope_key, kv_cache, pool_name in zip(self.model.layers, self.model.layer_rope_keys,
                                                        kv_caches, self.layer_pool_names):
            cos, sin = rope[rope_key]
            x = layer(x, cos, sin, kv_cache, metadata[pool_name])
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.settings.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        copy_checkpoint(self, state_dict)


def build_decoder(parsed: ParsedConfig) -> DecoderForCausalLM:
    return DecoderForCausalLM(parsed)
