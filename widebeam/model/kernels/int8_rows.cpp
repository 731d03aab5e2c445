// An int8 linear at a decode step's few rows (1-8), exact: the int32 dot products `torch._int_mm` computes,
// read from the int8 weight itself.
//
// Where FBGEMM's int8 product is not exact (x86 without VNNI sums pairs of u8 x s8 products in int16 with
// saturation), the int8 linears widen the weight to float32 on each call (model/linears/int8.py,
// "float_exact"): exact, but at one row a step then moves nine bytes a weight (the int8 read, the float32
// write and read) where the int8 weight is one. Here each thread streams a run of output rows once: the
// weight's int8 values widened to int16 in registers, multiplied by the rows' int16 values in pairs summed
// to int32 (AVX2's madd: two products of at most 127 x 127 each, no saturation), summed in int32, which
// holds any sum of fewer than 133,000 such products exactly. The output is float(sum) x the channel's scale,
// as `int_mm_product` rounds it: bit for bit (tests/unit/test_int8_linear.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kMaxRows = 8;

#if defined(__AVX2__)
inline int32_t lanes_sum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}
#endif

// out[r, o] = float(sum_i x[r, i] * w[o, i]) * scale[o] for o in [o_begin, o_end), every r < R
template <int R>
void rows_times_int8_weight(const int16_t* x, const int8_t* w, int64_t in, const float* scale, float* out,
                            int64_t out_features, int64_t o_begin, int64_t o_end) {
  for (int64_t o = o_begin; o < o_end; ++o) {
    const int8_t* w_row = w + o * in;
    int32_t sums[R] = {};
    int64_t i = 0;
#if defined(__AVX2__)
    __m256i acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
    for (; i + 16 <= in; i += 16) {
      const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w_row + i)));
      for (int r = 0; r < R; ++r) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + r * in + i));
        acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(wv, xv));
      }
    }
    for (int r = 0; r < R; ++r) sums[r] = lanes_sum(acc[r]);
#endif
    for (; i < in; ++i)
      for (int r = 0; r < R; ++r) sums[r] += static_cast<int32_t>(x[r * in + i]) * static_cast<int32_t>(w_row[i]);
    for (int r = 0; r < R; ++r) out[r * out_features + o] = static_cast<float>(sums[r]) * scale[o];
  }
}

// quantized_rows [rows, in] float32 whole numbers in [-127, 127]; weight [out, in] int8; weight_scale [out]
at::Tensor int8_few_rows(const at::Tensor& quantized_rows, const at::Tensor& weight, const at::Tensor& weight_scale) {
  TORCH_CHECK(quantized_rows.device().is_cpu() && quantized_rows.scalar_type() == at::kFloat &&
                  quantized_rows.dim() == 2,
              "int8_few_rows: quantized_rows [rows, in] float32 on the CPU");
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kChar && weight.dim() == 2 &&
                  weight.is_contiguous() && weight.size(1) == quantized_rows.size(1),
              "int8_few_rows: weight [out, in] int8 on the CPU, contiguous, in = the rows'");
  TORCH_CHECK(weight_scale.scalar_type() == at::kFloat && weight_scale.is_contiguous() &&
                  weight_scale.numel() == weight.size(0),
              "int8_few_rows: weight_scale [out] float32");
  const int64_t rows = quantized_rows.size(0), in = weight.size(1), out_features = weight.size(0);
  TORCH_CHECK(rows >= 1 && rows <= kMaxRows, "int8_few_rows: 1 to ", kMaxRows, " rows, got ", rows);
  // the rows as int16 once (whole numbers: exact), so the product reads them as the weight's partner
  const at::Tensor x16 = quantized_rows.to(at::kShort).contiguous();
  at::Tensor out = at::empty({rows, out_features}, quantized_rows.options());
  const int16_t* x = x16.data_ptr<int16_t>();
  const int8_t* w = weight.data_ptr<int8_t>();
  const float* scale = weight_scale.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  at::parallel_for(0, out_features, 64, [&](int64_t begin, int64_t end) {
#define WIDEBEAM_ROWS(R) \
  case R: rows_times_int8_weight<R>(x, w, in, scale, out_data, out_features, begin, end); break;
    switch (rows) {
      WIDEBEAM_ROWS(1) WIDEBEAM_ROWS(2) WIDEBEAM_ROWS(3) WIDEBEAM_ROWS(4)
      WIDEBEAM_ROWS(5) WIDEBEAM_ROWS(6) WIDEBEAM_ROWS(7) WIDEBEAM_ROWS(8)
    }
#undef WIDEBEAM_ROWS
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(widebeam, m) {
  m.def("int8_few_rows(Tensor quantized_rows, Tensor weight, Tensor weight_scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(widebeam, CPU, m) {
  m.impl("int8_few_rows", &int8_few_rows);
}
