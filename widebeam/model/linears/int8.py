"""Int8 linear layers (`dtype="int8"`): int8 weights per output channel, activations quantized per
row on each call, int32 accumulation, float32 out.

The math, one definition for every kernel: a row x is scaled by s = max|x| / 127 and rounded
(half to even) to q_x in [-127, 127]; the weight row j is w_j ~= q_w[j] * c_j; the output is
`((q_x . q_w[j]) * c_j) * s`, the dot product exact in int32, the two float32 products in that
order. Per-row and per-channel scales keep an outlier row or channel from flattening the others
(a per-tensor activation scale agreed with float32 on 34% of SmolLM2's next tokens; see
benchmarks/int8_accuracy.py), and make a row's output independent of the rows batched with it.

Two kernels compute it, bit for bit the same:
- "int_mm": `torch._int_mm` on the int8 rows (padded to 17: it wants more than 16), the reference
  and the fallback.
- "fbgemm": PyTorch's FBGEMM linear with the weight prepacked once. It is handed q_x as whole
  floats with an activation scale of 1 and zero point 128 (it quantizes round(v + 128) in float32,
  which would round 77.4999924 up: so the rounding is done before), and its output is the int32
  product times c_j; the row scale is applied after. At the few rows of a
  decode step it runs 2-2.5x faster than `_int_mm` on this CPU (a 1-row lm_head: 1.9 vs 5.1 ms;
  `python benchmarks/int8_kernels.py`). FBGEMM's non-VNNI x86 kernels sum pairs of u8 x s8
  products in int16 with saturation, which would break exactness, so the kernel is used only when
  a probe at the saturating extremes matches `_int_mm` exactly (`fbgemm_exact`).
- "float_exact": where FBGEMM is not exact (an AVX2 CPU without VNNI), the int8 values as float32 through
  the float32 product, in chunks of `FLOAT_EXACT_CHUNK` inputs: every partial sum of a chunk is a whole
  number of at most 1,024 x 127 x 127 < 2^24, which float32 holds exactly whatever the order of the sum,
  so each chunk's product is the int32 one; the chunks add in int32. Bit for bit `_int_mm`, and 20-60x
  faster than it on a 2-core AVX2 EPYC (17 rows [576] x [576, 1,536]: 0.64 against 12.7 ms; 320 rows 3.5
  against 213), where `_int_mm` made an int8 run ~70x slower than CTranslate2's (43.6 against 0.60 s at
  W=1, P=320, N=8). It widens the weight to float32 on each call (no second copy held). Used only while
  float32 products are full precision (`torch.get_float32_matmul_precision() == "highest"`); else, or
  asked for, "int_mm" serves.
"""

from __future__ import annotations

import functools
import warnings

import torch

from widebeam.model import kernels
from widebeam.model.families.layers import swap_linears

INT8_KERNELS = ("fbgemm", "float_exact", "int_mm")
_INT_MM_MIN_ROWS = 17  # torch._int_mm wants more than 16 rows: fewer are padded with zeros
_ZERO_POINT = 128  # FBGEMM's activations are uint8: q_x + 128 in [1, 255]


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, in] float32 -> (q, s [n, 1]): each row's scale s = max|row| / 127 and q = round(rows / s),
    whole numbers in [-127, 127] kept in float32 (exact), rounded half to even. The one rule for
    activations (per row) and weights (per output channel)."""
    if (rows.device.type == "cpu" and rows.dtype == torch.float32 and rows.dim() == 2 and rows.is_contiguous()
            and kernels.quantize_rows_enabled() and not (torch.is_grad_enabled() and rows.requires_grad)):
        return torch.ops.widebeam.quantize_rows(rows)  # the same, bit for bit, in one op (C++)
    scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0
    return torch.round(rows / scale).clamp_(-127, 127), scale


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (int8 [out, in], float32 scale per output channel [out])."""
    weight_q, scale = quantize_rows(weight.detach().float())
    return weight_q.to(torch.int8), scale[:, 0]


def int_mm_product(quantized_rows: torch.Tensor, weight_t: torch.Tensor,
                   weight_scale: torch.Tensor) -> torch.Tensor:
    """The reference: (q_x . q_w[j]) * c_j with `torch._int_mm`. weight_t: [in, out] int8."""
    quantized = quantized_rows.to(torch.int8)
    num_rows = quantized.shape[0]
    if num_rows < _INT_MM_MIN_ROWS:
        quantized = torch.nn.functional.pad(quantized, (0, 0, 0, _INT_MM_MIN_ROWS - num_rows))
    return torch._int_mm(quantized, weight_t)[:num_rows].float() * weight_scale


# inputs a chunk of the float32 product may sum while every partial sum stays a whole number below 2^24
FLOAT_EXACT_CHUNK = 1024
# up to this many rows "float_exact" reads the int8 weight through kernels/int8_rows.cpp (exact int32 sums)
# instead of widening it to float32: 1.90 -> 1.19 s at W=1, P=320, N=8 on a 2-core AVX2 EPYC (W=4: 2.37 ->
# 1.44; docs/benchmarks.md, "An AVX2 host")
INT8_ROWS_MAX_ROWS = 8


def float_exact_product(quantized_rows: torch.Tensor, weight_t: torch.Tensor,
                        weight_scale: torch.Tensor) -> torch.Tensor:
    """`int_mm_product` bit for bit through float32 products: `quantized_rows` [n, in] whole numbers in
    float32, weight_t [in, out] int8, summed a chunk of FLOAT_EXACT_CHUNK inputs at a time (exact), the
    chunks in int32."""
    num_inputs = weight_t.shape[0]
    if num_inputs <= FLOAT_EXACT_CHUNK:  # one chunk: the float32 sum is the int32 one, below 2^24
        return (quantized_rows @ weight_t.float()) * weight_scale
    total = None
    for start in range(0, num_inputs, FLOAT_EXACT_CHUNK):
        end = start + FLOAT_EXACT_CHUNK
        part = (quantized_rows[:, start:end] @ weight_t[start:end].float()).to(torch.int32)
        total = part if total is None else total.add_(part)
    return total.float() * weight_scale


def int8_few_rows(quantized_rows: torch.Tensor, weight_q: torch.Tensor,
                  weight_scale: torch.Tensor) -> torch.Tensor:
    """`int_mm_product` of 1-8 rows bit for bit, reading weight_q [out, in] int8 as it is (C++)."""
    return torch.ops.widebeam.int8_few_rows(quantized_rows, weight_q, weight_scale)


def float_exact_available() -> bool:
    """Whether float32 products run at full precision here (no TF32/bfloat16 shortcut), as
    `float_exact_product` needs."""
    return torch.get_float32_matmul_precision() == "highest"


def fbgemm_pack(weight_q: torch.Tensor, weight_scale: torch.Tensor):
    """FBGEMM's prepacked form of an int8 weight with per-channel scales (no bias: added after)."""
    with warnings.catch_warnings():  # quantized tensors are deprecated in PyTorch, still served in 2.13
        warnings.simplefilter("ignore")
        zero_points = torch.zeros(weight_q.shape[0], dtype=torch.long)
        qweight = torch._make_per_channel_quantized_tensor(weight_q, weight_scale.double(), zero_points, 0)
        return torch.ops.quantized.linear_prepack(qweight, None)


def fbgemm_product(quantized_rows: torch.Tensor, packed) -> torch.Tensor:
    """(q_x . q_w[j]) * c_j through FBGEMM: activation scale 1, zero point 128."""
    return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(quantized_rows, 1.0, _ZERO_POINT,
                                                                             packed)


@functools.cache
def fbgemm_exact() -> bool:
    """Whether FBGEMM's int8 linear is available here and equals `_int_mm` exactly at the extremes
    (every product +-127 x 127, where int16 pair sums would saturate)."""
    try:
        in_features, out_features = 1536, 64
        weight_q = torch.full((out_features, in_features), 127, dtype=torch.int8)
        weight_q[::2, ::3] = -127
        weight_scale = torch.linspace(0.5, 2.0, out_features)
        rows = torch.full((20, in_features), 127.0)
        rows[::2] = -127.0
        rows[1, :] = torch.arange(in_features) % 255 - 127.0  # every value once
        for num_rows in (1, 4, 20):
            ref = int_mm_product(rows[:num_rows], weight_q.t().contiguous(), weight_scale)
            out = fbgemm_product(rows[:num_rows], fbgemm_pack(weight_q, weight_scale))
            if not torch.equal(out, ref):
                return False
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return True


def _kernel_here(kernel: str | None) -> str:
    """The kernel a layer asked for `kernel` runs here: FBGEMM where exact (asked, or by default), else
    "float_exact" while float32 products are full precision (asked, or by default), else "int_mm"."""
    if kernel in (None, "fbgemm") and fbgemm_exact():
        return "fbgemm"
    if kernel in (None, "fbgemm", "float_exact") and float_exact_available():
        return "float_exact"
    return "int_mm"


class Int8Linear(torch.nn.Module):
    """A linear layer with int8 weights (see the module docstring for the math). `kernel`: "fbgemm"
    (where `fbgemm_exact()`, else "float_exact"), "float_exact", "int_mm", or None for the fastest exact
    one (`_kernel_here`). Only one
    int8 copy of the weight is held, in the kernel's layout."""

    def __init__(self, linear: torch.nn.Linear, kernel: str | None = None):
        super().__init__()
        weight_q, weight_scale = quantize_weight(linear.weight)
        self._hold(weight_q, weight_scale, None if linear.bias is None else linear.bias.detach().float(),
                   kernel)

    def _hold(self, weight_q: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
              kernel: str | None) -> None:
        if kernel is not None and kernel not in INT8_KERNELS:
            raise ValueError(f"int8 kernel must be one of {', '.join(INT8_KERNELS)}, got {kernel!r}")
        self.out_features, self.in_features = weight_q.shape
        self.kernel = _kernel_here(kernel)
        self.register_buffer("weight_scale", weight_scale)  # [out]
        self.register_buffer("bias", bias)
        if self.kernel == "fbgemm":
            self._packed = fbgemm_pack(weight_q, weight_scale)  # a script object, not a buffer
        else:
            # [in, out] for the products over many rows; "float_exact" holds it as the view of a contiguous
            # [out, in], the layout its few-row kernel streams (one copy either way)
            held = weight_q.contiguous().t() if self.kernel == "float_exact" else weight_q.t().contiguous()
            self.register_buffer("weight_t", held)

    @classmethod
    def concat(cls, layers: list[Int8Linear]) -> Int8Linear:
        """One layer computing `layers` (same input, same kernel) side by side: the output is their
        outputs concatenated, bit for bit (per-row and per-channel scales do not mix the parts)."""
        kernels = {layer.kernel for layer in layers}
        if len(kernels) != 1 or len({layer.in_features for layer in layers}) != 1:
            raise ValueError("concatenated int8 layers need one kernel and one input size")
        biases = [layer.bias for layer in layers]
        if any(b is None for b in biases) and any(b is not None for b in biases):
            biases = [torch.zeros(layer.out_features) if b is None else b for layer, b in zip(layers, biases)]
        fused = cls.__new__(cls)
        torch.nn.Module.__init__(fused)
        fused._hold(torch.cat([layer.weight_q for layer in layers]),
                    torch.cat([layer.weight_scale for layer in layers]),
                    None if biases[0] is None else torch.cat(biases), kernels.pop())
        return fused

    @property
    def weight_q(self) -> torch.Tensor:
        """The int8 weight [out, in], whichever layout the kernel holds (for inspection and tests)."""
        if self.kernel == "fbgemm":
            return self._packed.unpack()[0].int_repr()
        return self.weight_t.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32:
            rows = rows.float()
        quantized, scale = quantize_rows(rows)  # [num_rows, in], [num_rows, 1]
        if self.kernel == "fbgemm":
            out = fbgemm_product(quantized, self._packed)
        elif self.kernel == "float_exact" and float_exact_available():
            weight_rows = self.weight_t.t()  # [out, in]
            if (1 <= quantized.shape[0] <= INT8_ROWS_MAX_ROWS and kernels.int8_rows_enabled()
                    and weight_rows.is_contiguous()):
                # a decode step's rows from the int8 weight itself, exact (kernels/int8_rows.cpp)
                out = int8_few_rows(quantized, weight_rows, self.weight_scale)
            else:
                out = float_exact_product(quantized, self.weight_t, self.weight_scale)
        else:
            out = int_mm_product(quantized, self.weight_t.contiguous(), self.weight_scale)
        out.mul_(scale)
        if self.bias is not None:
            out += self.bias
        out = out.view(*x.shape[:-1], self.out_features)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, kernel={self.kernel}")


def quantize_int8(model: torch.nn.Module, device: torch.device, kernel: str | None = None) -> torch.nn.Module:
    """Every linear layer (lm_head included) as an `Int8Linear`, in place; CPU only (the int8
    kernels are x86's)."""
    if device.type != "cpu":
        raise ValueError("dtype='int8' runs on CPU (int8 matmul kernels); on CUDA use bfloat16")
    return swap_linears(model, lambda linear: Int8Linear(linear, kernel))


def fuse_int8_projections(model: torch.nn.Module) -> torch.nn.Module:
    """The int8 layers that read one input (q/k/v, gate/up) as one `Int8Linear` each, in place,
    wherever a module offers `fuse_projections`. Exact (see `Int8Linear.concat`); it pays because
    an int8 call at a decode step's few rows costs mostly its fixed work (quantizing the rows,
    FBGEMM's per-call set-up): 5 calls a layer become 2 (`benchmarks/int8_kernels.py`)."""
    for module in list(model.modules()):
        fuse = getattr(module, "fuse_projections", None)
        if fuse is not None:
            fuse(Int8Linear.concat)
    return model
