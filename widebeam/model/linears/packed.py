"""Float32 linear layers with the weight packed once for oneDNN (issue #19).

`F.linear` on CPU hands a plain row-major weight to the matmul library on every call; oneDNN's
inner product with the weight reordered once into its own blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`) reads it faster at the few rows a decode step has.
`pack_linears` swaps every `nn.Linear` of a float32 CPU model (lm_head included) for a
`PackedLinear`; anything else (CUDA, other dtypes, a build without oneDNN) keeps `F.linear`, the
reference. The A/B is benchmarks/linear_backend.py.

Backends: "split", the default (linears/split.py: F.linear's weight run as batched blocks at 1-4
rows); "torch" (F.linear, the reference); "onednn" (the packed weight at every row count, no float
copy kept); "auto" (the packed weight for `PACKED_ROWS` rows, F.linear on the float weight
otherwise: both kept, the linears' weights held twice). Measured over SmolLM2-135M's 211 linears,
1 thread, torch 2.13, Xeon with AMX, the backends alternating pass by pass
(`python benchmarks/linear_backend.py --linears-only --threads 1 --candidate onednn`,
benchmarks/results/linear_backend_linears_threads1.json), F.linear time / oneDNN time: 0.80 at
1 row, 0.83 at 2, 1.28 at 4, 1.22 at 16, 1.06 at 64, 1.01 at 128 and 256, 0.96 at 512.
"""

from __future__ import annotations

import torch

from widebeam.defaults import DEFAULT_LINEAR_BACKEND, LINEAR_BACKENDS
from widebeam.model.families.layers import float32_on_cpu, swap_linears
from widebeam.model.linears.split import onednn_plain_available, split_linears

# "auto": the row counts the packed weight runs (a single row and long prefill chunks: F.linear)
PACKED_ROWS = range(4, 129)


def onednn_available() -> bool:
    """Whether this build can pack a linear weight for oneDNN and run it."""
    if not onednn_plain_available():
        return False
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(2, 2))
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 2), packed, None, "none", [], "")
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return bool(torch.equal(out, torch.full((1, 2), 2.0)))


class PackedLinear(torch.nn.Module):
    """`nn.Linear` in float32 on CPU, the weight held in oneDNN's blocked layout (an mkldnn tensor,
    not a parameter: it is never trained, moved or saved). Same results as `F.linear` within
    float32 rounding (tests/unit/test_packed_linear.py). `keep_weight`: the float weight stays
    reachable as `.weight` (a weight tied to an embedding, alive anyway); otherwise it is freed and
    `.weight` is a plain copy unpacked on each read (for inspection, not for the forward pass).
    `packed_rows`: the row counts that run the packed weight, F.linear on the kept weight otherwise
    (needs `keep_weight`); None: every row count."""

    def __init__(self, linear: torch.nn.Linear, keep_weight: bool = False, packed_rows: range | None = None):
        super().__init__()
        weight = linear.weight.detach()
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError(f"PackedLinear packs float32 CPU weights, got {weight.dtype} on {weight.device}")
        if packed_rows is not None and not keep_weight:
            raise ValueError("packed_rows needs keep_weight: the other row counts run F.linear on the "
                             "float weight")
        self.in_features, self.out_features, self.packed_rows = (linear.in_features, linear.out_features,
                                                                 packed_rows)
        if keep_weight:  # registered before packed_weight exists: __getattr__ has no fallback yet
            self.weight = linear.weight
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        if self.packed_rows is not None and rows.shape[0] not in self.packed_rows:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        if not rows.is_contiguous():
            rows = rows.contiguous()
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none", [], "")
        return out.view(*shape[:-1], self.out_features)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name != "weight":
                raise
            return self.packed_weight.to_dense()  # a plain copy, for inspection (shapes, tests)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")


def pack_linears(model: torch.nn.Module, device: torch.device,
                 backend: str = DEFAULT_LINEAR_BACKEND) -> torch.nn.Module:
    """The linears of a CPU model under `backend`, in place: "split" (the default) as `SplitLinear`s
    (linears/split.py: float32 ones, and bfloat16/float16 ones where the C++ kernels are built);
    "onednn" or "auto" the float32 ones as `PackedLinear`s when this build has oneDNN; otherwise, and
    on other devices, the model unchanged (`F.linear`)."""
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {', '.join(LINEAR_BACKENDS)}, got {backend!r}")
    if backend == "split" and device.type == "cpu":
        return split_linears(model)
    if backend in ("torch", "split") or device.type != "cpu" or not onednn_available():
        return model
    # a weight tied to another module's parameter (lm_head = embed_tokens) stays reachable as .weight
    tied = {id(p) for m in model.modules() if type(m) is not torch.nn.Linear
            for p in m.parameters(recurse=False)}
    rows = PACKED_ROWS if backend == "auto" else None
    return swap_linears(
        model, lambda linear: PackedLinear(linear, backend == "auto" or id(linear.weight) in tied, rows),
        where=float32_on_cpu)
