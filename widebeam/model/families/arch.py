"""Architecture facts the KV layer and a capacity plan need, read from a Hugging Face `config.json`.

Built-in entries carry the configs of the models widebeam ships aliases for and of a few well-known
large models, so `widebeam plan` works without downloading anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from widebeam.kv.spec import CrossAttentionSpec, FullAttentionSpec, PoolSpec, SlidingWindowSpec, dtype_bytes

# The pool of an encoder-decoder model's cross-attention K/V (see CrossAttentionSpec).
CROSS_POOL = "cross"
# Model types with an encoder and a decoder: the decoder's self-attention K/V go in "self", the
# encoder output's K/V (one copy per decoder layer) in CROSS_POOL.
ENCODER_DECODER_TYPES = ("marian", "m2m100", "bart", "mbart")

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
    # Qwen/Qwen3-0.6B: q/k RMS-normed per head, head_dim 128 (not hidden / heads), no sliding window.
    "qwen3-0.6b": {
        "model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
        "max_position_embeddings": 40960, "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000, "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
        "max_window_layers": 28, "bos_token_id": 151643, "eos_token_id": 151645,
    },
    # microsoft/Phi-3-mini-4k-instruct: fused qkv_proj / gate_up_proj, every layer windowed (2047).
    "phi-3-mini-4k": {
        "model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32064,
        "max_position_embeddings": 4096, "original_max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None, "sliding_window": 2047,
        "bos_token_id": 1, "eos_token_id": 32000, "pad_token_id": 32000,
    },
}

@dataclass(frozen=True)
class ModelArch:
    """The shape of a model as the KV layer and the capacity plan see it.

    Built by the model's family entry (widebeam.model.families.table) from its config.json, the one parse
    both `widebeam plan` and the engine use.
    """

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
    # Facts only the parameter count (a plan's weight bytes) needs.
    qkv_bias: bool = False
    output_bias: bool = False
    mlp_bias: bool = False
    norms_per_layer: int = 2  # hidden-size norms in each decoder layer (Gemma 3 has four)
    qk_norm: bool = False  # a head_dim-sized norm on q and one on k in each layer
    # Encoder-decoder stacks (BART family): rows of a stored position table, LayerNorms outside the
    # layers (layernorm_embedding, the final layer_norm) in each stack, and a final_logits_bias.
    learned_position_rows: int = 0
    norms_per_stack: int = 0
    final_logits_bias: bool = True
    # Encoder-decoder facts where T5 differs from the BART family: projections without biases, RMS norms
    # (a weight, no bias), a gated MLP (wi_0, wi_1), and a relative position bias table (buckets x heads)
    # in each stack's first layer.
    linear_bias: bool = True
    rms_norm: bool = False
    gated_mlp: bool = False
    relative_attention_buckets: int = 0

    @property
    def is_encoder_decoder(self) -> bool:
        return self.num_encoder_layers > 0

    @property
    def num_params(self) -> int:
        """Parameter count of a gated-MLP decoder with this shape (norm weights included)."""
        if self.is_encoder_decoder:
            return self._encoder_decoder_params()
        h, kv_dim, q_dim = self.hidden_size, self.num_kv_heads * self.head_dim, self.num_heads * self.head_dim
        attention = h * q_dim + 2 * h * kv_dim + q_dim * h
        if self.qkv_bias:
            attention += q_dim + 2 * kv_dim
        if self.output_bias:
            attention += h
        mlp = 3 * h * self.intermediate_size
        if self.mlp_bias:
            mlp += 2 * self.intermediate_size + h
        norms = self.norms_per_layer * h + (2 * self.head_dim if self.qk_norm else 0)
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_layers * (attention + mlp + norms) + h

    def _encoder_decoder_params(self) -> int:
        """Marian/BART-style (biased projections, LayerNorms with weight and bias) or T5-style (no biases,
        RMS norms, maybe a gated MLP, relative position tables); one shared embedding matrix, a final
        logits bias where the family has one; sinusoidal positions are computed, not stored, learned
        ones (BART) are a table per stack."""
        h, q_dim = self.hidden_size, self.num_heads * self.head_dim
        attention = 4 * h * q_dim + (3 * q_dim + h if self.linear_bias else 0)
        norm = h if self.rms_norm else 2 * h

        def ffn(size: int) -> int:
            return (3 if self.gated_mlp else 2) * h * size + (size + h if self.linear_bias else 0)

        encoder = self.num_encoder_layers * (attention + ffn(self.encoder_intermediate_size) + 2 * norm)
        decoder = self.num_layers * (2 * attention + ffn(self.intermediate_size) + 3 * norm)
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        embeddings += self.vocab_size if self.final_logits_bias else 0
        stacks = 2 * (self.learned_position_rows * h + self.norms_per_stack * norm
                      + self.relative_attention_buckets * self.num_heads)
        return embeddings + encoder + decoder + stacks

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
                SlidingWindowSpec(name=f"sliding_{window}", num_layers=num_layers, window_tokens=window,
                                  **common)
            )
        if self.is_encoder_decoder:
            # every decoder layer attends the encoder output through its own K/V projections
            specs.append(CrossAttentionSpec(name=CROSS_POOL, num_layers=self.num_layers, **common))
        return specs
