// An int8 linear's activations quantized per row in one op: each row's scale max|row| / 127 (at least
// 1e-12 / 127) and the row divided by it, rounded half to even and clamped to [-127, 127], kept in
// float32 (whole numbers, exact). The formula of model/linears/int8.py's `quantize_rows` (the reference,
// and the path on CUDA or with a gradient), bit for bit: the same float32 division and rounding; a NaN
// in a row makes its scale NaN, as torch's amax does.
//
// Why: the torch formula is 7 eager ops (abs, amax, clamp_min, two divisions, round, clamp_) before every
// int8 linear; at a decode step's few rows they cost more than the product (t5-small int8 at W=4: 49
// linears a step).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>

namespace {

// a < b, with a NaN b taken as the larger (so a NaN anywhere in a row reaches its max, as in torch)
inline float nan_max(float a, float b) { return (b > a || b != b) ? b : a; }

std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& rows) {
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == at::kFloat && rows.dim() == 2 &&
                  rows.is_contiguous(),
              "quantize_rows: contiguous float32 [rows, in] on the CPU");
  const int64_t num_rows = rows.size(0), width = rows.size(1);
  at::Tensor quantized = at::empty_like(rows);
  at::Tensor scales = at::empty({num_rows, 1}, rows.options());
  const float* src = rows.data_ptr<float>();
  float* dst = quantized.data_ptr<float>();
  float* scale_data = scales.data_ptr<float>();
  at::parallel_for(0, num_rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, width)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* x = src + r * width;
      float lanes[16] = {};
      int64_t j = 0;
      for (; j + 16 <= width; j += 16) {
        for (int t = 0; t < 16; ++t) lanes[t] = nan_max(lanes[t], std::fabs(x[j + t]));
      }
      float max_abs = 0.0f;
      for (int t = 0; t < 16; ++t) max_abs = nan_max(max_abs, lanes[t]);
      for (; j < width; ++j) max_abs = nan_max(max_abs, std::fabs(x[j]));
      // clamp_min keeps a NaN (std::max returns its first argument unless it is less)
      const float scale = std::max(max_abs, 1e-12f) / 127.0f;
      scale_data[r] = scale;
      float* q = dst + r * width;
      for (j = 0; j < width; ++j) q[j] = std::min(std::max(std::nearbyint(x[j] / scale), -127.0f), 127.0f);
    }
  });
  return {quantized, scales};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(widebeam, m) { m.def("quantize_rows(Tensor rows) -> (Tensor, Tensor)"); }

TORCH_LIBRARY_IMPL(widebeam, CPU, m) { m.impl("quantize_rows", &quantize_rows); }
