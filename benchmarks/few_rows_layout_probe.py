"""A probe for the next step of the few-row linears: `few_rows_linear` (dot products along each weight row)
against a packed layout (the weight as panels of 64 outputs x the input, each input broadcast into 4 x R
accumulators: no horizontal sums, one contiguous stream), both over weights past the caches.

    python benchmarks/few_rows_layout_probe.py

Not a kernel widebeam runs: a packed copy beside each weight would double the linears' memory, and the
many-row products (MKL, oneDNN) read the plain layout. It measures what the layout would buy, to decide
whether a single packed copy serving both paths is worth building. The packed kernel is compiled on the spot
(torch.utils.cpp_extension.load_inline, AVX-512 only) and checked against `x @ W^T` before it is timed; the
two are interleaved, best of 5 a repeat, 3 repeats. Writes benchmarks/results/few_rows_layout_probe.json.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

// weight packed [out / 64][in][64]; x [R, in]; out [R, out]: per input, 4 vectors of 16 outputs
// times R broadcast inputs into 4 x R accumulators
template <int R>
void blocks(const float* x, int64_t in, const float* packed, float* out, int64_t out_features,
            int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < 4; ++u) acc[r][u] = _mm512_setzero_ps();
    const float* w = packed + b * in * 64;
    for (int64_t i = 0; i < in; ++i) {
      __m512 wv[4];
      for (int u = 0; u < 4; ++u) wv[u] = _mm512_loadu_ps(w + i * 64 + 16 * u);
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_set1_ps(x[r * in + i]);
        for (int u = 0; u < 4; ++u) acc[r][u] = _mm512_fmadd_ps(xv, wv[u], acc[r][u]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < 4; ++u) _mm512_storeu_ps(out + r * out_features + b * 64 + 16 * u, acc[r][u]);
  }
}

at::Tensor pack(const at::Tensor& w) {  // [out, in] -> [out / 64, in, 64]
  const int64_t o = w.size(0), in = w.size(1);
  TORCH_CHECK(o % 64 == 0, "out a multiple of 64");
  return w.view({o / 64, 64, in}).transpose(1, 2).contiguous();
}

at::Tensor run(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  const int64_t rows = x.size(0), in = x.size(1);
  TORCH_CHECK(rows == 1 || rows == 2 || rows == 4, "1, 2 or 4 rows");
  at::Tensor out = at::empty({rows, out_features}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* w = packed.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, out_features / 64, 1, [&](int64_t b0, int64_t b1) {
    if (rows == 1) blocks<1>(xp, in, w, op, out_features, b0, b1);
    if (rows == 2) blocks<2>(xp, in, w, op, out_features, b0, b1);
    if (rows == 4) blocks<4>(xp, in, w, op, out_features, b0, b1);
  });
  return out;
}
"""
# (out, in, copies): t5-small's attention, FFN in and out, its head; SmolLM2-135M's gate/up and down
SHAPES = ((512, 512, 64), (2048, 512, 16), (512, 2048, 16), (32128 // 64 * 64, 512, 1), (3072, 576, 12),
          (576, 1536, 24))


def each(op, x, weights, extra):
    """One call of `op(x, w, extra)` per weight, as a run."""
    return lambda: [op(x, w, extra) for w in weights]


def best_rate(run, num_bytes: int, calls: int = 2) -> float:
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            run()
        best = min(best, (time.perf_counter() - start) / calls)
    return num_bytes / best / 1e9


def main() -> None:
    from torch.utils.cpp_extension import load_inline

    from widebeam.model import kernels

    if not kernels.available() or "AVX512" not in (kernels.cpu_capability() or ""):
        sys.exit("needs the C++ kernels built (make setup) on an AVX-512 CPU")
    torch.set_num_threads(2)
    packed = load_inline("few_rows_layout_probe", cpp_sources=SOURCE, functions=["pack", "run"],
                         extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
    points = []
    for rows in (1, 4):
        for out_features, in_features, copies in SHAPES:
            weights = [torch.randn(out_features, in_features) for _ in range(copies)]
            panels = [packed.pack(w) for w in weights]
            x = torch.randn(rows, in_features)
            torch.testing.assert_close(packed.run(x, panels[0], out_features), x @ weights[0].T, atol=1e-3,
                                       rtol=1e-3)
            num_bytes = sum(w.numel() for w in weights) * 4
            few, pack = [], []
            for _ in range(3):
                few.append(best_rate(each(torch.ops.widebeam.few_rows_linear, x, weights, None), num_bytes))
                pack.append(best_rate(each(packed.run, x, panels, out_features), num_bytes))
            point = {"rows": rows, "out": out_features, "in": in_features, "weights_bytes": num_bytes,
                     "few_rows_gb_s": max(few), "packed_gb_s": max(pack)}
            points.append(point)
            print(f"{rows} rows [{out_features}, {in_features}] x{copies}: few_rows_linear "
                  f"{max(few):.1f} GB/s, packed {max(pack):.1f} GB/s", flush=True)
    out = ROOT / "benchmarks/results/few_rows_layout_probe.json"
    out.write_text(json.dumps({"command": "python benchmarks/few_rows_layout_probe.py", "threads": 2,
                               "points": points}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
