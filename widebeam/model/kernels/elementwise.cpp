// A decoder layer's per-token elementwise work as one op each: RMSNorm, the rotary embedding and the gated
// MLP's SiLU(gate) * up.
//
// Why: at a decode step's few rows these are launches, not arithmetic. The torch formula of an RMSNorm
// is 6-7 eager ops (pow, mean, add, rsqrt, two products; ~25 us for one row of 576 on a 2-core AMD EPYC,
// 61 of them a step of SmolLM2-135M: 1.5 ms of a 27 ms W=1 step), the rotary 5 (~19 us, 30 a step).
// Here each is one pass over its rows (~2 us).
//
// Same formulas as model/families/layers.py (the reference, and the only path on CUDA or with a gradient):
// RMSNorm in float32 whatever the dtype, y = (x * rsqrt(mean(x^2) + eps)) * w (w or 1 + w), rounded once
// to the input's dtype; the sum of squares in 16 lanes, another order than torch's mean (within float32
// rounding). Rotary: float32 as x * cos, then each half plus the other half times sin (-x2 * sin1,
// +x1 * sin2); 16-bit as transformers does it, each product and the sum rounded to the dtype. SiLU and
// product: silu(g) = g / (1 + exp(-g)) in float32 rounded to the dtype, then times up rounded again (the
// two ops torch runs); at a wide step it reads the fused gate/up output once instead of three times.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

// x [..., hidden] (rows contiguous), weight [hidden] -> y like x.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool unit_offset) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "rms_norm: CPU tensors");
  TORCH_CHECK(x.dim() >= 1 && x.is_contiguous(), "rms_norm: x contiguous [..., hidden]");
  const int64_t hidden = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden && weight.is_contiguous(),
              "rms_norm: weight [hidden] matching x");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() || weight.scalar_type() == at::kFloat,
              "rms_norm: weight in x's dtype or float32");
  at::Tensor out = at::empty_like(x);
  const int64_t rows = hidden == 0 ? 0 : x.numel() / hidden;
  if (rows == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    using T = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, weight.scalar_type(), "rms_norm_weight", [&] {
      using W = scalar_t;
      const T* src = x.data_ptr<T>();
      const W* w = weight.data_ptr<W>();
      T* dst = out.data_ptr<T>();
      // one row is ~1 us of work: split only when there are many (a prompt's)
      at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / hidden), [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          const T* xr = src + r * hidden;
          T* yr = dst + r * hidden;
          float lanes[16] = {};
          int64_t j = 0;
          for (; j + 16 <= hidden; j += 16) {
            for (int t = 0; t < 16; ++t) {
              const float v = static_cast<float>(xr[j + t]);
              lanes[t] += v * v;
            }
          }
          float sum = 0.0f;
          for (int t = 0; t < 16; ++t) sum += lanes[t];
          for (; j < hidden; ++j) sum += static_cast<float>(xr[j]) * static_cast<float>(xr[j]);
          const float scale = 1.0f / std::sqrt(sum / static_cast<float>(hidden) + static_cast<float>(eps));
          for (j = 0; j < hidden; ++j) {
            const float wj = unit_offset ? 1.0f + static_cast<float>(w[j]) : static_cast<float>(w[j]);
            yr[j] = static_cast<T>((static_cast<float>(xr[j]) * scale) * wj);
          }
        }
      });
    });
  });
  return out;
}

// x [tokens, heads, head_dim] (head_dim contiguous, any token and head strides), cos/sin [tokens,
// head_dim] -> contiguous [tokens, heads, head_dim], the half-rotation layout (the full head rotates).
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu(), "rotary: CPU tensors");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary: x [tokens, heads, head_dim], head_dim contiguous");
  const int64_t tokens = x.size(0), heads = x.size(1), head_dim = x.size(2), half = head_dim / 2;
  TORCH_CHECK(head_dim % 2 == 0, "rotary: an even head_dim");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == tokens && cos.size(1) == head_dim &&
                  cos.is_contiguous() && sin.is_contiguous(),
              "rotary: cos, sin contiguous [tokens, head_dim]");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rotary: cos, sin in x's dtype");
  at::Tensor out = at::empty({tokens, heads, head_dim}, x.options());
  if (out.numel() == 0) return out;
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary", [&] {
    using T = scalar_t;
    const T* src = x.data_ptr<T>();
    const T* c = cos.data_ptr<T>();
    const T* s = sin.data_ptr<T>();
    T* dst = out.data_ptr<T>();
    at::parallel_for(0, tokens * heads, std::max<int64_t>(1, 16384 / head_dim), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t t = i / heads, h = i % heads;
        const T* xr = src + t * token_stride + h * head_stride;
        const T* ct = c + t * head_dim;
        const T* st = s + t * head_dim;
        T* yr = dst + i * head_dim;
        for (int64_t j = 0; j < head_dim; ++j) {
          // rotate_half: (-x2, x1)
          const T rotated = j < half ? static_cast<T>(-xr[j + half]) : xr[j - half];
          if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
            yr[j] = xr[j] * ct[j] + rotated * st[j];
          } else {
            const T first = static_cast<T>(static_cast<float>(xr[j]) * static_cast<float>(ct[j]));
            const T second = static_cast<T>(static_cast<float>(rotated) * static_cast<float>(st[j]));
            yr[j] = static_cast<T>(static_cast<float>(first) + static_cast<float>(second));
          }
        }
      }
    });
  });
  return out;
}

// x [..., 2 * inter] (gate then up, rows contiguous) -> silu(gate) * up [..., inter].
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && x.is_contiguous() && x.size(-1) % 2 == 0,
              "silu_and_mul: x contiguous [..., 2 * inter] on the CPU");
  const int64_t inter = x.size(-1) / 2;
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = inter;
  at::Tensor out = at::empty(sizes, x.options());
  const int64_t rows = inter == 0 ? 0 : x.numel() / (2 * inter);
  if (rows == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    using T = scalar_t;
    const T* src = x.data_ptr<T>();
    T* dst = out.data_ptr<T>();
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / inter), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* gate = src + r * 2 * inter;
        const T* up = gate + inter;
        T* y = dst + r * inter;
        if constexpr (std::is_same_v<T, float>) {
          using Vec = at::vec::Vectorized<float>;
          const Vec one(1.0f);
          for (int64_t j = 0; j < inter; j += Vec::size()) {
            const int64_t count = std::min<int64_t>(Vec::size(), inter - j);  // a partial vector at the tail
            const Vec g = Vec::loadu(gate + j, count);
            const Vec silu = g / (one + g.neg().exp());
            (silu * Vec::loadu(up + j, count)).store(y + j, count);
          }
        } else {
          for (int64_t j = 0; j < inter; ++j) {
            const float g = static_cast<float>(gate[j]);
            const T silu = static_cast<T>(g / (1.0f + std::exp(-g)));
            y[j] = static_cast<T>(static_cast<float>(silu) * static_cast<float>(up[j]));
          }
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(widebeam, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool unit_offset) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(widebeam, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary", &rotary);
  m.impl("silu_and_mul", &silu_and_mul);
}
