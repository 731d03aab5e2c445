// widebeam's int8 KV cache on the CPU: the write (quantize K/V into the pool), one op instead of the ~15
// eager ops the torch path launches a layer (model/attention/quantized_kv.py is the format and the
// reference); the read is attention.cpp's.
//
// Pool layout (one layer): pair_values int8 [2, num_slots, kv_heads, head_dim], pair_scales float16
// [2, num_slots, kv_heads, groups]; K at 0 (stored rotated by the Walsh-Hadamard matrix), V at 1.
//
// Built by build.py (never at import or run time) with -O3 -march=native; no -ffast-math: the write must
// round exactly as the torch path does (division, not a multiply by the reciprocal; round half to even).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>

#include "common.h"

namespace {

using widebeam_kernels::check_pool;

constexpr float kInt8Max = 127.0f;
// float16's smallest subnormal and largest finite value (quantized_kv._MIN_SCALE, _MAX_SCALE)
constexpr float kMinScale = 5.9604644775390625e-08f;  // 2^-24
constexpr float kMaxScale = 65504.0f;

// One token's head (K or V), head_dim floats already in the stored domain -> int8 values and float16
// scales, as quantized_kv.quantize: scale = clamp(max|x| / 127, 2^-24, 65504) rounded to float16, value =
// round_half_even(x / float(scale)) clamped to +-127.
inline void quantize_head(const float* x, int64_t head_dim, int64_t groups, int8_t* values,
                          c10::Half* scales) {
  const int64_t group_size = head_dim / groups;
  for (int64_t g = 0; g < groups; ++g) {
    const float* xg = x + g * group_size;
    float amax = 0.0f;
    for (int64_t j = 0; j < group_size; ++j) amax = std::max(amax, std::fabs(xg[j]));
    const c10::Half scale_half(std::min(std::max(amax / kInt8Max, kMinScale), kMaxScale));
    const float scale = static_cast<float>(scale_half);
    scales[g] = scale_half;
    for (int64_t j = 0; j < group_size; ++j) {
      // nearbyint under the default rounding mode: half to even, as torch.round
      const float q = std::nearbyint(xg[j] / scale);
      values[g * group_size + j] = static_cast<int8_t>(std::min(std::max(q, -kInt8Max), kInt8Max));
    }
  }
}

void quantize_write(const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& rotation_k,
                    const at::Tensor& slots, at::Tensor pair_values, at::Tensor pair_scales) {
  check_pool(pair_values, pair_scales);
  const int64_t num_slots = pair_values.size(1), kv_heads = pair_values.size(2);
  const int64_t head_dim = pair_values.size(3), groups = pair_scales.size(3);
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat, "k, v: float32");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == kv_heads && k.size(2) == head_dim,
              "k, v: [tokens, kv_heads, head_dim] matching the pool");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "k, v: contiguous");
  const int64_t tokens = k.size(0);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == tokens &&
                  slots.is_contiguous() && slots.device().is_cpu(),
              "slots: int64 [tokens]");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "slot ", slot[t], " out of range [0, ", num_slots, ")");
  }
  at::Tensor k_stored = k;
  if (rotation_k.has_value() && rotation_k->defined()) {
    const at::Tensor& rotation = *rotation_k;
    TORCH_CHECK(rotation.scalar_type() == at::kFloat && rotation.dim() == 2 && rotation.size(0) == head_dim &&
                    rotation.size(1) == head_dim,
                "rotation_k: float32 [head_dim, head_dim]");
    // The same ATen product the torch path runs (x.float() @ rotation): the same summation order, so the
    // rotated K -- and every value and scale quantized from it -- is bit for bit the torch path's.
    k_stored = at::matmul(k, rotation).contiguous();
  }
  const float* kx = k_stored.data_ptr<float>();
  const float* vx = v.data_ptr<float>();
  int8_t* values = pair_values.data_ptr<int8_t>();
  c10::Half* scales = pair_scales.data_ptr<c10::Half>();
  const int64_t heads_total = tokens * kv_heads;  // per K and per V
  // A decode step writes a handful of heads: inline below ~64 of them (a fork costs more than the work).
  at::parallel_for(0, 2 * heads_total, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t which = i / heads_total, rest = i % heads_total;  // 0: K, 1: V
      const int64_t t = rest / kv_heads, h = rest % kv_heads;
      const float* x = (which == 0 ? kx : vx) + rest * head_dim;
      const int64_t dst = (which * num_slots + slot[t]) * kv_heads + h;
      quantize_head(x, head_dim, groups, values + dst * head_dim, scales + dst * groups);
    }
  });
}

}  // namespace

TORCH_LIBRARY(widebeam, m) {
  m.def("quantize_write(Tensor k, Tensor v, Tensor? rotation_k, Tensor slots, Tensor(a!) pair_values, "
        "Tensor(b!) pair_scales) -> ()");
}

TORCH_LIBRARY_IMPL(widebeam, CPU, m) {
  m.impl("quantize_write", &quantize_write);
}
