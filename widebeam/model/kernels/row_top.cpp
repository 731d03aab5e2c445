// A beam step's per-row top-k of the log-softmax, without writing the log-softmax or copying the row.
//
// torch.topk(torch.log_softmax(x, 1), k) writes a [rows, vocab] tensor, then copies every row into a
// vector of (value, index) pairs (16 bytes an entry: 786 KB a row on a 49k vocabulary) and partial-sorts
// it. Here each row is read three times from cache and nothing row-sized is written: its max and the sum
// of exp(x - max) by the very templates torch's log-softmax uses (ATen/native/cpu/LogSoftmaxKernelImpl.h:
// vec::reduce_all, vec::map_reduce_all with Vectorized::exp, then Vectorized::log), so every value is the
// log-softmax's own bit for bit; then one scan that normalises a vector of 16 at a time and lets through
// only what beats the current k-th best, into the same heap std::partial_sort keeps (libstdc++'s
// __heap_select: make_heap of the first k, a pop_heap per better element, sort_heap at the end) with
// torch's comparator, so the k tokens and their order, ties included, are torch.topk's.
//
// Only the partial-sort regime (k * 64 <= vocab, where torch.topk partial-sorts) is served; the caller
// keeps the torch path for the rest. The build defines CPU_CAPABILITY for the capability torch dispatches
// to on this machine (build.py), so Vectorized<float> here is the one torch's kernel ran with; the loader
// enables this op only while torch reports that capability (kernels/__init__.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using Vec = at::vec::Vectorized<float>;
using Entry = std::pair<float, int64_t>;

// torch's topk comparator (largest=True): NaN first, then the larger value; nothing else decides.
inline bool before(const Entry& x, const Entry& y) {
  return (std::isnan(x.first) && !std::isnan(y.first)) || (x.first > y.first);
}

// One row's k best of (x - max) - lse, as std::partial_sort over the whole row would leave them.
void row_top(const float* x, int64_t vocab, int64_t k, float* values, int64_t* tokens, Entry* heap) {
  const float max = at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, x, vocab);
  const float sum = at::vec::map_reduce_all<float>([max](Vec a) { return (a - Vec(max)).exp(); },
                                                   [](Vec a, Vec b) { return a + b; }, x, vocab);
  float lse_lane[Vec::size()];
  Vec(sum).log().store(lse_lane);
  const float lse = lse_lane[0];
  auto normalised = [max, lse](float value) { return value - max - lse; };  // the kernel's order of ops

  for (int64_t j = 0; j < k; ++j) heap[j] = Entry(normalised(x[j]), j);
  std::make_heap(heap, heap + k, before);
  // An entry enters when it goes before the heap's top (its current k-th): `before(e, top)`.
  auto offer = [&](int64_t j) {
    const Entry entry(normalised(x[j]), j);
    if (before(entry, heap[0])) {
      heap[k] = entry;
      std::pop_heap(heap, heap + k + 1, before);  // = __pop_heap(first, middle, &entry): top out, entry in
    }
  };
  int64_t j = k;
#if defined(__AVX512F__)
  const __m512 v_max = _mm512_set1_ps(max), v_lse = _mm512_set1_ps(lse);
  for (; j + 16 <= vocab; j += 16) {
    if (std::isnan(heap[0].first)) break;  // nothing goes before a NaN top: the scalar loop says so
    const __m512 value = _mm512_sub_ps(_mm512_sub_ps(_mm512_loadu_ps(x + j), v_max), v_lse);
    // not (value <= top), unordered true: the value is larger, or NaN
    __mmask16 pass = _mm512_cmp_ps_mask(value, _mm512_set1_ps(heap[0].first), _CMP_NLE_UQ);
    while (pass) {
      const int lane = __builtin_ctz(pass);
      pass &= pass - 1;
      offer(j + lane);  // the top only rises, so a later lane is tested again against the new top
    }
  }
#endif
  for (; j < vocab; ++j) offer(j);
  std::sort_heap(heap, heap + k, before);
  for (int64_t i = 0; i < k; ++i) {
    values[i] = heap[i].first;
    tokens[i] = heap[i].second;
  }
}

std::tuple<at::Tensor, at::Tensor> log_softmax_topk(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "log_softmax_topk: float32 [rows, vocab] on the CPU");
  TORCH_CHECK(x.stride(1) == 1, "log_softmax_topk: rows contiguous");
  const int64_t rows = x.size(0), vocab = x.size(1), row_stride = x.stride(0);
  TORCH_CHECK(k >= 1 && k * 64 <= vocab, "log_softmax_topk: 1 <= k and k * 64 <= vocab (torch.topk's "
              "partial-sort regime), got k=", k, " vocab=", vocab);
  at::Tensor values = at::empty({rows, k}, x.options());
  at::Tensor tokens = at::empty({rows, k}, x.options().dtype(at::kLong));
  const float* data = x.data_ptr<float>();
  float* value_out = values.data_ptr<float>();
  int64_t* token_out = tokens.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<Entry> heap(k + 1);
    for (int64_t row = begin; row < end; ++row) {
      row_top(data + row * row_stride, vocab, k, value_out + row * k, token_out + row * k, heap.data());
    }
  });
  return {values, tokens};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(widebeam, m) {
  m.def("log_softmax_topk(Tensor x, int k) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(widebeam, CPU, m) {
  m.impl("log_softmax_topk", &log_softmax_topk);
}
