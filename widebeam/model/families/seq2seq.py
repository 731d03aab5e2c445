"""The BART-shaped encoder-decoders on widebeam's paged KV cache: Marian (opus-mt), M2M100 / NLLB-200,
BART and mBART. They share one layout (biased projections, LayerNorms, fc1/fc2 feed-forward, one
embedding matrix shared by encoder, decoder and LM head) and differ in switches (`Seq2SeqConfig`):

| family  | norm placement        | positions                                  | embedding norm | final bias |
|---------|-----------------------|--------------------------------------------|----------------|------------|
| marian  | post-norm             | sinusoidal, halves sin|cos (Marian's)      | no             | yes        |
| m2m100  | pre-norm + final norm | sinusoidal (fairseq's), from padding_idx+1 | no             | no         |
| bart    | post-norm             | learned, offset 2                          | yes            | yes        |
| mbart   | pre-norm + final norm | learned, offset 2                          | yes            | yes        |

The encoder runs once per request over the source (`encode`), dense and unmasked, one source at a
time inside a padding-free batch; it writes each decoder layer's cross-attention K/V into the
'cross' pool. The decoder (`forward`) keeps its self-attention K/V in the paged 'self' pool, like
any decoder-only model, and reads the cross K/V through the request's cross block table.

Module and parameter names follow the Hugging Face checkpoints, so their safetensors load as they are.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from widebeam.model.attention.cross import CrossAttentionMetadata, cross_attention
from widebeam.model.attention.metadata import AttentionMetadata
from widebeam.model.attention.paged import PagedAttention, write_kv
from widebeam.model.families.arch import CROSS_POOL, ModelArch
from widebeam.model.families.checkpoint import copy_checkpoint
from widebeam.model.families.layers import Embedding
from widebeam.model.families.seq2seq_config import LEARNED, M2M100_SINUSOIDAL, MARIAN_SINUSOIDAL

ACTIVATIONS = {"swish": F.silu, "silu": F.silu, "gelu": F.gelu, "relu": F.relu,
               "gelu_new": lambda x: F.gelu(x, approximate="tanh")}

_SHARED = "model.shared.weight"
_TIED_TO_SHARED = ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight")


@dataclass(frozen=True)
class Seq2SeqConfig:
    """A BART-family model's switches; the defaults are Marian's (opus-mt)."""

    arch: ModelArch
    encoder_heads: int
    activation: str
    embed_scale: float
    decoder_start_token_id: int
    normalize_before: bool = False  # pre-norm layers, and a final layer_norm after each stack
    layernorm_embedding: bool = False  # LayerNorm over token + position embeddings (BART, mBART)
    positions: str = MARIAN_SINUSOIDAL
    position_offset: int = 0  # table row of position 0 (M2M100: padding_idx + 1; BART: 2)
    final_logits_bias: bool = True


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


def m2m100_sinusoidal_table(num_rows: int, dim: int, padding_idx: int) -> torch.Tensor:
    """HF's M2M100SinusoidalPositionalEmbedding.get_embedding (fairseq's): frequencies
    exp(-i log(10000) / (dim/2 - 1)), all sines then all cosines, a zero column for an odd dim and a
    zero row at padding_idx; float32 arithmetic in the same order, so the table is bit-equal. On the
    CPU whatever the default device (the model is built on the meta device)."""
    half_dim = dim // 2
    step = math.log(10000) / (half_dim - 1)
    freqs = torch.exp(torch.arange(half_dim, dtype=torch.int64, device="cpu").float() * -step)
    angles = torch.arange(num_rows, dtype=torch.int64, device="cpu").float().unsqueeze(1) * freqs.unsqueeze(0)
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1).view(num_rows, -1)
    if dim % 2 == 1:
        table = torch.cat([table, torch.zeros(num_rows, 1, device="cpu")], dim=1)
    table[padding_idx, :] = 0
    return table.float()


class SinusoidalPositions(nn.Module):
    """Position table derived from the config; kept out of the state dict (checkpoints do not
    carry it) and off the meta device the model is built on, moved to each device on first use."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self._table_cpu = table
        self._by_device: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def forward(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        key = (rows.device, dtype)
        if key not in self._by_device:
            self._by_device[key] = self._table_cpu.to(device=rows.device, dtype=dtype)
        return self._by_device[key][rows]


class LearnedPositions(Embedding):
    """BART's learned table (in the checkpoint as `embed_positions.weight`), `offset` rows longer."""

    def forward(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return super().forward(rows).to(dtype)


def _position_table(cfg: Seq2SeqConfig) -> nn.Module:
    arch = cfg.arch
    num_rows = arch.max_position_embeddings + cfg.position_offset
    if cfg.positions == LEARNED:
        return LearnedPositions(num_rows, arch.hidden_size)
    if cfg.positions == M2M100_SINUSOIDAL:
        # HF builds max_position_embeddings + 2 rows; with padding_idx 1 that is this table exactly
        return SinusoidalPositions(m2m100_sinusoidal_table(num_rows, arch.hidden_size,
                                                           cfg.position_offset - 1))
    if cfg.positions == MARIAN_SINUSOIDAL:
        return SinusoidalPositions(sinusoidal_table(num_rows, arch.hidden_size))
    raise ValueError(f"positions must be one of {MARIAN_SINUSOIDAL}, {M2M100_SINUSOIDAL}, {LEARNED}; "
                     f"got {cfg.positions!r}")


class Seq2SeqAttention(nn.Module):
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


class _Sublayers(nn.Module):
    """Residual sub-blocks with the norm placement of the family: post-norm normalises the sum
    (Marian, BART), pre-norm the block's input (M2M100, mBART)."""

    def __init__(self, cfg: Seq2SeqConfig, intermediate_size: int):
        super().__init__()
        h = cfg.arch.hidden_size
        self.fc1 = nn.Linear(h, intermediate_size)
        self.fc2 = nn.Linear(intermediate_size, h)
        self.final_layer_norm = nn.LayerNorm(h)
        self.act = ACTIVATIONS[cfg.activation]
        self.normalize_before = cfg.normalize_before

    def residual(self, x: torch.Tensor, norm: nn.LayerNorm, block) -> torch.Tensor:
        if self.normalize_before:
            return x + block(norm(x))
        return norm(x + block(x))

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Seq2SeqEncoderLayer(_Sublayers):
    def __init__(self, cfg: Seq2SeqConfig):
        super().__init__(cfg, cfg.arch.encoder_intermediate_size)
        h = cfg.arch.hidden_size
        self.self_attn = Seq2SeqAttention(h, cfg.encoder_heads)
        self.self_attn_layer_norm = nn.LayerNorm(h)

    def forward(self, x: torch.Tensor, query_start_loc: list[int]) -> torch.Tensor:
        x = self.residual(x, self.self_attn_layer_norm,
                          lambda y: self.self_attn.encoder_forward(y, query_start_loc))
        return self.residual(x, self.final_layer_norm, self.feed_forward)


class Seq2SeqDecoderLayer(_Sublayers):
    def __init__(self, cfg: Seq2SeqConfig):
        super().__init__(cfg, cfg.arch.intermediate_size)
        h = cfg.arch.hidden_size
        self.self_attn = Seq2SeqAttention(h, cfg.arch.num_heads)
        self.self_attn_layer_norm = nn.LayerNorm(h)
        self.encoder_attn = Seq2SeqAttention(h, cfg.arch.num_heads)
        self.encoder_attn_layer_norm = nn.LayerNorm(h)

    def forward(self, x, self_kv, self_meta, cross_kv, cross_meta):
        x = self.residual(x, self.self_attn_layer_norm,
                          lambda y: self.self_attn.self_forward(y, self_kv, self_meta))
        x = self.residual(x, self.encoder_attn_layer_norm,
                          lambda y: self.encoder_attn.cross_forward(y, cross_kv, cross_meta))
        return self.residual(x, self.final_layer_norm, self.feed_forward)


class Seq2SeqStack(nn.Module):
    """Encoder or decoder: token embeddings (the shared matrix), positions, the optional embedding
    norm, layers, and (pre-norm families) the final layer_norm."""

    def __init__(self, cfg: Seq2SeqConfig, layers: list[nn.Module]):
        super().__init__()
        arch = cfg.arch
        self.embed_tokens = Embedding(arch.vocab_size, arch.hidden_size)
        self.embed_positions = _position_table(cfg)
        self.position_offset = cfg.position_offset
        if cfg.layernorm_embedding:
            self.layernorm_embedding = nn.LayerNorm(arch.hidden_size)
        self.layers = nn.ModuleList(layers)
        if cfg.normalize_before:
            self.layer_norm = nn.LayerNorm(arch.hidden_size)
        self.embed_scale = cfg.embed_scale

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids) * self.embed_scale
        x = x + self.embed_positions(positions + self.position_offset, x.dtype)
        norm = getattr(self, "layernorm_embedding", None)
        return norm(x) if norm is not None else x

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        norm = getattr(self, "layer_norm", None)
        return norm(x) if norm is not None else x


class Seq2SeqModel(nn.Module):
    def __init__(self, cfg: Seq2SeqConfig):
        super().__init__()
        arch = cfg.arch
        self.shared = Embedding(arch.vocab_size, arch.hidden_size)
        self.encoder = Seq2SeqStack(cfg, [Seq2SeqEncoderLayer(cfg) for _ in range(arch.num_encoder_layers)])
        self.decoder = Seq2SeqStack(cfg, [Seq2SeqDecoderLayer(cfg) for _ in range(arch.num_layers)])


class Seq2SeqLM(nn.Module):
    """`encode` fills the cross pool once per request; `forward` runs decoder tokens and returns hidden
    states; `compute_logits` the float32 logits (LM head, + final_logits_bias where the family has it)."""

    def __init__(self, cfg: Seq2SeqConfig):
        super().__init__()
        self.config = cfg
        self.arch = cfg.arch
        self.decoder_start_token_id = cfg.decoder_start_token_id
        self.model = Seq2SeqModel(cfg)
        self.lm_head = nn.Linear(cfg.arch.hidden_size, cfg.arch.vocab_size, bias=False)
        if cfg.final_logits_bias:
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

    def encoder_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       query_start_loc: list[int]) -> torch.Tensor:
        """The encoder's output over a padding-free batch of sources (HF's last_hidden_state)."""
        encoder = self.model.encoder
        x = encoder.embed(input_ids, positions)
        for layer in encoder.layers:
            x = layer(x, query_start_loc)
        return encoder.final_norm(x)

    def encode(self, input_ids: torch.Tensor, positions: torch.Tensor, query_start_loc: list[int],
               cross_kv_caches: list[tuple[torch.Tensor, torch.Tensor]], slot_mapping: torch.Tensor) -> None:
        """Run the encoder over a padding-free batch of sources and write every decoder layer's
        cross-attention K/V of the output at `slot_mapping` (one slot per source token)."""
        x = self.encoder_hidden(input_ids, positions, query_start_loc)
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
        return decoder.final_norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.config.final_logits_bias:
            logits = logits + self.final_logits_bias
        return logits.float()

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        if self.config.positions != LEARNED:
            # sinusoidal tables are computed here; older exports stored them (or a _float_tensor)
            state_dict = {k: v for k, v in state_dict.items()
                          if not k.startswith(("model.encoder.embed_positions.",
                                               "model.decoder.embed_positions."))}
        else:
            state_dict = dict(state_dict)
        self.tie_weights()
        if _SHARED in state_dict:
            for name in _TIED_TO_SHARED:
                state_dict.setdefault(name, state_dict[_SHARED])
        if self.config.final_logits_bias:
            if "final_logits_bias" not in state_dict:  # optional in HF too (zeros)
                state_dict["final_logits_bias"] = torch.zeros(1, self.arch.vocab_size)
        else:
            state_dict.pop("final_logits_bias", None)
        copy_checkpoint(self, state_dict)
