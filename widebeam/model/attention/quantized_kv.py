"""An int8 KV cache: each token's K (or V) of each KV head as head_dim int8 values and one float32 scale.

Symmetric quantization per token and KV head: scale = max |x| / 127 over the head's values, stored
value = round(x / scale). Why per token and head: a token's K/V are written once, when they are
computed, and never requantized (a later token in the same block changes nothing of an earlier one),
so copy-on-write, forks and prefix reuse move a token's scale with its slot and nothing else, and a
cached prefix block reads back bit for bit what its first request wrote. The scales are counted in
the pool's bytes (kv/spec.py: `KV_SCALE_BYTES`): at head_dim 64 a token costs 68 bytes per head
against 256 in float32 and 128 in bfloat16.

A layer's K (or V) is a `QuantizedKV`: it answers the two reads attention makes of a cache tensor
(`index_select` of slots, a slice of consecutive slots) dequantized into `read_dtype`, so every
attention path reads it as it reads a float cache; the decode groups' shared prefix is read in
chunks (backends.py: `_prefix_attention`), so no full-precision copy of a prompt's K/V is made.
"""

from __future__ import annotations

import torch

INT8_MAX = 127.0
# The smallest scale stored: a head of all zeros quantizes to zeros, not to 0 / 0.
_MIN_SCALE = 1e-12


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [tokens, kv_heads, head_dim] -> (int8 values [tokens, kv_heads, head_dim], float32 scales
    [tokens, kv_heads, 1])."""
    x = x.float()
    scales = (x.abs().amax(dim=-1, keepdim=True) / INT8_MAX).clamp_min_(_MIN_SCALE)
    values = torch.round(x / scales).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return values, scales


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 values [..., kv_heads, head_dim] and their scales [..., kv_heads, 1] -> `dtype`; the product
    in float32, then one rounding to `dtype`."""
    out = values.to(torch.float32).mul_(scales)
    return out if dtype == torch.float32 else out.to(dtype)


class QuantizedKV:
    """One layer's K (or V): `values` int8 [num_slots, kv_heads, head_dim] and `scales` float32
    [num_slots, kv_heads, 1] (views of the runner's pool tensors). Reads come back in `read_dtype`."""

    def __init__(self, values: torch.Tensor, scales: torch.Tensor, read_dtype: torch.dtype):
        self.values = values
        self.scales = scales
        self.read_dtype = read_dtype

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def dtype(self) -> torch.dtype:
        """The dtype reads come back in (what attention computes with)."""
        return self.read_dtype

    @property
    def device(self) -> torch.device:
        return self.values.device

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        """The slots `index` (dim 0), dequantized: [len(index), kv_heads, head_dim]."""
        if dim != 0:
            raise ValueError("a KV cache is read by slot (dim 0)")
        return dequantize(self.values.index_select(0, index), self.scales.index_select(0, index),
                          self.read_dtype)

    def __getitem__(self, key: slice) -> torch.Tensor:
        """A run of consecutive slots, dequantized."""
        if not isinstance(key, slice):
            raise TypeError("a quantized KV cache is read by slot ranges or index_select")
        return dequantize(self.values[key], self.scales[key], self.read_dtype)

    def write(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Quantize x [tokens, kv_heads, head_dim] into `slots`."""
        values, scales = quantize(x)
        self.values.index_copy_(0, slots, values)
        self.scales.index_copy_(0, slots, scales)
