"""Building blocks of the decoders: the token embedding, RMSNorm, rotary embeddings, the gated MLP."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

# Re-exported: both moved to torch-free modules so the family table can raise and parse them.
from widebeam.errors import UnsupportedModelError
from widebeam.model import kernels
from widebeam.model.families.decoder_config import SUPPORTED_ROPE_TYPES


class Embedding(nn.Embedding):
    """nn.Embedding, minus its random init on the meta device, where models are built (loading/build.py)
    and there is no data to fill. Not only a no-op skipped: torch's normal_ on a meta tensor goes through
    torch._refs, whose first call imports torch._dynamo (~1 s of every model load on 2 cores, `widebeam
    serve` included, for nothing else). On a real device it initialises as nn.Embedding does."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


def _one_op(x: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """Whether an elementwise step runs as one C++ op: built and on, on the CPU, no gradient wanted (the
    ops have no backward)."""
    return (x.device.type == "cpu" and kernels.elementwise_enabled()
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in (x, *tensors))))


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, unit_offset: bool = False):
        super().__init__()
        # Gemma stores the weight as an offset from 1 (`x * (1 + w)`); Llama stores it directly.
        self.weight = nn.Parameter(torch.zeros(hidden_size) if unit_offset else torch.ones(hidden_size))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _one_op(x, self.weight):  # the formulas below as one C++ op (kernels/elementwise.cpp)
            return torch.ops.widebeam.rms_norm(x.contiguous(), self.weight, self.eps, self.unit_offset)
        if x.dtype == torch.float32 and not self.unit_offset:
            # the same kernels as below, minus the no-op casts, the weight applied in place
            return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).mul_(self.weight)
        x_float = x.float()
        normed = x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + self.eps)
        weight = self.weight.float()
        if self.unit_offset:
            return (normed * (1.0 + weight)).to(x.dtype)
        return (normed * weight).to(x.dtype)


ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}


def swap_linears(model: nn.Module, make, where=lambda linear: True) -> nn.Module:
    """Every `nn.Linear` of `model` for which `where(linear)` holds, replaced by `make(linear)`, in
    place (the one walk behind int8 quantization and the float32 linear backends)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and where(child):
                setattr(parent, name, make(child))
    return model


def float32_on_cpu(linear: nn.Linear) -> bool:
    return linear.weight.dtype == torch.float32 and linear.weight.device.type == "cpu"


def half_on_cpu(linear: nn.Linear) -> bool:
    """A bfloat16 or float16 linear on the CPU."""
    return linear.weight.dtype in (torch.bfloat16, torch.float16) and linear.weight.device.type == "cpu"


class FusedProjections(nn.Module):
    """Linear layers that read the same input, run as one (`linear`, their weights stacked by output
    row); the output is split back into the parts, `sizes` wide."""

    def __init__(self, linear: nn.Module, sizes: list[int]):
        super().__init__()
        self.linear, self.sizes = linear, sizes

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(x).split(self.sizes, dim=-1)


def fuse_linears(owner: nn.Module, names: list[str], concat) -> FusedProjections:
    """`owner`'s linears `names` as one `FusedProjections` built by `concat` (a list of layers -> one
    layer); the separate layers are removed, so the weights are held once."""
    layers = [getattr(owner, name) for name in names]
    fused = FusedProjections(concat(layers), [layer.out_features for layer in layers])
    for name in names:
        delattr(owner, name)
    return fused


class GatedMLP(nn.Module):
    FUSED_PARTS = ("gate_proj", "up_proj")  # the linears `fuse_projections` stacks

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str, bias: bool = False):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise UnsupportedModelError(f"activation {activation!r} is not supported; supported: "
                                        f"{sorted(ACTIVATIONS)}")
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = ACTIVATIONS[activation]
        self.gate_up: FusedProjections | None = None

    def fuse_projections(self, concat) -> None:
        """gate_proj and up_proj as one layer (`concat`: a list of layers -> one); after loading."""
        self.gate_up = fuse_linears(self, list(self.FUSED_PARTS), concat)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # any linear (an int8 one holds no float `weight`): its parameters, if any, must want no gradient
        if (self.gate_up is not None and self.act is F.silu and _one_op(x) and not (
                torch.is_grad_enabled() and any(p.requires_grad for p in self.gate_up.parameters()))):
            # silu(gate) * up in one pass over the fused projection's output (kernels/elementwise.cpp)
            return self.down_proj(torch.ops.widebeam.silu_and_mul(self.gate_up.linear(x).contiguous()))
        gate, up = self.gate_up(x) if self.gate_up is not None else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(self.act(gate) * up)


def rope_inv_freq(params: dict, rotary_dims: int) -> torch.Tensor:
    """Inverse frequencies for the scaling types Llama, SmolLM2, Qwen2 and Mistral configs use."""
    rope_type = params["rope_type"]
    base = float(params["rope_theta"])
    # explicit device: models are built under torch.device("meta") and these are not in checkpoints
    exponents = torch.arange(0, rotary_dims, 2, dtype=torch.int64, device="cpu").float() / rotary_dims
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        factor = float(params["factor"])
        low_freq_factor = float(params["low_freq_factor"])
        high_freq_factor = float(params["high_freq_factor"])
        old_context_len = float(params["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise UnsupportedModelError(
        f"rope scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


class RotaryEmbedding(nn.Module):
    """cos/sin tables by position, for the half-rotation layout Hugging Face checkpoints use.

    The frequencies are derived from the config, not stored in checkpoints, so they are kept out of
    the module's state and computed on first use on each device.
    """

    def __init__(self, params: dict, rotary_dims: int):
        super().__init__()
        self._inv_freq_cpu = rope_inv_freq(params, rotary_dims)
        self._inv_freq_by_device: dict[torch.device, torch.Tensor] = {}

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self._inv_freq_by_device.get(positions.device)
        if inv_freq is None:
            inv_freq = self._inv_freq_by_device.setdefault(positions.device,
                                                           self._inv_freq_cpu.to(positions.device))
        freqs = positions[:, None].float() * inv_freq[None, :]  # [num_tokens, rotary_dims / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [num_tokens, rotary_dims]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim]; cos, sin: [num_tokens, rotary_dims]. With fewer rotary dims
    than head_dim (a partial rotary), the leading dims rotate and the rest pass through."""
    rotary_dims = cos.shape[-1]
    if rotary_dims < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rotary_dims], cos, sin), x[..., rotary_dims:]), dim=-1)
    if (x.dtype != torch.float64 and x.stride(-1) == 1 and cos.dtype == sin.dtype == x.dtype
            and cos.is_contiguous() and sin.is_contiguous() and _one_op(x, cos, sin)):  # one C++ op
        return torch.ops.widebeam.rotary(x, cos, sin)
    half = x.shape[-1] // 2
    if x.dtype != torch.float32:
        # transformers' formula, op for op: in bfloat16 each product rounds before the sum.
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos[:, None, :] + rotated * sin[:, None, :]
    # float32: x * cos + cat(-x2, x1) * sin as x * cos plus two in-place halves: three kernels, no
    # negated or concatenated temporaries; equal within float32 rounding (tests/unit/test_layers.py).
    sin = sin[:, None, :]
    out = x * cos[:, None, :]
    out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1)
    out[..., half:].addcmul_(x[..., :half], sin[..., half:])
    return out
