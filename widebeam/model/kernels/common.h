// What the KV kernels share (int8_kv.cpp writes the int8 pool, attention.cpp reads it and dense caches):
// the int8 pool's layout check, a vectorizable exp for the softmax, bfloat16 rounding as torch rounds, and
// 16 floats as one register-held value.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Half.h>

#include <algorithm>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace widebeam_kernels {

// Pool layout (one layer): pair_values int8 [2, num_slots, kv_heads, head_dim], pair_scales float16
// [2, num_slots, kv_heads, groups]; K at 0, V at 1.
inline void check_pool(const at::Tensor& pair_values, const at::Tensor& pair_scales) {
  TORCH_CHECK(pair_values.device().is_cpu() && pair_scales.device().is_cpu(), "int8 KV kernels: CPU pools");
  TORCH_CHECK(pair_values.scalar_type() == at::kChar && pair_values.dim() == 4 && pair_values.size(0) == 2,
              "pair_values: int8 [2, num_slots, kv_heads, head_dim]");
  TORCH_CHECK(pair_scales.scalar_type() == at::kHalf && pair_scales.dim() == 4 && pair_scales.size(0) == 2,
              "pair_scales: float16 [2, num_slots, kv_heads, groups]");
  TORCH_CHECK(pair_scales.size(1) == pair_values.size(1) && pair_scales.size(2) == pair_values.size(2),
              "pair_scales and pair_values: the same slots and KV heads");
  TORCH_CHECK(pair_values.size(3) % pair_scales.size(3) == 0, "head_dim a multiple of the scale groups");
  TORCH_CHECK(pair_values.is_contiguous() && pair_scales.is_contiguous(), "contiguous pools");
}

// x rounded to bfloat16 (to nearest, ties to even) and back: what the torch path's bfloat16 reads hold.
inline float round_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

// 16 floats as one value (GCC vector extension): one AVX-512 register, two AVX2 ones where -march=native
// has no AVX-512. Accumulators held in these stay in registers, which plain arrays do not reliably.
using Vec16 = float __attribute__((vector_size(64)));
inline Vec16 load16(const float* p) {
  Vec16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store16(float* p, const Vec16& v) { std::memcpy(p, &v, sizeof v); }

// exp(x) for x <= 0 (scores less their row's max), branch-free so the loops over it vectorize: Cephes'
// expf (range reduction by ln 2 in two parts, degree-6 polynomial), within 2 ulp of std::exp; below -87
// it flushes to ~0 as the true value does. One formula for a float and for 16 lanes (Vec16, each lane the
// float's result): written out in vectors because GCC leaves a loop over the float one partly scalar (~2x
// slower over a softmax's scores).
using IVec16 = int32_t __attribute__((vector_size(64)));
template <typename T>
inline T exp_nonpositive_of(T x) {
  const T lowest = T{} - 87.0f;
  x = x < lowest ? lowest : x;
  // round to nearest by the 1.5 * 2^23 trick (no call to floor or nearbyint: the loop stays vectorized)
  const T n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const T r = x - n * 0.693359375f + n * 2.12194440e-4f;
  T p = T{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  T two_n;
  if constexpr (std::is_same_v<T, float>) {
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    std::memcpy(&two_n, &bits, sizeof two_n);
  } else {
    const IVec16 bits = (__builtin_convertvector(n, IVec16) + 127) << 23;
    std::memcpy(&two_n, &bits, sizeof two_n);
  }
  return p * two_n;
}
inline float exp_nonpositive(float x) { return exp_nonpositive_of(x); }
inline Vec16 vexp_nonpositive(Vec16 x) { return exp_nonpositive_of(x); }

// a . b over n floats: 16 lanes at a time, then the lanes and the tail (a reduction the compiler does not
// vectorize itself without -ffast-math).
inline float dot(const float* a, const float* b, int64_t n) {
  Vec16 acc = {};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) acc += load16(a + j) * load16(b + j);
  float lanes[16];
  store16(lanes, acc);
  float sum = 0.0f;
  for (int t = 0; t < 16; ++t) sum += lanes[t];
  for (; j < n; ++j) sum += a[j] * b[j];
  return sum;
}
}  // namespace widebeam_kernels
