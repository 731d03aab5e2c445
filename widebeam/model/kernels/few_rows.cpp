// A linear layer at a decode step's few rows (1-8), float32, bfloat16 or float16, as one pass over the weight on every thread.
//
// At one to four rows y = x W^T reads the whole weight once and does 2 x rows flops a weight: its time is
// the weight's bytes over the memory bandwidth. MKL's kernels get there only at some shapes (issue #43, on
// an AMD EPYC at 2 threads: SmolLM2-135M's down projection [576, 1536] at 4 rows ran at 13 GB/s as a
// batched product of 8 blocks, its gate/up [3072, 576] at 27 GB/s, and transposing the [out, rows] result
// back to [rows, out] cost 1.7 ms a step on the 49k-row output layer). Here each thread streams a
// contiguous run of output rows and writes [rows, out] directly. One weight row at a time (two vectors
// in flight per input row) keeps the read a single sequential stream, as fast as MKL where MKL is fast;
// but every weight vector then reloads each input row's vector, and once the input rows outgrow half
// the L1 cache (3-4 rows of 1,536 floats: 24 KB against 32 KB) those reloads miss it and the product
// drops to half the bandwidth. There four weight rows share each input vector's load instead.
//
// Each output is one dot product of an input row and a weight row in float32, summed lane-wise and then
// across lanes: another order than MKL's, equal within float32 rounding (tests/unit/test_few_rows_linear.py),
// as the batched-block product it replaces already was (model/linears/split.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <type_traits>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kMaxRows = 8;
// the input rows' bytes past which four weight rows share each input load (half a 32 KB L1)
constexpr int64_t kInputPanelBytes = 16 * 1024;

// Vec::size() values as float32: a bfloat16 or float16 weight is widened on load, summed in float32
inline Vec load_floats(const float* p) { return Vec::loadu(p); }
template <typename T>
inline Vec load_floats(const T* p) {
  Vec out;
  at::vec::load_to_float<T>(p, out);
  return out;
}

inline float lanes_sum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

// out[r, o] for o in [o_begin, o_end) and every r < R: dot(x[r], w[o]) (+ bias[o]), WR weight rows at a
// time with U vectors of each in flight: R x WR x U accumulators.
template <typename T, int R, int WR, int U>
void rows_times_weight(const T* x, int64_t x_stride, const T* w, int64_t in, const T* bias,
                       T* out, int64_t out_stride, int64_t o_begin, int64_t o_end) {
  constexpr int64_t step = U * Vec::size();
  const int64_t vec_end = in - in % step;
  auto finish = [&](int r, int64_t o, const Vec& acc) {
    float sum = lanes_sum(acc);
    for (int64_t i = vec_end; i < in; ++i)
      sum += static_cast<float>(x[r * x_stride + i]) * static_cast<float>(w[o * in + i]);
    // one rounding to T at the end, as F.linear's float32-accumulating 16-bit kernels round
    out[r * out_stride + o] = static_cast<T>(bias ? sum + static_cast<float>(bias[o]) : sum);
  };
  int64_t o = o_begin;
  for (; o + WR <= o_end; o += WR) {
    Vec acc[R][WR][U];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < WR; ++j)
        for (int u = 0; u < U; ++u) acc[r][j][u] = Vec(0.0f);
    const T* w_rows = w + o * in;
    for (int64_t i = 0; i < vec_end; i += step) {
      for (int u = 0; u < U; ++u) {
        Vec xs[R];
        for (int r = 0; r < R; ++r) xs[r] = load_floats(x + r * x_stride + i + u * Vec::size());
        for (int j = 0; j < WR; ++j) {
          const Vec wv = load_floats(w_rows + j * in + i + u * Vec::size());
          for (int r = 0; r < R; ++r) acc[r][j][u] = at::vec::fmadd(xs[r], wv, acc[r][j][u]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < WR; ++j) {
        Vec total = acc[r][j][0];
        for (int u = 1; u < U; ++u) total = total + acc[r][j][u];
        finish(r, o + j, total);
      }
    }
  }
  if (o < o_end) rows_times_weight<T, R, 1, U>(x, x_stride, w, in, bias, out, out_stride, o, o_end);
}

template <typename T, int R>
void rows_times_weight(const T* x, int64_t x_stride, const T* w, int64_t in, const T* bias,
                       T* out, int64_t out_stride, int64_t o_begin, int64_t o_end) {
  if (R > 4) {  // 5-8 rows: two weight rows share each input load (2 x 8 accumulators + 8 inputs)
    rows_times_weight<T, R, 2, 1>(x, x_stride, w, in, bias, out, out_stride, o_begin, o_end);
#if defined(CPU_CAPABILITY_AVX2)
  } else if (R == 1 && std::is_same_v<T, float>) {
    // One float32 row on AVX2 (an AMD EPYC with 8-lane vectors): eight weight rows read side by side, eight
    // streams in flight: 1.01-1.05x one row at a time over SmolLM2's 121 linears (a harness over copies of
    // single weights had shown 1.1-1.7x; benchmarks/few_rows_revision_ab.py). Measured there only: AVX-512
    // keeps one row at a time.
    rows_times_weight<T, 1, 8, 1>(x, x_stride, w, in, bias, out, out_stride, o_begin, o_end);
#endif
  } else if (R * in * static_cast<int64_t>(sizeof(T)) > kInputPanelBytes) {
    rows_times_weight<T, R, 4, 1>(x, x_stride, w, in, bias, out, out_stride, o_begin, o_end);
  } else {
    rows_times_weight<T, R, 1, 2>(x, x_stride, w, in, bias, out, out_stride, o_begin, o_end);
  }
}

template <typename T>
void few_rows_product(const at::Tensor& x, const at::Tensor& weight, const at::Tensor* bias, at::Tensor& out) {
  const int64_t rows = x.size(0), in = x.size(1), out_features = weight.size(0), x_stride = x.stride(0);
  const T* x_data = x.data_ptr<T>();
  const T* w_data = weight.data_ptr<T>();
  const T* bias_data = bias ? bias->data_ptr<T>() : nullptr;
  T* out_data = out.data_ptr<T>();
  // a grain of 64 output rows: small layers still split over the threads, each run long enough to stream
  at::parallel_for(0, out_features, 64, [&](int64_t begin, int64_t end) {
#define WIDEBEAM_ROWS(R) \
  case R: rows_times_weight<T, R>(x_data, x_stride, w_data, in, bias_data, out_data, out_features, begin, end); break;
    switch (rows) {
      WIDEBEAM_ROWS(1) WIDEBEAM_ROWS(2) WIDEBEAM_ROWS(3) WIDEBEAM_ROWS(4)
      WIDEBEAM_ROWS(5) WIDEBEAM_ROWS(6) WIDEBEAM_ROWS(7) WIDEBEAM_ROWS(8)
    }
#undef WIDEBEAM_ROWS
  });
}

at::Tensor few_rows_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "few_rows_linear: float32, bfloat16 or float16 weights, got ", dtype);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == dtype && x.dim() == 2 && x.stride(1) == 1,
              "few_rows_linear: x [rows, in] on the CPU in the weight's dtype, rows contiguous");
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == x.size(1),
              "few_rows_linear: weight [out, in] on the CPU, contiguous, in = x's");
  const int64_t rows = x.size(0), out_features = weight.size(0);
  TORCH_CHECK(rows >= 1 && rows <= kMaxRows, "few_rows_linear: 1 to ", kMaxRows, " rows, got ", rows);
  const at::Tensor* bias_tensor = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == dtype && bias->is_contiguous() &&
                    bias->numel() == out_features,
                "few_rows_linear: bias [out] on the CPU in the weight's dtype");
    bias_tensor = &*bias;
  }
  at::Tensor out = at::empty({rows, out_features}, x.options());
  if (dtype == at::kFloat) {
    few_rows_product<float>(x, weight, bias_tensor, out);
  } else if (dtype == at::kBFloat16) {
    few_rows_product<c10::BFloat16>(x, weight, bias_tensor, out);
  } else {
    few_rows_product<c10::Half>(x, weight, bias_tensor, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(widebeam, m) {
  m.def("few_rows_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(widebeam, CPU, m) {
  m.impl("few_rows_linear", &few_rows_linear);
}
