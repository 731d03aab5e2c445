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
#include <optional>
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

// The sum of exp(x - max) over a row, as at::vec::map_reduce_all sums it for torch's log-softmax (one
// accumulator, vectors in order, the tail blended in by Vec::set, then vec_reduce_all): the same bits.
// Written out only to prefetch `next` (the row after, or null) into L2 a line per vector while the exps
// run: the exps are compute-bound, so the next row's read from memory costs nothing here instead of
// stalling its max pass.
float sum_exp(const float* x, int64_t vocab, float max, const float* next) {
  const Vec v_max(max);
  auto map = [&v_max](Vec a) { return (a - v_max).exp(); };
  auto add = [](Vec a, Vec b) { return a + b; };
  if (vocab < Vec::size()) return at::vec::vec_reduce_all<float>(add, map(Vec::loadu(x, vocab)), vocab);
  int64_t d = Vec::size();
  Vec acc = map(Vec::loadu(x));
  const int64_t whole = vocab - vocab % Vec::size();
  for (; d < whole; d += Vec::size()) {
    if (next != nullptr) __builtin_prefetch(next + d, 0, 2);  // read, into L2
    acc = add(acc, map(Vec::loadu(x + d)));
  }
  if (vocab - d > 0) acc = Vec::set(acc, add(acc, map(Vec::loadu(x + d, vocab - d))), vocab - d);
  return at::vec::vec_reduce_all<float>(add, acc);
}

// A row's max as torch's log-softmax takes it (at::vec::maximum: NaN wins), over four accumulators: a
// max does not depend on the order it is taken in, and one accumulator's chain of NaN-aware maxima cost
// three times the four's (7-8 us a 49k row against 2).
float row_max(const float* x, int64_t vocab) {
  auto max_of = [](const Vec& a, const Vec& b) { return at::vec::maximum(a, b); };
  constexpr int64_t n = Vec::size();
  if (vocab < 4 * n) return at::vec::reduce_all<float>(max_of, x, vocab);
  Vec acc0 = Vec::loadu(x), acc1 = Vec::loadu(x + n), acc2 = Vec::loadu(x + 2 * n), acc3 = Vec::loadu(x + 3 * n);
  int64_t j = 4 * n;
  for (; j + 4 * n <= vocab; j += 4 * n) {
    acc0 = max_of(acc0, Vec::loadu(x + j));
    acc1 = max_of(acc1, Vec::loadu(x + j + n));
    acc2 = max_of(acc2, Vec::loadu(x + j + 2 * n));
    acc3 = max_of(acc3, Vec::loadu(x + j + 3 * n));
  }
  Vec acc = max_of(max_of(acc0, acc1), max_of(acc2, acc3));
  float lanes[n];
  acc.store(lanes);
  auto max1 = [](float a, float b) { return std::isnan(a) || a >= b ? a : b; };  // NaN wins, either side
  float max = lanes[0];
  for (int64_t i = 1; i < n; ++i) max = max1(max, lanes[i]);
  for (; j < vocab; ++j) max = max1(max, x[j]);
  return max;
}

// The largest raw logit that cannot beat `top` once normalised, or -inf where none is known. Float
// subtraction is monotone, so x <= t gives (x - max) - lse <= (t - max) - lse <= top: such an x is never
// offered. Stepping t down from its estimate reaches that in an ulp or two; non-finite inputs keep -inf,
// which lets every value through to the exact test.
inline float raw_bound(float top, float max, float lse) {
  if (!std::isfinite(top) || !std::isfinite(max) || !std::isfinite(lse)) return -INFINITY;
  float t = top + lse + max;
  for (int step = 0; step < 8 && std::isfinite(t); ++step) {
    if ((t - max) - lse <= top) return t;
    t = std::nextafter(t, -INFINITY);
  }
  return -INFINITY;
}

// One row's k best of (x - max) - lse, as std::partial_sort over the whole row would leave them.
// `next`: the row this thread reads after this one (prefetched), or null.
// `shift`: the row's (max, lse); computed and stored unless `known` (a deeper search of a row this op
// read before: the same two floats, so only the scan runs again).
void row_top(const float* x, int64_t vocab, int64_t k, float* values, int64_t* tokens, Entry* heap,
             const float* next, float* shift, bool known) {
  if (!known) {
    shift[0] = row_max(x, vocab);
    const float sum = sum_exp(x, vocab, shift[0], next);
    float lse_lane[Vec::size()];
    Vec(sum).log().store(lse_lane);
    shift[1] = lse_lane[0];
  }
  const float max = shift[0], lse = shift[1];
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
  // 64 raw values a test against the bound (no subtraction, one branch); a block with a lane above it is
  // offered lane by lane in order, the exact test deciding, and the bound follows the rising top.
  float bound = raw_bound(heap[0].first, max, lse);
  for (; j + 64 <= vocab; j += 64) {
    if (std::isnan(heap[0].first)) break;  // nothing goes before a NaN top: the scalar loop says so
    const __m512 v_bound = _mm512_set1_ps(bound);
    // not (x <= bound), unordered true: larger, or NaN
    const __mmask16 m0 = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + j), v_bound, _CMP_NLE_UQ);
    const __mmask16 m1 = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + j + 16), v_bound, _CMP_NLE_UQ);
    const __mmask16 m2 = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + j + 32), v_bound, _CMP_NLE_UQ);
    const __mmask16 m3 = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + j + 48), v_bound, _CMP_NLE_UQ);
    if (!(m0 | m1 | m2 | m3)) continue;
    const __mmask16 masks[4] = {m0, m1, m2, m3};
    for (int part = 0; part < 4; ++part) {
      for (__mmask16 pass = masks[part]; pass; pass &= pass - 1) offer(j + 16 * part + __builtin_ctz(pass));
    }
    bound = raw_bound(heap[0].first, max, lse);
  }
#endif
  for (; j < vocab; ++j) offer(j);
  std::sort_heap(heap, heap + k, before);
  for (int64_t i = 0; i < k; ++i) {
    values[i] = heap[i].first;
    tokens[i] = heap[i].second;
  }
}

// Each row's k best of its log-softmax: (values, tokens, shifts), shifts [rows, 2] the rows' (max, lse).
// `rows`: read only these rows of x (int64 indices, in place: no gathered copy); `shifts`: theirs from an
// earlier call on the same x, so a deeper search skips the max and the exps.
std::tuple<at::Tensor, at::Tensor, at::Tensor> log_softmax_topk(const at::Tensor& x, int64_t k,
                                                                const std::optional<at::Tensor>& rows,
                                                                const std::optional<at::Tensor>& shifts) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "log_softmax_topk: float32 [rows, vocab] on the CPU");
  TORCH_CHECK(x.stride(1) == 1, "log_softmax_topk: rows contiguous");
  const int64_t vocab = x.size(1), row_stride = x.stride(0);
  TORCH_CHECK(k >= 1 && k * 64 <= vocab, "log_softmax_topk: 1 <= k and k * 64 <= vocab (torch.topk's "
              "partial-sort regime), got k=", k, " vocab=", vocab);
  at::Tensor row_index;
  if (rows.has_value()) {
    row_index = rows->contiguous();
    TORCH_CHECK(row_index.scalar_type() == at::kLong && row_index.dim() == 1 && row_index.is_cpu(),
                "log_softmax_topk: rows int64 [n] on the CPU");
    if (row_index.numel()) {
      TORCH_CHECK(row_index.min().item<int64_t>() >= 0 && row_index.max().item<int64_t>() < x.size(0),
                  "log_softmax_topk: rows index past x's ", x.size(0), " rows");
    }
  }
  const int64_t num_rows = rows.has_value() ? row_index.numel() : x.size(0);
  at::Tensor shift_out;
  const bool known = shifts.has_value();
  if (known) {
    TORCH_CHECK(shifts->scalar_type() == at::kFloat && shifts->dim() == 2 && shifts->size(0) == num_rows &&
                shifts->size(1) == 2, "log_softmax_topk: shifts float32 [rows, 2] from an earlier call");
    shift_out = shifts->contiguous().clone();
  } else {
    shift_out = at::empty({num_rows, 2}, x.options());
  }
  at::Tensor values = at::empty({num_rows, k}, x.options());
  at::Tensor tokens = at::empty({num_rows, k}, x.options().dtype(at::kLong));
  const float* data = x.data_ptr<float>();
  const int64_t* index = rows.has_value() ? row_index.data_ptr<int64_t>() : nullptr;
  float* value_out = values.data_ptr<float>();
  int64_t* token_out = tokens.data_ptr<int64_t>();
  float* shift_data = shift_out.data_ptr<float>();
  auto row_of = [&](int64_t i) { return data + (index ? index[i] : i) * row_stride; };
  at::parallel_for(0, num_rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<Entry> heap(k + 1);
    for (int64_t i = begin; i < end; ++i) {
      const float* next = i + 1 < end ? row_of(i + 1) : nullptr;
      row_top(row_of(i), vocab, k, value_out + i * k, token_out + i * k, heap.data(), next, shift_data + 2 * i,
              known);
    }
  });
  return {values, tokens, shift_out};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(widebeam, m) {
  m.def("log_softmax_topk(Tensor x, int k, Tensor? rows=None, Tensor? shifts=None) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(widebeam, CPU, m) {
  m.impl("log_softmax_topk", &log_softmax_topk);
}
