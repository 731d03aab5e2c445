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
    [num_slots, kv_heads, groups] (views of the runner's pool tensors). Reads come back in `read_dtype`."""

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
