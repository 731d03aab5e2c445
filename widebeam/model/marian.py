"""Marian (MarianMTModel, the Helsinki-NLP opus-mt translation models) on widebeam's paged KV cache.

An encoder-decoder transformer: post-norm layers (LayerNorm after each residual add), biased
projections, sinusoidal positions (computed, never stored), embeddings scaled by sqrt(d_model),
one embedding matrix shared by encoder, decoder and LM head, and a `final_logits_bias`.

The encoder runs once per request over the source (`encode`), dense and unmasked, one source at a
time inside a padding-free batch; it writes each decoder layer's cross-attention K/V into the
'cross' pool. The decoder (`forward`) keeps its self-attention K/V in the paged 'self' pool, like
any decoder-only model, and reads the cross K/V through the request's cross block table.

Module and parameter names follow the Hugging Face checkpoint, so its safetensors load as they are.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from widebeam.model.arch import CROSS_POOL, ModelArch
from widebeam.model.attention_metadata import AttentionMetadata
from widebeam.model.cross_attention import CrossAttentionMetadata, cross_attention
from widebeam.model.paged_attention import PagedAttention, write_kv
from widebeam.model.weights import copy_checkpoint

ACTIVATIONS = {"swish": F.silu, "silu": F.silu, "gelu": F.gelu, "relu": F.relu,
               "gelu_new": lambda x: F.gelu(x, approximate="tanh")}

# Tensors a checkpoint may carry that this model computes instead (older exports stored them).
_COMPUTED_TENSORS = ("model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight")
_SHARED = "model.shared.weight"
_TIED_TO_SHARED = ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight")


@dataclass(frozen=True)
class MarianConfig:
    arch: ModelArch
    encoder_heads: int
    activation: str
    embed_scale: float
    decoder_start_token_id: int


def sinusoidal_table(num_positions: int, dim: int) -> torch.Tensor:
    """HF's MarianSinusoidalPositionalEmbedding weight: sines in the first half, cosines in the second
    (not interleaved), computed in float64 and stored as float32, on the CPU."""
    j = np.arange(dim)
    angles = np.arange(num_positions)[:, None] / np.power(10000, 2 * (j // 2) / dim)[None, :]
    out = torch.empty(num_positions, dim, dtype=torch.float32, device="cpu")
    sentinel = dim // 2 if dim % 2 == 0 else dim // 2 + 1
    out[:, :sentinel] = torch.from_numpy(np.sin(angles[:, 0::2])).float()
    out[:, sentinel:] = torch.from_numpy(np.cos(angles[:, 1::2])).float()
    return out


class SinusoidalPositions(nn.Module):
    """Position table derived from the config; kept out of the state dict (checkpoints do not
    carry it) and off the meta device the model is built on, moved to each device on first use."""

    def __init__(self, num_positions: int, dim: int):
        super().__init__()
        self._table_cpu = sinusoidal_table(num_positions, dim)
        self._by_device: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        key = (positions.device, dtype)
        if key not in self._by_device:
            self._by_device[key] = self._table_cpu.to(device=positions.device, dtype=dtype)
        return self._by_device[key][positions]


class MarianAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.k_proj = nn.Linear(hidden_size, hidden_size)
        self.v_proj = nn.Linear(hidden_size, hidden_size)
        self.q_proj = nn.Linear(hidden_size, hidden_size)
        self.out_proj = nn.Linear(hidden_size, hidden_size)
        self.scale = self.head_dim**-0.5
        self.attn = PagedAttention(num_heads, num_heads, self.head_dim, self.scale)  # decoder self-attention

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], self.num_heads, self.head_dim)

    def project_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.heads(self.k_proj(x)), self.heads(self.v_proj(x))

    def output(self, out: torch.Tensor) -> torch.Tensor:
        return self.out_proj(out.reshape(out.shape[0], self.num_heads * self.head_dim))

    def encoder_forward(self, x: torch.Tensor, query_start_loc: list[int]) -> torch.Tensor:
        """Dense bidirectional attention within each source of a padding-free batch."""
        q, (k, v) = self.heads(self.q_proj(x)), self.project_kv(x)
        out = torch.empty_like(q)
        for start, end in itertools.pairwise(query_start_loc):
            scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k[start:end].float()) * self.scale
            out[start:end] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1),
                                          v[start:end].float()).to(q.dtype)
        return self.output(out)

    def self_forward(self, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                     meta: AttentionMetadata) -> torch.Tensor:
        q, (k, v) = self.heads(self.q_proj(x)), self.project_kv(x)
        return self.output(self.attn(q, k, v, kv_cache, meta))

    def cross_forward(self, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                      meta: CrossAttentionMetadata) -> torch.Tensor:
        q = self.heads(self.q_proj(x))
        return self.output(cross_attention(q, kv_cache[0], kv_cache[1], meta, self.scale))


def _feed_forward(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """fc1 -> activation -> fc2; the layers own fc1/fc2 directly, as the checkpoint names them."""
    return layer.fc2(layer.act(layer.fc1(x)))


class MarianEncoderLayer(nn.Module):
    def __init__(self, cfg: MarianConfig):
        super().__init__()
        h = cfg.arch.hidden_size
        self.self_attn = MarianAttention(h, cfg.encoder_heads)
        self.self_attn_layer_norm = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, cfg.arch.encoder_intermediate_size)
        self.fc2 = nn.Linear(cfg.arch.encoder_intermediate_size, h)
        self.final_layer_norm = nn.LayerNorm(h)
        self.act = ACTIVATIONS[cfg.activation]

    def forward(self, x: torch.Tensor, query_start_loc: list[int]) -> torch.Tensor:
        x = self.self_attn_layer_norm(x + self.self_attn.encoder_forward(x, query_start_loc))
        return self.final_layer_norm(x + _feed_forward(self, x))


class MarianDecoderLayer(nn.Module):
    def __init__(self, cfg: MarianConfig):
        super().__init__()
        h = cfg.arch.hidden_size
        self.self_attn = MarianAttention(h, cfg.arch.num_heads)
        self.self_attn_layer_norm = nn.LayerNorm(h)
        self.encoder_attn = MarianAttention(h, cfg.arch.num_heads)
        self.encoder_attn_layer_norm = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, cfg.arch.intermediate_size)
        self.fc2 = nn.Linear(cfg.arch.intermediate_size, h)
        self.final_layer_norm = nn.LayerNorm(h)
        self.act = ACTIVATIONS[cfg.activation]

    def forward(self, x, self_kv, self_meta, cross_kv, cross_meta):
        x = self.self_attn_layer_norm(x + self.self_attn.self_forward(x, self_kv, self_meta))
        x = self.encoder_attn_layer_norm(x + self.encoder_attn.cross_forward(x, cross_kv, cross_meta))
        return self.final_layer_norm(x + _feed_forward(self, x))


class MarianStack(nn.Module):
    """Encoder or decoder: token embeddings (the shared matrix), positions, layers."""

    def __init__(self, cfg: MarianConfig, layers: list[nn.Module]):
        super().__init__()
        arch = cfg.arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.embed_positions = SinusoidalPositions(arch.max_position_embeddings, arch.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.embed_scale = cfg.embed_scale

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids) * self.embed_scale
        return x + self.embed_positions(positions, x.dtype)


class MarianModel(nn.Module):
    def __init__(self, cfg: MarianConfig):
        super().__init__()
        arch = cfg.arch
        self.shared = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.encoder = MarianStack(cfg, [MarianEncoderLayer(cfg) for _ in range(arch.num_encoder_layers)])
        self.decoder = MarianStack(cfg, [MarianDecoderLayer(cfg) for _ in range(arch.num_layers)])


class MarianMTModel(nn.Module):
    """`encode` fills the cross pool once per request; `forward` runs decoder tokens and returns hidden
    states; `compute_logits` the float32 logits (LM head + final_logits_bias)."""

    def __init__(self, cfg: MarianConfig):
        super().__init__()
        self.config = cfg
        self.arch = cfg.arch
        self.decoder_start_token_id = cfg.decoder_start_token_id
        self.model = MarianModel(cfg)
        self.lm_head = nn.Linear(cfg.arch.hidden_size, cfg.arch.vocab_size, bias=False)
        # A parameter, not a buffer, so `copy_checkpoint` fills it; it is never trained here.
        self.final_logits_bias = nn.Parameter(torch.zeros(1, cfg.arch.vocab_size), requires_grad=False)
        self.layer_pool_names = cfg.arch.layer_pool_names()  # decoder layers: self pool, then cross pool
        self.tie_weights()

    def tie_weights(self) -> None:
        """One matrix for both embeddings (and the LM head when tied); re-run after `to_empty`."""
        shared = self.model.shared.weight
        self.model.encoder.embed_tokens.weight = shared
        self.model.decoder.embed_tokens.weight = shared
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = shared

    def encode(self, input_ids: torch.Tensor, positions: torch.Tensor, query_start_loc: list[int],
               cross_kv_caches: list[tuple[torch.Tensor, torch.Tensor]], slot_mapping: torch.Tensor) -> None:
        """Run the encoder over a padding-free batch of sources and write every decoder layer's
        cross-attention K/V of the output at `slot_mapping` (one slot per source token)."""
        encoder = self.model.encoder
        x = encoder.embed(input_ids, positions)
        for layer in encoder.layers:
            x = layer(x, query_start_loc)
        for layer, (k_cache, v_cache) in zip(self.model.decoder.layers, cross_kv_caches):
            k, v = layer.encoder_attn.project_kv(x)
            write_kv(k_cache, v_cache, k, v, slot_mapping)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], metadata: dict) -> torch.Tensor:
        decoder = self.model.decoder
        x = decoder.embed(input_ids, positions)
        num_layers = self.arch.num_layers
        self_pool = self.layer_pool_names[0]
        for layer, self_kv, cross_kv in zip(decoder.layers, kv_caches[:num_layers], kv_caches[num_layers:]):
            x = layer(x, self_kv, metadata[self_pool], cross_kv, metadata[CROSS_POOL])
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (self.lm_head(hidden) + self.final_logits_bias).float()

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        state_dict = {k: v for k, v in state_dict.items() if k not in _COMPUTED_TENSORS}
        self.tie_weights()
        if _SHARED in state_dict:
            for name in _TIED_TO_SHARED:
                state_dict.setdefault(name, state_dict[_SHARED])
        if "final_logits_bias" not in state_dict:  # optional in HF too (zeros)
            state_dict["final_logits_bias"] = torch.zeros(1, self.arch.vocab_size)
        copy_checkpoint(self, state_dict)
