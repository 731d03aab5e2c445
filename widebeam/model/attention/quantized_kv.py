"""An int8 KV cache: each token's K (or V) of each KV head as head_dim int8 values, with one float16 scale
per group of at least 32 of them (kv/spec.py: `int8_scale_groups`; llama.cpp's q8_0 layout), K stored
rotated by a Walsh-Hadamard matrix.

Symmetric quantization per token, KV head and group: scale = max |x| / 127 over the group's values
(rounded to float16, and the values divided by that rounded scale), stored value = round(x / scale).
Why per token: a token's K/V are written once, when they are computed, and never requantized (a later
token in the same block changes nothing of an earlier one), so copy-on-write, forks and prefix reuse
move a token's scales with its slot and nothing else, and a cached prefix block reads back bit for bit
what its first request wrote. The scales are counted in the pool's bytes (kv/spec.py:
`scale_bytes_per_head`): at head_dim 64 a token costs 68 bytes per head against 256 in float32 and 128
in bfloat16.

The rotation (QuaRot, SpinQuant, KVQuant: spread outlier channels before quantizing). K has a few
channels far larger than the rest, and a group's one scale must fit its largest value, so without
rotation a loud channel coarsens its 31 neighbours. The pool stores K as round((k @ H) / scale), with H
the normalized Walsh-Hadamard matrix over head_dim (`hadamard`: orthonormal and symmetric, H @ H = I),
which spreads every channel over the whole head; a read gives back (values * scale) @ H. So the
rotation is a property of the stored format: every read of the pool (`index_select`, slot ranges,
`read_pair`) un-rotates, and copy-on-write, forks, prefix reuse and chunked prefix reads, which move or
read stored slots, are unchanged. One reader opts out: the "sdpa" backend attends in the stored domain
(`stored_domain`: q @ H against the stored K is q . k), which costs one 64 x 64 product of the step's
queries a layer instead of one of every token the step reads. Measured on SmolLM2-135M, one decode step
over a 512-token prompt against the same cache unrotated: +2-3% at W = 1-64 in the stored domain, +3-8%
un-rotating every read (benchmarks/results/kv_rotation.md).

Quality, against float32 KV over 20,000 held tokens and 100 prompts (benchmarks/kv_quality.py): mean KL
5.3e-4 -> 2.4e-4, top-1 agreement 98.76% -> 99.02%, best beam equal at W=8 on 84 -> 92 of 100 prompts
(read as bfloat16). Read as float32 (the quantization alone): 4.7e-4 -> 2.0e-4 with K rotated, and 2.0e-4
with V rotated as well (top-1 99.19% / 99.23%): rotating V buys nothing measurable, so V is stored as
it is (`ROTATE_V`; `benchmarks/kv_quality.py --int8-rotation kv` measures it).

H is built once on the CPU by Sylvester's construction (entries +-1 / sqrt(block), in float64, rounded
once to float32: exact at 64), and copied to the device, so a CPU and a CUDA pool rotate by the same
bits. A head_dim that is not a power of two is rotated block-diagonally, over blocks of the largest power
of two dividing it (80 -> five blocks of 16, 96 -> three of 32); an odd head_dim is not rotated.

A layer's K (or V) is a `QuantizedKV`: it answers the two reads attention makes of a cache tensor
(`index_select` of slots, a slice of consecutive slots) dequantized into `read_dtype`, so every
attention path reads it as it reads a float cache; the decode groups' shared prefix is read in
chunks (backends.py: `_prefix_attention`), so no full-precision copy of a prompt's K/V is made.
"""

from __future__ import annotations

import copy
import functools
import math

import torch

from widebeam.kv.spec import int8_scale_groups
from widebeam.model import kernels

INT8_MAX = 127.0
SCALE_DTYPE = torch.float16
# float16's smallest subnormal and largest finite value: a group of zeros quantizes to zeros (not 0 / 0),
# and no scale is infinite (a group past 8e6 saturates at +-127 steps instead).
_MIN_SCALE, _MAX_SCALE = 2.0 ** -24, 65504.0
# Which of a layer's K and V the pool stores rotated (measured, above); read when a pool is built.
ROTATE_K, ROTATE_V = True, False


def hadamard_block(head_dim: int) -> int:
    """The rotation's block: the largest power of two dividing head_dim (64 -> 64, 80 -> 16, 96 -> 32)."""
    return head_dim & -head_dim


@functools.cache
def _hadamard_cpu(head_dim: int) -> torch.Tensor | None:
    block = hadamard_block(head_dim)
    if block == 1:
        return None
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:  # Sylvester: H_2n = [[H_n, H_n], [H_n, -H_n]]
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)))
    return torch.block_diag(*[h / math.sqrt(block)] * (head_dim // block)).float()


_HADAMARD_ON: dict[tuple[int, torch.device], torch.Tensor | None] = {}


def hadamard(head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor | None:
    """The rotation, float32 [head_dim, head_dim] on `device`: the normalized Walsh-Hadamard matrix
    (Sylvester), block-diagonal over `hadamard_block` when head_dim is not a power of two, None (no
    rotation) when it is odd. Symmetric and orthonormal: it is its own inverse. Built on the CPU and
    copied, so every device holds the same bits."""
    key = (head_dim, torch.device(device))
    if key not in _HADAMARD_ON:
        h = _hadamard_cpu(head_dim)
        _HADAMARD_ON[key] = None if h is None else h.to(key[1])
    return _HADAMARD_ON[key]


def quantize(x: torch.Tensor, rotation: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [tokens, kv_heads, head_dim] (rotated first: x @ rotation) -> (int8 values [tokens, kv_heads,
    head_dim], float16 scales [tokens, kv_heads, groups])."""
    tokens, heads, head_dim = x.shape
    groups = int8_scale_groups(head_dim)
    x = x.float() if rotation is None else x.float() @ rotation
    grouped = x.view(tokens, heads, groups, head_dim // groups)
    scales = (grouped.abs().amax(dim=-1, keepdim=True) / INT8_MAX).clamp_(_MIN_SCALE, _MAX_SCALE)
    scales = scales.to(SCALE_DTYPE)
    values = torch.round(grouped / scales.float()).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return values.view(tokens, heads, head_dim), scales.view(tokens, heads, groups)


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
               rotation: torch.Tensor | None = None) -> torch.Tensor:
    """int8 values [..., kv_heads, head_dim] and their scales [..., kv_heads, groups] -> `dtype`; the
    product (and the un-rotation: @ rotation) in float32, then one rounding to `dtype`."""
    *lead, head_dim = values.shape
    groups = scales.shape[-1]
    out = values.to(torch.float32).view(*lead, groups, head_dim // groups).mul_(scales.float()[..., None])
    out = out.view(*lead, head_dim)
    if rotation is not None:
        out = out @ rotation
    return out if dtype == torch.float32 else out.to(dtype)


def int8_read_dtype(model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """What an int8 cache is read back as, and attention computes in: a half-precision model's own dtype;
    for a float32 model bfloat16 where products in it are much faster (CUDA; a CPU with AMX tiles), else
    float32. Measured on SmolLM2-135M (float32 weights), W=1,024 over 2,048 prompt tokens, prompt
    attention a step: on an Intel CPU with AMX 654 ms read as float32 (float32 KV: 665) and 342 read as
    bfloat16; on an AMD EPYC with AVX512-BF16 but no AMX, where PyTorch's fused CPU attention is no faster
    in bfloat16, 1,194 and 1,201 ms (float32 KV: 1,007), and the beams' own keys 19 against 38 ms. Read as
    float32 the quantization alone shows: mean KL against float32 KV over 20,000 held tokens 2.0e-4,
    against 2.4e-4 read as bfloat16 (benchmarks/wide_step_breakdown.py, benchmarks/kv_quality.py)."""
    if model_dtype in (torch.bfloat16, torch.float16):
        return model_dtype
    if device.type == "cuda" or (device.type == "cpu" and _has_amx()):
        return torch.bfloat16
    return torch.float32


def _has_amx() -> bool:
    """Whether this CPU has AMX tiles (torch.cpu's private probe; oneDNN's own where torch lacks it)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe()) if probe is not None else torch.ops.mkldnn._is_mkldnn_bf16_supported()


class QuantizedKV:
    """One layer's K (or V): `values` int8 [num_slots, kv_heads, head_dim] and `scales` float16
    [num_slots, kv_heads, groups], stored rotated by `rotation` (None: not rotated). Reads come back in
    `read_dtype`, un-rotated.

    A layer's K and V are one pair (`QuantizedKV.pair`): `pair_values` [2, num_slots, kv_heads,
    head_dim] and `pair_scales` (the runner's pool tensors at the layer), K at 0 and V at 1, so a write
    quantizes both in one pass and `read_pair` dequantizes both at once: half the kernel launches of
    the step's K/V work, which at one beam is most of what an int8 cache adds."""

    def __init__(self, pair_values: torch.Tensor, pair_scales: torch.Tensor, index: int,
                 read_dtype: torch.dtype, rotation: torch.Tensor | None = None):
        self.pair_values, self.pair_scales = pair_values, pair_scales
        self.values, self.scales = pair_values[index], pair_scales[index]
        self.read_dtype = read_dtype
        self.rotation = rotation  # what the stored values are rotated by; reads multiply by it again
        self.unrotate = rotation  # what reads multiply by: None in the stored domain (`stored_domain`)
        self._stored: QuantizedKV | None = None

    @classmethod
    def pair(cls, values: torch.Tensor, scales: torch.Tensor,
             read_dtype: torch.dtype) -> tuple[QuantizedKV, QuantizedKV]:
        """(K, V) over one layer's [2, num_slots, ...] values and scales, rotated as ROTATE_K / ROTATE_V
        say."""
        rotation = hadamard(values.shape[-1], values.device)
        return (cls(values, scales, 0, read_dtype, rotation if ROTATE_K else None),
                cls(values, scales, 1, read_dtype, rotation if ROTATE_V else None))

    def in_stored_domain(self) -> QuantizedKV:
        """This cache read as stored: rotated, not un-rotated (the same tensors)."""
        if self.unrotate is None:
            return self
        if self._stored is None:  # made once: every layer asks for it every step
            self._stored = copy.copy(self)
            self._stored.unrotate = None
        return self._stored

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
                          self.read_dtype, self.unrotate)

    def __getitem__(self, key: slice) -> torch.Tensor:
        """A run of consecutive slots, dequantized."""
        if not isinstance(key, slice):
            raise TypeError("a quantized KV cache is read by slot ranges or index_select")
        return dequantize(self.values[key], self.scales[key], self.read_dtype, self.unrotate)


def is_pair(k_cache, v_cache) -> bool:
    """Whether (k_cache, v_cache) are one layer's int8 K and V."""
    return isinstance(k_cache, QuantizedKV) and k_cache.pair_values is getattr(v_cache, "pair_values", None)


def stored_domain(q: torch.Tensor, k_cache, v_cache):
    """Attention in the domain the cache stores K and V in: (q', k_cache', v_cache', out_rotation).
    q [tokens, heads, head_dim] rotated as K is (q @ H . k @ H = q . k), the caches read without
    un-rotating, and `out_rotation` what the attention's output is then multiplied by (V's rotation:
    the weighted sum of rotated values, un-rotated once; None when V is not rotated). Any cache but a
    rotated `QuantizedKV` comes back as it is."""
    if not isinstance(k_cache, QuantizedKV) or (k_cache.unrotate is None and v_cache.unrotate is None):
        return q, k_cache, v_cache, None
    if k_cache.unrotate is not None:
        q = (q.float() @ k_cache.unrotate).to(q.dtype)
    return q, k_cache.in_stored_domain(), v_cache.in_stored_domain(), v_cache.unrotate


def write_pair(k_cache: QuantizedKV, v_cache: QuantizedKV, slots: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> None:
    """Quantize k and v [tokens, kv_heads, head_dim] into `slots`, both in one pass (each rotated as
    its cache stores it). On the CPU with the kernels built, one op (kernels/int8_kv.cpp) writes exactly
    what the torch path below writes, bit for bit."""
    if (kernels.enabled() and v_cache.rotation is None and k.device.type == "cpu"
            and k_cache.pair_values.is_contiguous() and k_cache.pair_scales.is_contiguous()):
        torch.ops.widebeam.quantize_write(k.float().contiguous(), v.float().contiguous(), k_cache.rotation,
                                          slots.contiguous(), k_cache.pair_values, k_cache.pair_scales)
        return
    num_tokens = k.shape[0]
    if k_cache.rotation is v_cache.rotation:  # both rotated, or neither
        values, scales = quantize(torch.cat((k, v)), k_cache.rotation)  # [2 x tokens, ...]: K's, then V's
    else:
        k, v = (x if r is None else x.float() @ r for x, r in ((k, k_cache.rotation), (v, v_cache.rotation)))
        values, scales = quantize(torch.cat((k.float(), v.float())))
    k_cache.pair_values.index_copy_(1, slots, values.view(2, num_tokens, *values.shape[1:]))
    k_cache.pair_scales.index_copy_(1, slots, scales.view(2, num_tokens, *scales.shape[1:]))


def read_pair(k_cache: QuantizedKV, v_cache: QuantizedKV, start: int | None = None, end: int | None = None,
              index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) of slots start..end, or of the slots `index`, dequantized (and un-rotated, unless read in
    the stored domain) in one pass."""
    if index is not None:
        values = k_cache.pair_values.index_select(1, index)
        scales = k_cache.pair_scales.index_select(1, index)
    else:
        values, scales = k_cache.pair_values[:, start:end], k_cache.pair_scales[:, start:end]
    if k_cache.unrotate is v_cache.unrotate:  # both un-rotated, or neither
        k, v = dequantize(values, scales, k_cache.read_dtype, k_cache.unrotate).unbind(0)
        return k, v
    k, v = dequantize(values, scales, torch.float32).unbind(0)
    k, v = (x if r is None else x @ r for x, r in ((k, k_cache.unrotate), (v, v_cache.unrotate)))
    return k.to(k_cache.read_dtype), v.to(v_cache.read_dtype)
