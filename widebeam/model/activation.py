"""The one activation estimate: memory the largest steps need beside the weights and the KV cache.

Used through the start-up layout (layout.py: `estimate_activation_reserve`) by `widebeam plan` and by
the engine when the user sizes the cache (`kv_cache_memory`); without that setting the engine
measures the same two steps at warm-up instead (warmup.py), and falls back to this where the host
cannot reset its peak-memory counter. The decode step's rows are the layout's rule
(`activation_rows`: W x (1 + 2D) with speculation). Torch-free.
"""

from __future__ import annotations

from widebeam.kv.spec import dtype_bytes

# Logits and log-probs are always float32.
_LOGITS_BYTES = 4


def estimate_activation_peak_bytes(arch, max_num_batched_tokens: int, decode_rows: int,
                                   dtype: str = "float32") -> int:
    """The largest tensors of the two steps warm-up runs: a prefill chunk of
    `max_num_batched_tokens` tokens (hidden states and MLP intermediates in `dtype`, plus the
    float32 attention scores of the chunk's queries over its own keys, which the plain-PyTorch
    path materialises) and a decode step of `decode_rows` rows of logits (their logits and
    log-probs over the vocabulary)."""
    chunk = max_num_batched_tokens
    hidden = chunk * (4 * arch.hidden_size + 3 * arch.intermediate_size) * dtype_bytes(dtype)
    scores = arch.num_heads * chunk * chunk * _LOGITS_BYTES
    logits = 2 * decode_rows * arch.vocab_size * _LOGITS_BYTES
    return hidden + scores + logits
