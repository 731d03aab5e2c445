"""Float32 linears at a decode step's few rows (1-8), with every core streaming the weight (issue #19).

At one to a few rows a linear layer is a matrix-vector product: it reads the whole weight once and
does two flops per weight, so its time is the weight's bytes over the memory bandwidth one gets.
`F.linear` on CPU hands it to MKL's sgemv, which runs it on one thread whatever
`torch.set_num_threads` says: SmolLM2-135M's 211 linears at 1 row took 50 ms a step at 2 threads
and 55 at 1, 8-11 GB/s, where a 2-thread sum over the same bytes reads 28 GB/s. Viewing the weight's
output rows as `SPLIT_BLOCKS` blocks, `[blocks, out / blocks, in]`, and the rows' product as one
batched matmul (`torch.bmm`) lets PyTorch run the blocks on every thread: 26 ms at 1 row, 33 at 2,
39 at 4 (`python benchmarks/linear_backend.py --linears-only --candidate split`). The weight is
the same tensor, viewed: no copy, no extra memory. Past `SPLIT_ROWS` (8) rows MKL's sgemm is
parallel and as fast, so `F.linear` runs there; a weight whose output rows do not divide into the
blocks keeps `F.linear` at every row count.

Each output is still one dot product of a row and a weight row, in float32, but summed by another
kernel than `F.linear`'s: equal within float32 rounding (tests/unit/test_split_linear.py), and the
greedy tokens and beams of the parity suite, which runs this backend by default, equal
transformers'. So a row's last bits depend on how many rows its step ran (1-8 or more), as they
already did through the attention kernels; tokens and beams do not.

Where the C++ kernels are built (`make setup`), the split product is `few_rows_linear`
(model/kernels/few_rows.cpp) instead of the batched blocks: the same one pass over the weight on every
thread, but it writes [rows, out] directly (the blocks' [out, rows] result cost a transposing copy, 1.7 ms
a step on SmolLM2's output layer at 4 rows) and keeps 3-4 rows of a wide input at the memory's speed
where the blocks halved it (issue #43). The start-up probe times whichever of the two this process runs.
The kernel also takes bfloat16 and float16 weights (widened to float32 as they load, summed in float32,
rounded once, as `F.linear`'s 16-bit kernels do): where it is built a 16-bit model's linears are
`SplitLinear`s too (not stacked), and the probe decides their row counts the same way; without it they
stay `nn.Linear` (the blocks are float32 only here).

Past 8 rows (a prompt's chunk, a wide step) a float32 linear is a matrix product bound by arithmetic, and
`F.linear` hands it to MKL, whose sgemm ran 40-190 GFLOP/s on the AMD EPYC of issue #43 where oneDNN's
inner product on the same plain weight ran 87-215 (1.1-1.6x at 16-1,024 rows; the 49k-row output layer
at 16 rows 42 vs 87). `SplitLinear` runs such rows through oneDNN (`torch.ops.mkldnn._linear_pointwise`,
the weight as it is: no packed copy, no extra memory) where a start-up probe at `_MANY_PROBE_ROWS` rows
finds it faster on this CPU (`probe_many_rows`); the same dot products, summed in another order (a model
class may keep F.linear: `onednn_many_rows = False` for all of its linears, or `keeps_f_linear(name)` for
some, as T5 names its encoder's and cross K/V's).
"""

from __future__ import annotations

import time

import torch
from torch.nn import functional as F

from widebeam.model import kernels
from widebeam.model.families.layers import float32_on_cpu, half_on_cpu, swap_linears

SPLIT_BLOCKS = 8  # blocks of output rows: a few per thread, each still thousands of weights
SPLIT_ROWS = range(1, 9)  # the row counts the split product may run (the start-up probe decides)
# each row count's probe: timed at 1 row for 1-2, at 4 for 3-4, at 8 for 5-8
_PROBE_ROWS = {1: 1, 2: 1, 3: 4, 4: 4, 5: 8, 6: 8, 7: 8, 8: 8}
# rows past SPLIT_ROWS: oneDNN against F.linear timed at this many (a wide step's, a prompt chunk's order)
_MANY_PROBE_ROWS = 64
# a product of this many rows is bound by arithmetic, not by reading the weight: a small sample will do
_MANY_PROBE_BYTES = 32 * 2**20


def onednn_plain_available() -> bool:
    """Whether this build runs oneDNN's inner product (`torch.ops.mkldnn`) on a plain float32 weight."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 2), torch.ones(2, 2), None, "none", [], "")
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return bool(torch.equal(out, torch.full((1, 2), 2.0)))


class SplitLinear(torch.nn.Module):
    """`nn.Linear` in float32 on CPU whose product at `SPLIT_ROWS` rows runs as `SPLIT_BLOCKS`
    batched blocks of output rows. Holds the original layer's weight and bias (the same tensors;
    a weight tied to the embedding stays tied)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.splits = self.out_features % SPLIT_BLOCKS == 0  # the batched blocks need whole blocks
        self.split_rows: tuple[int, ...] = tuple(SPLIT_ROWS)  # narrowed by the start-up probe
        self.onednn_many_rows = False  # rows past split_rows through oneDNN: set by the start-up probe

    def can_split(self) -> bool:
        """Whether a split product exists for this layer here: the kernel (any shape, a contiguous
        weight, no gradient wanted), else the batched blocks (float32, whole blocks)."""
        return self._kernel_serves() or self._blocks_serve()

    def _kernel_serves(self) -> bool:
        return (kernels.linear_enabled() and self.weight.is_contiguous()
                and not (torch.is_grad_enabled() and self.weight.requires_grad))

    def _blocks_serve(self) -> bool:
        return self.splits and self.weight.dtype == torch.float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] in self.split_rows:
            out = self.split_product(rows)
            if out is not None:
                return out.reshape(*x.shape[:-1], self.out_features)
        elif self.onednn_many_rows and rows.shape[0] and not (torch.is_grad_enabled()
                                                              and self.weight.requires_grad):
            return self.many_rows_product(rows).reshape(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)

    def many_rows_product(self, rows: torch.Tensor) -> torch.Tensor:
        """`rows` [num_rows, in] times the float32 weight, plus the bias, through oneDNN's inner product
        (no backward: not where a gradient is wanted)."""
        return torch.ops.mkldnn._linear_pointwise(rows, self.weight, self.bias, "none", [], "")

    def split_product(self, rows: torch.Tensor) -> torch.Tensor | None:
        """`rows` [num_rows, in] (1-8 rows) times the weight, plus the bias: [num_rows, out]; None where
        no split product serves this layer here (`can_split`), asked once a call."""
        if self._kernel_serves():
            if rows.stride(-1) != 1:
                rows = rows.contiguous()
            return torch.ops.widebeam.few_rows_linear(rows, self.weight, self.bias)
        if not self._blocks_serve():
            return None
        blocks = self.weight.view(SPLIT_BLOCKS, self.out_features // SPLIT_BLOCKS, self.in_features)
        # [blocks, out / blocks, in] x [blocks, in, rows] -> [blocks, out / blocks, rows]
        out = (torch.bmm(blocks, rows.t().expand(SPLIT_BLOCKS, -1, -1)).view(self.out_features, -1)
               .t().contiguous())
        if self.bias is not None:
            out += self.bias
        return out

    @classmethod
    def concat(cls, layers: list[SplitLinear]) -> SplitLinear:
        """One layer computing `layers` (same input) side by side, their weights stacked by output row:
        each output is the same dot product as before (a row of the stacked weight is a row of one
        part), so only the kernel's summation order can differ, as for any `SplitLinear`."""
        if len({layer.in_features for layer in layers}) != 1:
            raise ValueError("concatenated split linears need one input size")
        biases = [layer.bias for layer in layers]
        if any(b is not None for b in biases):
            biases = [torch.zeros(layer.out_features) if b is None else b for layer, b in zip(layers, biases)]
        stacked = torch.nn.Linear(layers[0].in_features, sum(layer.out_features for layer in layers),
                                  bias=biases[0] is not None, device="meta")
        stacked.weight = torch.nn.Parameter(torch.cat([layer.weight.detach() for layer in layers]),
                                            requires_grad=False)
        if biases[0] is not None:
            stacked.bias = torch.nn.Parameter(torch.cat([b.detach() for b in biases]), requires_grad=False)
        return cls(stacked)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")


def split_linears(model: torch.nn.Module) -> torch.nn.Module:
    """Every float32 CPU `nn.Linear` of `model` as a `SplitLinear`, in place; then the layers that read
    one input (q/k/v, gate/up) as one `SplitLinear` each, wherever a module offers `fuse_projections`
    and all its parts were swapped. At a decode step's rows a linear is a fixed cost (waking every
    thread for the batched product) plus the weight's bytes: 7 products a layer become 4, the bytes
    stay the same (A/B vs 53534e3: benchmarks/results/w1perf_ab_*.json)."""
    swap_linears(model, SplitLinear, where=float32_on_cpu)
    if kernels.linear_enabled():
        swap_linears(model, SplitLinear, where=half_on_cpu)
    for module in list(model.modules()):
        fuse = getattr(module, "fuse_projections", None)
        if fuse is not None and _all_split(module):
            fuse(SplitLinear.concat)
    with torch.inference_mode():  # as the engine runs them (the kernel serves no gradient)
        layers = [m for m in model.modules() if isinstance(m, SplitLinear) and m.can_split()]
    if layers:
        split_rows = probe_split_rows(layers)
        for layer in layers:
            layer.split_rows = split_rows
    keeps_f_linear = getattr(model, "keeps_f_linear", lambda name: False)
    float32_layers = [m for name, m in model.named_modules() if isinstance(m, SplitLinear)
                      and m.weight.dtype == torch.float32 and m.weight.is_contiguous()
                      and not keeps_f_linear(name)]
    if (float32_layers and getattr(model, "onednn_many_rows", True) and onednn_plain_available()
            and probe_many_rows(float32_layers)):
        for layer in float32_layers:
            layer.onednn_many_rows = True
    return model


# (layer shapes, threads) -> the row counts the split product runs: one probe per process and shape
_PROBED: dict[tuple, tuple[int, ...]] = {}
_PROBE_REPEATS = 5
_PROBE_MARGIN = 0.97  # the split product must be this much faster: within it, keep the reference
# Weights the probe streams per pass: far beyond the caches, as a decode step's are, yet a bounded
# start-up cost however large the model (a 70B model's every weight, 24 times, would take minutes).
_PROBE_BYTES = 256 * 2**20


def _probe_sample(layers: list[SplitLinear], budget_bytes: int | None = None) -> list[SplitLinear]:
    """The first layers (in model order) whose weights add up to `budget_bytes` (`_PROBE_BYTES`), or all."""
    budget_bytes = _PROBE_BYTES if budget_bytes is None else budget_bytes
    sample, total_bytes = [], 0
    for layer in layers:
        sample.append(layer)
        total_bytes += layer.weight.numel() * layer.weight.element_size()
        if total_bytes >= budget_bytes:
            break
    return sample


def _interleaved_best_s(candidate, reference, repeats: int = _PROBE_REPEATS) -> tuple[float, float]:
    """(candidate's, reference's) best seconds over `repeats` passes each, alternating, after a warm-up."""
    candidate(), reference()
    candidate_s, reference_s = [], []
    for _ in range(repeats):
        for run, times in ((candidate, candidate_s), (reference, reference_s)):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
    return min(candidate_s), min(reference_s)


def probe_many_rows(layers: list[SplitLinear]) -> bool:
    """Whether oneDNN's inner product beats `F.linear` at `_MANY_PROBE_ROWS` rows over the first
    `_MANY_PROBE_BYTES` of these float32 layers' weights (best of interleaved passes, `_PROBE_MARGIN`);
    kept per process, shapes and threads."""
    layers = _probe_sample(layers, _MANY_PROBE_BYTES)
    shapes = tuple((layer.out_features, layer.in_features) for layer in layers)
    key = ("many", shapes, torch.get_num_threads())
    if key not in _PROBED:
        inputs = [torch.randn(_MANY_PROBE_ROWS, layer.in_features) for layer in layers]
        with torch.inference_mode():
            onednn_s, linear_s = _interleaved_best_s(
                lambda: [layer.many_rows_product(x) for layer, x in zip(layers, inputs)],
                lambda: [F.linear(x, layer.weight, layer.bias) for layer, x in zip(layers, inputs)])
        _PROBED[key] = onednn_s < _PROBE_MARGIN * linear_s
    return _PROBED[key]


def probe_split_rows(layers: list[SplitLinear]) -> tuple[int, ...]:
    """The row counts of `SPLIT_ROWS` at which the split product beats `F.linear` on this CPU: timed at
    1 row (deciding 1 and 2), at 4 (deciding 3 and 4) and at 8 (deciding 5 to 8) over the layers'
    weights in turn (the first `_PROBE_BYTES` of them), as a decode step streams them from memory (one
    weight alone would sit in the cache), best of `_PROBE_REPEATS` interleaved passes each. Where the
    split paid on one CPU (an AMD EPYC: 26 vs 50 ms a step at 1 row) it lost on another (an Intel
    Xeon: ~100 vs ~55 ms), so it is measured, not assumed. Both are the same dot products (equal within
    float32 rounding); the answer is kept per process, shape and product, so every engine of a process
    runs the same kernels."""
    layers = _probe_sample(layers)
    dtype = layers[0].weight.dtype
    key = (tuple((layer.out_features, layer.in_features) for layer in layers), dtype, torch.get_num_threads(),
           kernels.linear_enabled())
    if key in _PROBED:
        return _PROBED[key]
    inputs = {n: torch.randn(max(SPLIT_ROWS), layer.in_features).to(layer.weight.dtype)
              for n, layer in enumerate(layers)}

    def split_pass(num_rows: int) -> None:
        for n, layer in enumerate(layers):
            layer.split_product(inputs[n][:num_rows])

    def linear_pass(num_rows: int) -> None:  # the same work as the split product
        for n, layer in enumerate(layers):
            F.linear(inputs[n][:num_rows], layer.weight, layer.bias)

    pays = {}
    with torch.inference_mode():
        for num_rows in sorted(set(_PROBE_ROWS.values())):
            split_s, linear_s = _interleaved_best_s(lambda n=num_rows: split_pass(n),
                                                    lambda n=num_rows: linear_pass(n))
            pays[num_rows] = split_s < _PROBE_MARGIN * linear_s
    split_rows = tuple(r for r in SPLIT_ROWS if pays[_PROBE_ROWS[r]])
    _PROBED[key] = split_rows
    return split_rows


def _all_split(module: torch.nn.Module) -> bool:
    """Every linear a `fuse_projections` would stack is a float32 `SplitLinear` (a layer left as
    `nn.Linear`, or a 16-bit one, keeps its parts apart)."""
    names = getattr(module, "FUSED_PARTS", ())
    parts = [getattr(module, name, None) for name in names]
    return bool(names) and all(isinstance(part, SplitLinear) and part.weight.dtype == torch.float32
                               for part in parts)
