// Attention of a few query rows over a layer's cached K/V on the CPU, one op instead of the ~8 eager ops
// (and the gathers) the torch path launches: rows against a run of slots or a list of them (`attend`:
// backends.chunk_attention's (out, lse)), and a decode group's shared prefix merged with each beam's own
// keys (`attend_group`: backends._attend_group). The K/V come from a source: the int8 pool (dequantized as
// read; quantized_kv.py is the format and the reference) or a float32/bfloat16 cache (widened as read).
//
// Why a dense path too: at W=1 PyTorch's fused CPU attention spends ~30 us a layer on one query row of a
// short prompt (SmolLM2-135M, 150 keys: 30 layers, ~1 ms of a 27 ms step) where the reads take a few.
//
// Built by build.py (never at import or run time) with -O3 -march=native; no -ffast-math.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "common.h"
#include "few_row_keys.h"
#include "flash_rows.h"
#include "sources.h"

namespace {

using namespace widebeam_kernels;

// From this many query rows a read goes through flash_rows.h (a head size it serves); settable
// (`set_flash_min_rows`) so tests reach both paths at any row count and A/Bs can move the switch.
int64_t flash_min_rows = 12;
// ... and from this many rows x keys: at a short prompt the few-row path is as fast (12 rows x 300 keys:
// 0.88x PyTorch's time against the tiled path's 1.02x; 48 rows x 300 keys 1.05x against 0.88x)
int64_t flash_min_work = 6144;  // keys read at a time (K transposed: head_dim x 64 floats, in L1)

// q_rows float32 [KV, R, d] against `num_keys` keys of K/V (slots first_slot.. consecutively, or the
// slots slot_index): (out float32 [KV, R, d], lse float32 [KV, R, 1]), as backends.chunk_attention returns
// them. K/V are read into a small block at a time (an int8 pool dequantized there); no [S, KV, d] copy is
// made. `bf16`: q, K, V, the weights and the output rounded to bfloat16 as the torch path's bfloat16 reads
// and products round them (products and sums in float32, as its flash kernel keeps them).
template <typename Source>
std::tuple<at::Tensor, at::Tensor> attend(const at::Tensor& q_rows, const Source& k_source,
                                          const Source& v_source, int64_t first_slot, int64_t num_keys,
                                          const int64_t* slot_index, bool bf16) {
  const int64_t kv_heads = k_source.kv_heads, head_dim = k_source.head_dim;
  TORCH_CHECK(q_rows.scalar_type() == at::kFloat && q_rows.dim() == 3 && q_rows.size(0) == kv_heads &&
                  q_rows.size(2) == head_dim && q_rows.is_contiguous() && q_rows.device().is_cpu(),
              "q_rows: contiguous float32 [kv_heads, rows, head_dim] matching the cache");
  const int64_t rows = q_rows.size(1);
  at::Tensor out = at::empty({kv_heads, rows, head_dim}, q_rows.options());
  at::Tensor lse = at::empty({kv_heads, rows, 1}, q_rows.options());
  if (num_keys == 0 || rows == 0) {  // no keys: nothing attended (lse -inf, as a logsumexp of nothing)
    out.zero_();
    lse.fill_(-std::numeric_limits<float>::infinity());
    return {out, lse};
  }
  std::vector<float> q_bf16;
  const float* q = q_rows.data_ptr<float>();
  if (bf16) {
    q_bf16.assign(q, q + q_rows.numel());
    for (float& x : q_bf16) x = round_bf16(x);
    q = q_bf16.data();
  }
  if (rows >= flash_min_rows && rows * num_keys >= flash_min_work && flash_supports(head_dim)) {  // many rows: tiles, register-blocked products
    if (head_dim == 64) {
      flash_rows<64>(q, rows, k_source, v_source, slot_index, first_slot, num_keys, bf16, out.data_ptr<float>(),
                     lse.data_ptr<float>());
    } else {
      flash_rows<128>(q, rows, k_source, v_source, slot_index, first_slot, num_keys, bf16,
                      out.data_ptr<float>(), lse.data_ptr<float>());
    }
    return {out, lse};
  }
  // Split each head's keys into runs so that every thread has work even with fewer KV heads than threads
  // (SmolLM2: 3 heads); runs of at least 64 keys keep the per-run overhead and the merge small.
  const int64_t threads = at::get_num_threads();
  const int64_t max_runs = std::max<int64_t>(1, num_keys / kKeyBlock);
  const int64_t runs = std::min(max_runs, std::max<int64_t>(1, (4 * threads + kv_heads - 1) / kv_heads));
  const int64_t run_len = (num_keys + runs - 1) / runs;
  std::vector<float> m(kv_heads * runs * rows), l(kv_heads * runs * rows), o(kv_heads * runs * rows * head_dim);
  at::parallel_for(0, kv_heads * runs, 1, [&](int64_t begin, int64_t finish) {
    for (int64_t task = begin; task < finish; ++task) {
      const int64_t head = task / runs, run = task % runs;
      const int64_t key_begin = run * run_len, key_end = std::min(num_keys, key_begin + run_len);
      if (key_begin >= key_end) {
        std::fill(m.begin() + task * rows, m.begin() + (task + 1) * rows, -std::numeric_limits<float>::infinity());
        std::fill(l.begin() + task * rows, l.begin() + (task + 1) * rows, 0.0f);
        std::fill(o.begin() + task * rows * head_dim, o.begin() + (task + 1) * rows * head_dim, 0.0f);
        continue;
      }
      const Partial partial{m.data() + task * rows, l.data() + task * rows, o.data() + task * rows * head_dim};
      const float* q_head = q + head * rows * head_dim;
      switch (head_dim) {  // the common head sizes unrolled; any other through plain loops
#define WIDEBEAM_ATTEND(DIM)                                                                             \
  attend_keys<DIM>(q_head, rows, head_dim, k_source, v_source, head, slot_index, first_slot, key_begin, \
                   key_end, bf16, partial)
        case 64: WIDEBEAM_ATTEND(64); break;
        case 80: WIDEBEAM_ATTEND(80); break;
        case 128: WIDEBEAM_ATTEND(128); break;
        default: WIDEBEAM_ATTEND(0);
#undef WIDEBEAM_ATTEND
      }
    }
  });
  // Merge each head's runs by log-sum-exp.
  float* out_data = out.data_ptr<float>();
  float* lse_data = lse.data_ptr<float>();
  for (int64_t head = 0; head < kv_heads; ++head) {
    for (int64_t r = 0; r < rows; ++r) {
      float row_max = -std::numeric_limits<float>::infinity();
      for (int64_t run = 0; run < runs; ++run) row_max = std::max(row_max, m[(head * runs + run) * rows + r]);
      float total = 0.0f;
      float* dst = out_data + (head * rows + r) * head_dim;
      std::fill(dst, dst + head_dim, 0.0f);
      for (int64_t run = 0; run < runs; ++run) {
        const int64_t at = (head * runs + run) * rows + r;
        if (l[at] == 0.0f) continue;  // an empty run
        const float weight = std::exp(m[at] - row_max);
        total += l[at] * weight;
        const float* src = o.data() + at * head_dim;
        for (int64_t j = 0; j < head_dim; ++j) dst[j] += src[j] * weight;
      }
      for (int64_t j = 0; j < head_dim; ++j) dst[j] = bf16 ? round_bf16(dst[j] / total) : dst[j] / total;
      lse_data[head * rows + r] = row_max + std::log(total);
    }
  }
  return {out, lse};
}

// q [B, H, d] (float32, bfloat16 or float16) as the kernel's rows: float32 [KV, B*G, d], row b * G + g of
// KV head h being beam b's head h * G + g, times `scale` (as backends.py's `(q.float() * scale)` and
// regrouping compute it, in one pass instead of three tensor copies).
at::Tensor group_rows(const at::Tensor& q, int64_t kv_heads, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.device().is_cpu() && q.size(1) % kv_heads == 0,
              "q: [beams, heads, head_dim], heads a multiple of the KV heads");
  const at::Tensor q_float = q.to(at::kFloat).contiguous();  // a float32 q as it is
  const int64_t beams = q.size(0), heads = q.size(1), head_dim = q.size(2), group_heads = heads / kv_heads;
  at::Tensor rows = at::empty({kv_heads, beams * group_heads, head_dim}, q_float.options());
  const float* src = q_float.data_ptr<float>();
  float* dst = rows.data_ptr<float>();
  const float factor = static_cast<float>(scale);
  at::parallel_for(0, beams, 64, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t h = 0; h < heads; ++h) {
        const float* from = src + (b * heads + h) * head_dim;
        float* to = dst + ((h / group_heads) * beams * group_heads + b * group_heads + h % group_heads) * head_dim;
        for (int64_t j = 0; j < head_dim; ++j) to[j] = from[j] * factor;
      }
    }
  });
  return rows;
}

// A decode group (the beams of one request): q [B, H, d] (unscaled; heads h * G .. h * G + G - 1 share KV
// head h) against the shared prefix (slots first_slot.., or slot_index) and each beam's own keys
// (suffix_slots [B, S], real where suffix_mask [B, S]), merged by log-sum-exp: out [B, H, d] in q's dtype,
// as backends._attend_group's prefix and suffix parts compute it together. `suffix_bias` (optional, float32
// [H, B, S]): added to each query head's scaled score of each own key (T5's relative position bias).
template <typename Source>
at::Tensor attend_group(const at::Tensor& q, double scale, const Source& k_source, const Source& v_source,
                        int64_t num_slots, int64_t first_slot, int64_t num_keys, const int64_t* slot_index,
                        const at::Tensor& suffix_slots, const at::Tensor& suffix_mask, bool bf16,
                        const std::optional<at::Tensor>& suffix_bias) {
  const int64_t kv_heads = k_source.kv_heads, head_dim = k_source.head_dim;
  TORCH_CHECK(q.dim() == 3 && q.size(2) == head_dim, "q: [beams, heads, head_dim] matching the cache");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
              "q: float32, bfloat16 or float16");
  TORCH_CHECK(suffix_slots.scalar_type() == at::kLong && suffix_slots.dim() == 2 && suffix_slots.is_contiguous(),
              "suffix_slots: contiguous int64 [beams, keys]");
  TORCH_CHECK(suffix_mask.scalar_type() == at::kBool && suffix_mask.sizes() == suffix_slots.sizes() &&
                  suffix_mask.is_contiguous(),
              "suffix_mask: contiguous bool [beams, keys]");
  const int64_t beams = suffix_slots.size(0), keys = suffix_slots.size(1);
  TORCH_CHECK(beams > 0 && q.size(0) == beams, "q: one row of heads per beam of the suffix");
  const float* bias = nullptr;
  if (suffix_bias.has_value() && suffix_bias->defined()) {
    TORCH_CHECK(suffix_bias->scalar_type() == at::kFloat && suffix_bias->is_contiguous() &&
                    suffix_bias->sizes() == at::IntArrayRef({q.size(1), beams, keys}),
                "suffix_bias: contiguous float32 [heads, beams, keys]");
    bias = suffix_bias->data_ptr<float>();
  }
  const at::Tensor q_rows = group_rows(q, kv_heads, scale);
  at::Tensor prefix_out, prefix_lse;
  std::tie(prefix_out, prefix_lse) = attend(q_rows, k_source, v_source, first_slot, num_keys, slot_index, bf16);
  const int64_t rows = q_rows.size(1), group_heads = rows / beams, heads = q.size(1);
  const int64_t* slot = suffix_slots.data_ptr<int64_t>();
  const bool* real = suffix_mask.data_ptr<bool>();
  for (int64_t i = 0; i < beams * keys; ++i) {
    TORCH_CHECK(!real[i] || (slot[i] >= 0 && slot[i] < num_slots), "suffix slot ", slot[i], " out of range");
  }
  at::Tensor out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  const float* q_data = q_rows.data_ptr<float>();
  float* prefix = prefix_out.data_ptr<float>();  // the prefix's normalized output, merged in place
  const float* lse = prefix_lse.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "attend_group", [&] {
    scalar_t* out_data = out.data_ptr<scalar_t>();
    at::parallel_for(0, kv_heads * beams, 16, [&](int64_t begin, int64_t finish) {
      std::vector<int64_t> own, own_at;  // the beam's real keys' slots, and where each sits in its row
      std::vector<float> k(keys * head_dim), v(keys * head_dim), q_row(head_dim), p(keys);
      for (int64_t task = begin; task < finish; ++task) {
        const int64_t head = task / beams, beam = task % beams;
        own.clear();
        own_at.clear();
        for (int64_t i = 0; i < keys; ++i) {
          if (real[beam * keys + i]) {
            own.push_back(slot[beam * keys + i]);
            own_at.push_back(i);
          }
        }
        const int64_t n = static_cast<int64_t>(own.size());
        if (n > 0) {
          read_rows(k_source, head, own.data(), 0, 0, n, bf16, k.data());
          read_rows(v_source, head, own.data(), 0, 0, n, bf16, v.data());
        }
        for (int64_t g = 0; g < group_heads; ++g) {
          const int64_t row = head * rows + beam * group_heads + g;
          float* o = prefix + row * head_dim;
          if (n > 0) {  // else the prefix alone: its output stands
            for (int64_t j = 0; j < head_dim; ++j) {
              q_row[j] = bf16 ? round_bf16(q_data[row * head_dim + j]) : q_data[row * head_dim + j];
            }
            float m = lse[row];
            // query head h * G + g's bias row for this beam
            const float* bias_row = bias ? bias + ((head * group_heads + g) * beams + beam) * keys : nullptr;
            for (int64_t i = 0; i < n; ++i) {
              p[i] = dot(q_row.data(), k.data() + i * head_dim, head_dim);
              if (bias_row) p[i] += bias_row[own_at[i]];
              m = std::max(m, p[i]);
            }
            // the prefix counts as exp(lse) of summed weight, its output already normalized by it
            const float prefix_weight = exp_nonpositive(lse[row] - m);
            float total = prefix_weight;
            for (int64_t j = 0; j < head_dim; ++j) o[j] *= prefix_weight;
            for (int64_t i = 0; i < n; ++i) {
              const float w = exp_nonpositive(p[i] - m);
              total += w;
              const float wv = bf16 ? round_bf16(w) : w;
              for (int64_t j = 0; j < head_dim; ++j) o[j] += wv * v[i * head_dim + j];
            }
            for (int64_t j = 0; j < head_dim; ++j) o[j] = bf16 ? round_bf16(o[j] / total) : o[j] / total;
          }
          scalar_t* dst = out_data + (beam * heads + head * group_heads + g) * head_dim;
          for (int64_t j = 0; j < head_dim; ++j) dst[j] = static_cast<scalar_t>(o[j]);
        }
      }
    });
  });
  return out;
}

// The keys an op reads: slots start..end of the cache, or the slots `index` (then start is 0):
// (first_slot, num_keys, slot_index or nullptr), checked against num_slots.
std::tuple<int64_t, int64_t, const int64_t*> key_slots(int64_t start, int64_t end,
                                                       const std::optional<at::Tensor>& index,
                                                       int64_t num_slots) {
  if (index.has_value() && index->defined()) {
    const at::Tensor& idx = *index;
    TORCH_CHECK(idx.scalar_type() == at::kLong && idx.dim() == 1 && idx.is_contiguous() && idx.device().is_cpu(),
                "index: contiguous int64 [keys]");
    const int64_t* slot_index = idx.data_ptr<int64_t>();
    for (int64_t i = 0; i < idx.size(0); ++i) {
      TORCH_CHECK(slot_index[i] >= 0 && slot_index[i] < num_slots, "slot ", slot_index[i], " out of range");
    }
    return {0, idx.size(0), slot_index};
  }
  TORCH_CHECK(0 <= start && start <= end && end <= num_slots, "slots ", start, "..", end, " out of range");
  return {start, end - start, nullptr};
}

// The int8 pool's K and V halves as sources.
std::pair<Int8Source, Int8Source> int8_sources(const at::Tensor& pair_values, const at::Tensor& pair_scales) {
  check_pool(pair_values, pair_scales);
  const int64_t num_slots = pair_values.size(1), kv_heads = pair_values.size(2);
  const int64_t head_dim = pair_values.size(3), groups = pair_scales.size(3);
  const int8_t* values = pair_values.data_ptr<int8_t>();
  const c10::Half* scales = pair_scales.data_ptr<c10::Half>();
  return {Int8Source{values, scales, kv_heads, head_dim, groups},
          Int8Source{values + num_slots * kv_heads * head_dim, scales + num_slots * kv_heads * groups, kv_heads,
                     head_dim, groups}};
}

// int8 pool: q_rows [KV, R, d] (scaled, in K's stored domain) against slots start..end (or `index`).
std::tuple<at::Tensor, at::Tensor> int8_attention(const at::Tensor& q_rows, const at::Tensor& pair_values,
                                                  const at::Tensor& pair_scales, int64_t start, int64_t end,
                                                  const std::optional<at::Tensor>& index, bool bf16) {
  auto [k_source, v_source] = int8_sources(pair_values, pair_scales);
  auto [first_slot, num_keys, slot_index] = key_slots(start, end, index, pair_values.size(1));
  return attend(q_rows, k_source, v_source, first_slot, num_keys, slot_index, bf16);
}

at::Tensor int8_group_attention(const at::Tensor& q, double scale, const at::Tensor& pair_values,
                                const at::Tensor& pair_scales, int64_t start, int64_t end,
                                const std::optional<at::Tensor>& index, const at::Tensor& suffix_slots,
                                const at::Tensor& suffix_mask, bool bf16,
                                const std::optional<at::Tensor>& suffix_bias) {
  auto [k_source, v_source] = int8_sources(pair_values, pair_scales);
  const int64_t num_slots = pair_values.size(1);
  auto [first_slot, num_keys, slot_index] = key_slots(start, end, index, num_slots);
  return attend_group(q, scale, k_source, v_source, num_slots, first_slot, num_keys, slot_index, suffix_slots,
                      suffix_mask, bf16, suffix_bias);
}

// A float32 or bfloat16 cache pair, each [num_slots, kv_heads, head_dim]: `fn` called with their sources
// (a bfloat16 cache reads as the torch path's bfloat16 attention rounds: bf16 = true).
template <typename Fn>
auto with_dense_sources(const at::Tensor& k_cache, const at::Tensor& v_cache, Fn fn) {
  TORCH_CHECK(k_cache.device().is_cpu() && v_cache.device().is_cpu(), "dense attention: CPU caches");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type(),
              "k_cache, v_cache: contiguous [num_slots, kv_heads, head_dim], one dtype");
  const int64_t kv_heads = k_cache.size(1), head_dim = k_cache.size(2);
  if (k_cache.scalar_type() == at::kBFloat16) {
    using T = c10::BFloat16;
    return fn(DenseSource<T>{k_cache.data_ptr<T>(), kv_heads, head_dim},
              DenseSource<T>{v_cache.data_ptr<T>(), kv_heads, head_dim}, true);
  }
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat, "dense attention: float32 or bfloat16 caches");
  return fn(DenseSource<float>{k_cache.data_ptr<float>(), kv_heads, head_dim},
            DenseSource<float>{v_cache.data_ptr<float>(), kv_heads, head_dim}, false);
}

// A float32 or bfloat16 cache: q_rows [KV, R, d] (scaled) against slots start..end (or `index`).
std::tuple<at::Tensor, at::Tensor> dense_attention(const at::Tensor& q_rows, const at::Tensor& k_cache,
                                                   const at::Tensor& v_cache, int64_t start, int64_t end,
                                                   const std::optional<at::Tensor>& index) {
  auto [first_slot, num_keys, slot_index] = key_slots(start, end, index, k_cache.size(0));
  return with_dense_sources(k_cache, v_cache, [&](const auto& k_source, const auto& v_source, bool bf16) {
    return attend(q_rows, k_source, v_source, first_slot, num_keys, slot_index, bf16);
  });
}

at::Tensor dense_group_attention(const at::Tensor& q, double scale, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 int64_t start, int64_t end, const std::optional<at::Tensor>& index,
                                 const at::Tensor& suffix_slots, const at::Tensor& suffix_mask,
                                 const std::optional<at::Tensor>& suffix_bias) {
  const int64_t num_slots = k_cache.size(0);
  auto [first_slot, num_keys, slot_index] = key_slots(start, end, index, num_slots);
  return with_dense_sources(k_cache, v_cache, [&](const auto& k_source, const auto& v_source, bool bf16) {
    return attend_group(q, scale, k_source, v_source, num_slots, first_slot, num_keys, slot_index, suffix_slots,
                        suffix_mask, bf16, suffix_bias);
  });
}

int64_t get_flash_min_rows() { return flash_min_rows; }

// Sets both thresholds; returns the row count before (tests and A/Bs restore it with the default work).
int64_t set_flash_min_rows(int64_t rows, int64_t work) {
  TORCH_CHECK(rows >= 1 && work >= 0, "flash_min_rows: at least 1 row, work not negative");
  const int64_t before = flash_min_rows;
  flash_min_rows = rows;
  flash_min_work = work;
  return before;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(widebeam, m) {
  m.def("flash_min_rows() -> int", &get_flash_min_rows);
  m.def("set_flash_min_rows(int rows, int work=6144) -> int", &set_flash_min_rows);
  m.def("int8_attention(Tensor q_rows, Tensor pair_values, Tensor pair_scales, int start, int end, "
        "Tensor? index, bool bf16) -> (Tensor, Tensor)");
  m.def("int8_group_attention(Tensor q, float scale, Tensor pair_values, Tensor pair_scales, int start, int end, "
        "Tensor? index, Tensor suffix_slots, Tensor suffix_mask, bool bf16, Tensor? suffix_bias=None) -> Tensor");
  m.def("dense_attention(Tensor q_rows, Tensor k_cache, Tensor v_cache, int start, int end, Tensor? index) "
        "-> (Tensor, Tensor)");
  m.def("dense_group_attention(Tensor q, float scale, Tensor k_cache, Tensor v_cache, int start, int end, "
        "Tensor? index, Tensor suffix_slots, Tensor suffix_mask, Tensor? suffix_bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(widebeam, CPU, m) {
  m.impl("int8_attention", &int8_attention);
  m.impl("int8_group_attention", &int8_group_attention);
  m.impl("dense_attention", &dense_attention);
  m.impl("dense_group_attention", &dense_group_attention);
}
