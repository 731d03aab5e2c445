"""An int8 KV cache: each token's K (or V) of each KV head as head_dim int8 values, with one float16 scale
per group of at least 32 of them (kv/spec.py: `int8_scale_groups`; llama.cpp's q8_0 layout).

Symmetric quantization per token, KV head and group: scale = max |x| / 127 over the group's values
(rounded to float16, and the values divided by that rounded scale), stored value = round(x / scale).
Why per token: a token's K/V are written once, when they are computed, and never requantized (a later
token in the same block changes nothing of an earlier one), so copy-on-write, forks and prefix reuse
move a token's scales with its slot and nothing else, and a cached prefix block reads back bit for bit
what its first request wrote. The scales are counted in the pool's bytes (kv/spec.py:
`scale_bytes_per_head`): at head_dim 64 a token costs 68 bytes per head against 256 in float32 and 128
in bfloat16.

A layer's K (or V) is a `QuantizedKV`: it answers the two reads attention makes of a cache tensor
(`index_select` of slots, a slice of consecutive slots) dequantized into `read_dtype`, so every
attention path reads it as it reads a float cache; the decode groups' shared prefix is read in
chunks (backends.py: `_prefix_attention`), so no full-precision copy of a prompt's K/V is made.
"""

from __future__ import annotations

import torch

from widebeam.kv.spec import int8_scale_groups

INT8_MAX = 127.0
SCALE_DTYPE = torch.float16
# float16's smallest subnormal and largest finite value: a group of zeros quantizes to zeros (not 0 / 0),
# and no scale is infinite (a group past 8e6 saturates at +-127 steps instead).
_MIN_SCALE, _MAX_SCALE = 2.0 ** -24, 65504.0


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [tokens, kv_heads, head_dim] -> (int8 values [tokens, kv_heads, head_dim], float16 scales
    [tokens, kv_heads, groups])."""
    tokens, heads, head_dim = x.shape
    groups = int8_scale_groups(head_dim)
    grouped = x.float().view(tokens, heads, groups, head_dim // groups)
    scales = (grouped.abs().amax(dim=-1, keepdim=True) / INT8_MAX).clamp_(_MIN_SCALE, _MAX_SCALE)
    scales = scales.to(SCALE_DTYPE)
    values = torch.round(grouped / scales.float()).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return values.view(tokens, heads, head_dim), scales.view(tokens, heads, groups)


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 values [..., kv_heads, head_dim] and their scales [..., kv_heads, groups] -> `dtype`; the
    product in float32, then one rounding to `dtype`."""
    *lead, head_dim = values.shape
    groups = scales.shape[-1]
    out = values.to(torch.float32).view(*lead, groups, head_dim // groups).mul_(scales.float()[..., None])
    out = out.view(*lead, head_dim)
    return out if dtype == torch.float32 else out.to(dtype)


def int8_read_dtype(model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """What an int8 cache is read back as, and attention computes in: a half-precision model's own dtype;
    for a float32 model bfloat16 where matrix products in it are native (CUDA; a CPU with AVX512-BF16 or
    AMX, which oneDNN reports), else float32. Measured on SmolLM2-135M (float32 weights), W=1,024 over
    2,048 prompt tokens: prompt attention 654 ms a step read as float32 (float32 KV: 665) and 342 read as
    bfloat16; mean KL against float32 KV over 4,096 held tokens 4.7e-4 and 5.2e-4
    (benchmarks/wide_step_breakdown.py, benchmarks/kv_quality.py)."""
    if model_dtype in (torch.bfloat16, torch.float16):
        return model_dtype
    if device.type == "cuda" or (device.type == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return torch.bfloat16
    return torch.float32


class QuantizedKV:
    """One layer's K (or V): `values` int8 [num_slots, kv_heads, head_dim] and `scales` float16
    [num_slots, kv_heads, groups]. Reads come back in `read_dtype`.

    A layer's K and V are one pair (`QuantizedKV.pair`): `pair_values` [2, num_slots, kv_heads,
    head_dim] and `pair_scales` (the runner's pool tensors at the layer), K at 0 and V at 1, so a write
    quantizes both in one pass and `read_pair` dequantizes both at once: half the kernel launches of
    the step's K/V work, which at one beam is most of what an int8 cache adds."""

    def __init__(self, pair_values: torch.Tensor, pair_scales: torch.Tensor, index: int,
                 read_dtype: torch.dtype):
        self.pair_values, self.pair_scales = pair_values, pair_scales
        self.values, self.scales = pair_values[index], pair_scales[index]
        self.read_dtype = read_dtype

    @classmethod
    def pair(cls, values: torch.Tensor, scales: torch.Tensor,
             read_dtype: torch.dtype) -> tuple[QuantizedKV, QuantizedKV]:
        """(K, V) over one layer's [2, num_slots, ...] values and scales."""
        return cls(values, scales, 0, read_dtype), cls(values, scales, 1, read_dtype)

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


def is_pair(k_cache, v_cache) -> bool:
    """Whether (k_cache, v_cache) are one layer's int8 K and V."""
    return isinstance(k_cache, QuantizedKV) and k_cache.pair_values is getattr(v_cache, "pair_values", None)


def write_pair(k_cache: QuantizedKV, v_cache: QuantizedKV, slots: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> None:
    """Quantize k and v [tokens, kv_heads, head_dim] into `slots`, both in one pass."""
    num_tokens = k.shape[0]
    values, scales = quantize(torch.cat((k, v)))  # [2 x tokens, kv_heads, ...]: K's tokens, then V's
    k_cache.pair_values.index_copy_(1, slots, values.view(2, num_tokens, *values.shape[1:]))
    k_cache.pair_scales.index_copy_(1, slots, scales.view(2, num_tokens, *scales.shape[1:]))


def read_pair(k_cache: QuantizedKV, v_cache: QuantizedKV, start: int | None = None, end: int | None = None,
              index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) of slots start..end, or of the slots `index`, dequantized in one pass."""
    if index is not None:
        values = k_cache.pair_values.index_select(1, index)
        scales = k_cache.pair_scales.index_select(1, index)
    else:
        values, scales = k_cache.pair_values[:, start:end], k_cache.pair_scales[:, start:end]
    k, v = dequantize(values, scales, k_cache.read_dtype).unbind(0)
    return k, v
