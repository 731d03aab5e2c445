"""T5 / mT5 / T5 v1.1 / flan-T5 (T5ForConditionalGeneration, MT5ForConditionalGeneration) on widebeam's
paged KV cache.

An encoder-decoder transformer: pre-norm layers with T5's RMS norm (no mean, no bias, variance in
float32), bias-free projections, no attention scaling (the 1/sqrt(d) is folded into the weights in
training), and no absolute positions: a learned relative position bias per head, bucketed by key -
query distance, bidirectional in the encoder, causal in the decoder's self-attention, none in the
cross-attention. As in transformers, the bias table lives in the first block of each stack and is
computed once per stack and pass, then added in every layer. The feed-forward is ReLU (T5 v1.0) or
gated GELU (v1.1, mT5, flan-T5). T5 v1.0 ties the LM head to the embeddings and scales the decoder
output by d_model**-0.5 first; the later variants have their own head and no scaling.

The encoder runs once per request (`encode`), dense within each source, and writes every decoder
layer's cross K/V in the 'cross' pool; the decoder (`forward`) keeps its self-attention K/V in the
paged 'self' pool and adds its relative bias through the attention backend (`PositionBias`).

Module and parameter names follow the Hugging Face checkpoint (shared.weight, encoder.block.N.layer.0.
SelfAttention.q, ..., lm_head.weight), so its safetensors load as they are.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import nn
from torch.nn import functional as F

from widebeam.model.attention.cross import cross_attention
from widebeam.model.attention.metadata import PositionBias
from widebeam.model.attention.paged import PagedAttention, write_kv
from widebeam.model.families.arch import CROSS_POOL, ModelArch
from widebeam.model.families.checkpoint import copy_checkpoint
from widebeam.model.families.layers import Embedding
from widebeam.model.families.t5_config import T5Settings

T5_ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu, "swish": F.silu,
                  "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                  "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}

# transformers never builds it (cross-attention has no position bias) but old exports may carry it.
_IGNORED_TENSORS = ("decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight",)
_TIED_TO_SHARED = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")


def relative_position_bucket(relative_position: torch.Tensor, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> torch.Tensor:
    """transformers' T5Attention._relative_position_bucket: relative_position = key - query. Half the
    buckets (per direction when bidirectional) are exact distances, the rest log-spaced up to
    `max_distance`; a causal stack folds every key after the query into bucket 0 (masked anyway)."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).to(torch.long) * num_buckets
        relative_position = relative_position.abs()
    else:
        relative_position = -torch.clamp(relative_position, max=0)
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    large = max_exact + (torch.log(relative_position.float() / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).to(torch.long)
    large = torch.clamp(large, max=num_buckets - 1)
    return buckets + torch.where(is_small, relative_position, large)


class T5LayerNorm(nn.Module):
    """RMS norm: no mean subtraction, no bias; the variance in float32 (transformers' T5LayerNorm)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            x = x.to(self.weight.dtype)
        return self.weight * x


class T5Attention(nn.Module):
    def __init__(self, arch: ModelArch, settings: T5Settings, has_relative_attention_bias: bool,
                 bidirectional: bool):
        super().__init__()
        self.num_heads, self.head_dim = arch.num_heads, arch.head_dim
        inner = arch.num_heads * arch.head_dim
        self.q = nn.Linear(arch.hidden_size, inner, bias=False)
        self.k = nn.Linear(arch.hidden_size, inner, bias=False)
        self.v = nn.Linear(arch.hidden_size, inner, bias=False)
        self.o = nn.Linear(inner, arch.hidden_size, bias=False)
        self.bidirectional = bidirectional
        self.num_buckets = settings.relative_attention_num_buckets
        self.max_distance = settings.relative_attention_max_distance
        if has_relative_attention_bias:
            self.relative_attention_bias = Embedding(self.num_buckets, self.num_heads)
        self.attn = PagedAttention(self.num_heads, self.num_heads, self.head_dim, 1.0)  # T5: no scaling

    def position_bias(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """[H, *shape] for broadcastable query and key positions (this stack's direction)."""
        buckets = relative_position_bucket(key_positions - query_positions, self.bidirectional,
                                           self.num_buckets, self.max_distance)
        return self.relative_attention_bias(buckets).movedim(-1, 0)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], self.num_heads, self.head_dim)

    def project_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.heads(self.k(x)), self.heads(self.v(x))

    def output(self, out: torch.Tensor) -> torch.Tensor:
        return self.o(out.reshape(out.shape[0], self.num_heads * self.head_dim))

    def encoder_forward(self, x: torch.Tensor, query_start_loc: list[int],
                        biases: list[torch.Tensor]) -> torch.Tensor:
        """Dense bidirectional attention within each source, its bias [H, E, E] added."""
        q, (k, v) = self.heads(self.q(x)), self.project_kv(x)
        out = torch.empty_like(q)
        for (start, end), bias in zip(itertools.pairwise(query_start_loc), biases):
            out[start:end] = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1)[None], k[start:end].transpose(0, 1)[None],
                v[start:end].transpose(0, 1)[None], attn_mask=bias.to(q.dtype)[None], scale=1.0,
            )[0].transpose(0, 1)
        return self.output(out)

    def self_forward(self, x, kv_cache, meta, position_bias: PositionBias) -> torch.Tensor:
        q, (k, v) = self.heads(self.q(x)), self.project_kv(x)
        return self.output(self.attn(q, k, v, kv_cache, meta, position_bias))

    def cross_forward(self, x, kv_cache, meta) -> torch.Tensor:
        return self.output(cross_attention(self.heads(self.q(x)), kv_cache[0], kv_cache[1], meta, 1.0))


class T5LayerSelfAttention(nn.Module):
    def __init__(self, arch, settings, has_relative_attention_bias: bool, bidirectional: bool):
        super().__init__()
        self.SelfAttention = T5Attention(arch, settings, has_relative_attention_bias, bidirectional)
        self.layer_norm = T5LayerNorm(arch.hidden_size, settings.layer_norm_epsilon)


class T5LayerCrossAttention(nn.Module):
    def __init__(self, arch, settings):
        super().__init__()
        self.EncDecAttention = T5Attention(arch, settings, False, bidirectional=True)
        self.layer_norm = T5LayerNorm(arch.hidden_size, settings.layer_norm_epsilon)


class T5DenseReluDense(nn.Module):
    """wi -> act -> wo (T5 v1.0), or act(wi_0) * wi_1 -> wo (gated: v1.1, mT5, flan-T5)."""

    def __init__(self, hidden_size: int, d_ff: int, settings: T5Settings):
        super().__init__()
        self.gated = settings.gated
        if self.gated:
            self.wi_0 = nn.Linear(hidden_size, d_ff, bias=False)
            self.wi_1 = nn.Linear(hidden_size, d_ff, bias=False)
        else:
            self.wi = nn.Linear(hidden_size, d_ff, bias=False)
        self.wo = nn.Linear(d_ff, hidden_size, bias=False)
        self.act = T5_ACTIVATIONS[settings.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.wo(self.act(self.wi_0(x)) * self.wi_1(x))
        return self.wo(self.act(self.wi(x)))


class T5LayerFF(nn.Module):
    def __init__(self, arch, settings, d_ff: int):
        super().__init__()
        self.DenseReluDense = T5DenseReluDense(arch.hidden_size, d_ff, settings)
        self.layer_norm = T5LayerNorm(arch.hidden_size, settings.layer_norm_epsilon)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.DenseReluDense(self.layer_norm(x))


class T5Block(nn.Module):
    """layer[0] self-attention, (decoder) layer[1] cross-attention, then the feed-forward; each
    pre-norm with a residual add, as the checkpoint nests them."""

    def __init__(self, arch: ModelArch, settings: T5Settings, first: bool, is_decoder: bool):
        super().__init__()
        layers: list[nn.Module] = [T5LayerSelfAttention(arch, settings, first, bidirectional=not is_decoder)]
        if is_decoder:
            layers.append(T5LayerCrossAttention(arch, settings))
        d_ff = arch.intermediate_size if is_decoder else arch.encoder_intermediate_size
        layers.append(T5LayerFF(arch, settings, d_ff))
        self.layer = nn.ModuleList(layers)

    def encoder_forward(self, x, query_start_loc, biases):
        attention = self.layer[0]
        x = x + attention.SelfAttention.encoder_forward(attention.layer_norm(x), query_start_loc, biases)
        return self.layer[1](x)

    def decoder_forward(self, x, self_kv, self_meta, position_bias, cross_kv, cross_meta):
        attention, cross = self.layer[0], self.layer[1]
        x = x + attention.SelfAttention.self_forward(attention.layer_norm(x), self_kv, self_meta,
                                                     position_bias)
        x = x + cross.EncDecAttention.cross_forward(cross.layer_norm(x), cross_kv, cross_meta)
        return self.layer[2](x)


class T5Stack(nn.Module):
    def __init__(self, arch: ModelArch, settings: T5Settings, num_layers: int, is_decoder: bool):
        super().__init__()
        self.embed_tokens = Embedding(arch.vocab_size, arch.hidden_size)
        self.block = nn.ModuleList([T5Block(arch, settings, i == 0, is_decoder) for i in range(num_layers)])
        self.final_layer_norm = T5LayerNorm(arch.hidden_size, settings.layer_norm_epsilon)

    def position_bias(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """The stack's bias, from the table in its first block (computed once, added in every layer)."""
        return self.block[0].layer[0].SelfAttention.position_bias(query_positions, key_positions)


class T5ForConditionalGeneration(nn.Module):
    """`encode` fills the cross pool once per request; `forward` runs decoder tokens and returns the
    final-normed hidden states; `compute_logits` the float32 logits (v1.0's output scaling included)."""

    # Past 8 rows the encoder's float32 linears and the cross K/V projections keep F.linear
    # (linears/split.py): T5's activations are large (no scaling in its feed-forward or attention), so
    # another library's summation order moves the encoder's cross K/V by up to 3e-4 on t5-small's shape,
    # past the 2e-4 its parity suite holds them to. The decoder's own linears (a step's W x sources rows,
    # where MKL's sgemm is slowest) take oneDNN where the start-up probe finds it faster.
    @staticmethod
    def keeps_f_linear(name: str) -> bool:
        return name.startswith("encoder.") or name.endswith(("EncDecAttention.k", "EncDecAttention.v"))

    def __init__(self, arch: ModelArch, settings: T5Settings):
        super().__init__()
        self.arch, self.settings = arch, settings
        self.decoder_start_token_id = settings.decoder_start_token_id
        self.shared = Embedding(arch.vocab_size, arch.hidden_size)
        self.encoder = T5Stack(arch, settings, arch.num_encoder_layers, is_decoder=False)
        self.decoder = T5Stack(arch, settings, arch.num_layers, is_decoder=True)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.output_scale = arch.hidden_size**-0.5 if settings.scale_decoder_outputs else None
        self.layer_pool_names = arch.layer_pool_names()  # decoder layers: self pool, then cross pool
        self.tie_weights()

    def tie_weights(self) -> None:
        """One matrix for both embeddings (and the LM head when tied); re-run after `to_empty`."""
        self.encoder.embed_tokens.weight = self.shared.weight
        self.decoder.embed_tokens.weight = self.shared.weight
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.shared.weight

    def encode(self, input_ids: torch.Tensor, positions: torch.Tensor, query_start_loc: list[int],
               cross_kv_caches: list[tuple[torch.Tensor, torch.Tensor]], slot_mapping: torch.Tensor) -> None:
        encoder = self.encoder
        x = encoder.embed_tokens(input_ids)
        biases = []
        for start, end in itertools.pairwise(query_start_loc):
            source_positions = positions[start:end]
            biases.append(encoder.position_bias(source_positions[:, None], source_positions[None, :]))
        for block in encoder.block:
            x = block.encoder_forward(x, query_start_loc, biases)
        x = encoder.final_layer_norm(x)
        for block, (k_cache, v_cache) in zip(self.decoder.block, cross_kv_caches):
            k, v = block.layer[1].EncDecAttention.project_kv(x)
            write_kv(k_cache, v_cache, k, v, slot_mapping)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], metadata: dict) -> torch.Tensor:
        decoder = self.decoder
        x = decoder.embed_tokens(input_ids)
        num_layers = self.arch.num_layers
        self_pool = self.layer_pool_names[0]
        # one bias per pass: the first layer computes each sequence's, the others reuse it
        bias = PositionBias(decoder.position_bias, x.device)
        for block, self_kv, cross_kv in zip(decoder.block, kv_caches[:num_layers], kv_caches[num_layers:]):
            x = block.decoder_forward(x, self_kv, metadata[self_pool], bias, cross_kv, metadata[CROSS_POOL])
        return decoder.final_layer_norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.output_scale is not None:
            hidden = hidden * self.output_scale
        return self.lm_head(hidden).float()

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        state_dict = {k: v for k, v in state_dict.items() if k not in _IGNORED_TENSORS}
        self.tie_weights()
        if "shared.weight" in state_dict:  # transformers saves the tied embeddings once
            for name in _TIED_TO_SHARED:
                state_dict.setdefault(name, state_dict["shared.weight"])
        copy_checkpoint(self, state_dict)


def build_t5(parsed) -> T5ForConditionalGeneration:
    """The family table's builder (table.py: the `t5` row), from a ParsedConfig."""
    return T5ForConditionalGeneration(parsed.arch, parsed.settings)
