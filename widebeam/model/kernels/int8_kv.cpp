// widebeam's int8 KV cache on the CPU: the write (quantize K/V into the pool) and the read (a few query
// rows attending a set of int8 slots), each one op instead of the ~15 and ~8 eager ops the torch path
// launches a layer (model/attention/quantized_kv.py is the format and the reference).
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
#include <limits>
#include <optional>
#include <vector>

namespace {

constexpr float kInt8Max = 127.0f;
// float16's smallest subnormal and largest finite value (quantized_kv._MIN_SCALE, _MAX_SCALE)
constexpr float kMinScale = 5.9604644775390625e-08f;  // 2^-24
constexpr float kMaxScale = 65504.0f;

void check_pool(const at::Tensor& pair_values, const at::Tensor& pair_scales) {
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

// exp(x) for x <= 0 (scores less their row's max), branch-free so the loops over it vectorize: Cephes'
// expf (range reduction by ln 2 in two parts, degree-6 polynomial), within 2 ulp of std::exp; below -87
// it flushes to ~0 as the true value does.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  // round to nearest by the 1.5 * 2^23 trick (no call to floor or nearbyint: the loop stays vectorized)
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

// x rounded to bfloat16 (to nearest, ties to even) and back: what the torch path's bfloat16 reads hold.
inline float round_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

constexpr int64_t kKeyBlock = 64;  // keys dequantized at a time (K transposed: head_dim x 64 floats, in L1)

// 16 floats as one value (GCC vector extension): one AVX-512 register, two AVX2 ones where -march=native
// has no AVX-512. Accumulators held in these stay in registers, which plain arrays do not reliably.
using Vec16 = float __attribute__((vector_size(64)));
inline Vec16 load16(const float* p) {
  Vec16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store16(float* p, const Vec16& v) { std::memcpy(p, &v, sizeof v); }

// One (KV head, run of keys) of attention: the rows' running max m [R], sum of exponentials l [R] and
// unnormalized output o [R, head_dim] over keys key_begin..key_end, merged across runs afterwards.
struct Partial {
  float* m;
  float* l;
  float* o;
};

// Dequantize `count` keys' K (or V) of one head into rows of `out` ([count][head_dim] floats).
inline void dequantize_rows(const int8_t* values, const c10::Half* scales, int64_t kv_heads, int64_t head,
                            int64_t head_dim, int64_t groups, const int64_t* slot_index, int64_t first_slot,
                            int64_t key, int64_t count, bool bf16, float* out) {
  const int64_t group_size = head_dim / groups;
  for (int64_t b = 0; b < count; ++b) {
    const int64_t slot = slot_index != nullptr ? slot_index[key + b] : first_slot + key + b;
    const int8_t* src = values + (slot * kv_heads + head) * head_dim;
    const c10::Half* scale = scales + (slot * kv_heads + head) * groups;
    float* dst = out + b * head_dim;
    for (int64_t g = 0; g < groups; ++g) {
      const float s = static_cast<float>(scale[g]);
      for (int64_t j = g * group_size; j < (g + 1) * group_size; ++j) dst[j] = static_cast<float>(src[j]) * s;
    }
    if (bf16) {
      for (int64_t j = 0; j < head_dim; ++j) dst[j] = round_bf16(dst[j]);
    }
  }
}

// kDim: head_dim as a compile-time constant (a multiple of 16: the loops over it unroll into registers),
// or 0 for any head_dim (the same arithmetic through plain loops).
template <int64_t kDim>
void attend_keys(const float* q, int64_t rows, int64_t head_dim_arg, int64_t groups, const int8_t* k_values,
                 const c10::Half* k_scales, const int8_t* v_values, const c10::Half* v_scales,
                 int64_t kv_heads, int64_t head, const int64_t* slot_index, int64_t first_slot,
                 int64_t key_begin, int64_t key_end, bool bf16, Partial partial) {
  const int64_t head_dim = kDim != 0 ? kDim : head_dim_arg;
  const int64_t num_keys = key_end - key_begin;
  std::vector<float> scores(rows * num_keys);
  std::vector<float> block(kKeyBlock * head_dim);  // a block of K or V, dequantized: [key][head_dim]
  std::vector<float> k_t(head_dim * kKeyBlock);    // the K block transposed: [head_dim][key]
  // Pass 1: scores [R, keys] = q . k a block of 64 keys at a time; the inner loop runs over the block's
  // keys (four 16-float accumulators), not a reduction over head_dim, so no sum is reassociated.
  for (int64_t b0 = key_begin; b0 < key_end; b0 += kKeyBlock) {
    const int64_t nb = std::min(kKeyBlock, key_end - b0);
    dequantize_rows(k_values, k_scales, kv_heads, head, head_dim, groups, slot_index, first_slot, b0, nb,
                    bf16, block.data());
    for (int64_t b = 0; b < nb; ++b) {
      for (int64_t j = 0; j < head_dim; ++j) k_t[j * kKeyBlock + b] = block[b * head_dim + j];
    }
    // two rows at a time: eight independent accumulator chains (enough to cover the FMA latency), and
    // each K load used twice
    for (int64_t r = 0; r < rows; r += 2) {
      const bool pair = r + 1 < rows;
      const float* q0 = q + r * head_dim;
      const float* q1 = pair ? q0 + head_dim : q0;
      Vec16 a0 = {}, a1 = {}, a2 = {}, a3 = {}, c0 = {}, c1 = {}, c2 = {}, c3 = {};
      for (int64_t j = 0; j < head_dim; ++j) {
        const float* kj = k_t.data() + j * kKeyBlock;
        const Vec16 k0 = load16(kj), k1 = load16(kj + 16), k2 = load16(kj + 32), k3 = load16(kj + 48);
        a0 += q0[j] * k0;
        a1 += q0[j] * k1;
        a2 += q0[j] * k2;
        a3 += q0[j] * k3;
        c0 += q1[j] * k0;
        c1 += q1[j] * k1;
        c2 += q1[j] * k2;
        c3 += q1[j] * k3;
      }
      float acc[2 * kKeyBlock];
      store16(acc, a0);
      store16(acc + 16, a1);
      store16(acc + 32, a2);
      store16(acc + 48, a3);
      store16(acc + 64, c0);
      store16(acc + 80, c1);
      store16(acc + 96, c2);
      store16(acc + 112, c3);
      std::copy(acc, acc + nb, scores.begin() + r * num_keys + (b0 - key_begin));
      if (pair) std::copy(acc + kKeyBlock, acc + kKeyBlock + nb, scores.begin() + (r + 1) * num_keys + (b0 - key_begin));
    }
  }
  // Pass 2: each row's max, exponentials (in place) and their sum, in 16 lanes so each loop vectorizes.
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores.data() + r * num_keys;
    float lanes[16];
    std::fill(lanes, lanes + 16, -std::numeric_limits<float>::infinity());
    int64_t i = 0;
    for (; i + 16 <= num_keys; i += 16) {
      for (int64_t t = 0; t < 16; ++t) lanes[t] = lanes[t] < s[i + t] ? s[i + t] : lanes[t];
    }
    float m = *std::max_element(lanes, lanes + 16);
    for (; i < num_keys; ++i) m = std::max(m, s[i]);
    for (i = 0; i < num_keys; ++i) s[i] = exp_nonpositive(s[i] - m);
    std::fill(lanes, lanes + 16, 0.0f);
    for (i = 0; i + 16 <= num_keys; i += 16) {
      for (int64_t t = 0; t < 16; ++t) lanes[t] += s[i + t];
    }
    float l = 0.0f;
    for (; i < num_keys; ++i) l += s[i];
    for (int64_t t = 0; t < 16; ++t) l += lanes[t];
    if (bf16) {  // the weights as the bfloat16 product with V takes them (the sum from the unrounded ones)
      for (i = 0; i < num_keys; ++i) s[i] = round_bf16(s[i]);
    }
    partial.m[r] = m;
    partial.l[r] = l;
  }
  // Pass 3: o [R, d] += p [R, key] * v [key, d], V dequantized a block at a time for every row.
  std::fill(partial.o, partial.o + rows * head_dim, 0.0f);
  for (int64_t b0 = key_begin; b0 < key_end; b0 += kKeyBlock) {
    const int64_t nb = std::min(kKeyBlock, key_end - b0);
    dequantize_rows(v_values, v_scales, kv_heads, head, head_dim, groups, slot_index, first_slot, b0, nb,
                    bf16, block.data());
    for (int64_t r = 0; r < rows; r += 2) {  // two rows at a time, as in pass 1
      const bool pair = r + 1 < rows;
      const float* p0 = scores.data() + r * num_keys + (b0 - key_begin);
      const float* p1 = pair ? p0 + num_keys : p0;
      float* o0 = partial.o + r * head_dim;
      if constexpr (kDim != 0) {
        constexpr int64_t kVecs = kDim / 16;
        Vec16 acc0[kVecs], acc1[kVecs];
        for (int64_t c = 0; c < kVecs; ++c) {
          acc0[c] = load16(o0 + 16 * c);
          acc1[c] = Vec16{};
        }
        for (int64_t b = 0; b < nb; ++b) {
          const float* vb = block.data() + b * kDim;
          for (int64_t c = 0; c < kVecs; ++c) {
            const Vec16 vc = load16(vb + 16 * c);
            acc0[c] += p0[b] * vc;
            acc1[c] += p1[b] * vc;
          }
        }
        for (int64_t c = 0; c < kVecs; ++c) store16(o0 + 16 * c, acc0[c]);
        if (pair) {
          float* o1 = o0 + kDim;
          for (int64_t c = 0; c < kVecs; ++c) store16(o1 + 16 * c, load16(o1 + 16 * c) + acc1[c]);
        }
      } else {
        for (int64_t rr = r; rr < std::min(rows, r + 2); ++rr) {
          const float* p = scores.data() + rr * num_keys + (b0 - key_begin);
          float* o = partial.o + rr * head_dim;
          for (int64_t b = 0; b < nb; ++b) {
            const float* vb = block.data() + b * head_dim;
            for (int64_t j = 0; j < head_dim; ++j) o[j] += p[b] * vb[j];
          }
        }
      }
    }
  }
}

// q_rows float32 [KV, R, d] (scaled, in K's stored domain) against the int8 K/V of slots first..end (or
// of the slots `index`): (out float32 [KV, R, d], lse float32 [KV, R, 1]), as backends.chunk_attention
// returns them. K/V are dequantized on the fly in float32; no [S, KV, d] copy is made. `bf16`: q, K, V, the
// weights and the output rounded to bfloat16 as the torch path's bfloat16 reads and products round them
// (products and sums in float32, as its flash kernel keeps them), so a cache read as bfloat16
// (quantized_kv.int8_read_dtype) computes the same attention either way, up to summation order.
std::tuple<at::Tensor, at::Tensor> int8_attention(const at::Tensor& q_rows, const at::Tensor& pair_values,
                                                  const at::Tensor& pair_scales, int64_t start, int64_t end,
                                                  const std::optional<at::Tensor>& index, bool bf16) {
  check_pool(pair_values, pair_scales);
  const int64_t num_slots = pair_values.size(1), kv_heads = pair_values.size(2);
  const int64_t head_dim = pair_values.size(3), groups = pair_scales.size(3);
  TORCH_CHECK(q_rows.scalar_type() == at::kFloat && q_rows.dim() == 3 && q_rows.size(0) == kv_heads &&
                  q_rows.size(2) == head_dim && q_rows.is_contiguous() && q_rows.device().is_cpu(),
              "q_rows: contiguous float32 [kv_heads, rows, head_dim] matching the pool");
  const int64_t rows = q_rows.size(1);
  const int64_t* slot_index = nullptr;
  int64_t num_keys;
  if (index.has_value() && index->defined()) {
    const at::Tensor& idx = *index;
    TORCH_CHECK(idx.scalar_type() == at::kLong && idx.dim() == 1 && idx.is_contiguous() && idx.device().is_cpu(),
                "index: contiguous int64 [keys]");
    slot_index = idx.data_ptr<int64_t>();
    num_keys = idx.size(0);
    for (int64_t i = 0; i < num_keys; ++i) {
      TORCH_CHECK(slot_index[i] >= 0 && slot_index[i] < num_slots, "slot ", slot_index[i], " out of range");
    }
    start = 0;
  } else {
    TORCH_CHECK(0 <= start && start <= end && end <= num_slots, "slots ", start, "..", end, " out of range");
    num_keys = end - start;
  }
  at::Tensor out = at::empty({kv_heads, rows, head_dim}, q_rows.options());
  at::Tensor lse = at::empty({kv_heads, rows, 1}, q_rows.options());
  if (num_keys == 0 || rows == 0) {  // no keys: nothing attended (lse -inf, as a logsumexp of nothing)
    out.zero_();
    lse.fill_(-std::numeric_limits<float>::infinity());
    return {out, lse};
  }
  // Split each head's keys into runs so that every thread has work even with fewer KV heads than threads
  // (SmolLM2: 3 heads); runs of at least 64 keys keep the per-run overhead and the merge small.
  const int64_t threads = at::get_num_threads();
  const int64_t max_runs = std::max<int64_t>(1, num_keys / kKeyBlock);
  const int64_t runs = std::min(max_runs, std::max<int64_t>(1, (4 * threads + kv_heads - 1) / kv_heads));
  const int64_t run_len = (num_keys + runs - 1) / runs;
  std::vector<float> m(kv_heads * runs * rows), l(kv_heads * runs * rows), o(kv_heads * runs * rows * head_dim);
  std::vector<float> q_bf16;
  const float* q = q_rows.data_ptr<float>();
  if (bf16) {
    q_bf16.assign(q, q + q_rows.numel());
    for (float& x : q_bf16) x = round_bf16(x);
    q = q_bf16.data();
  }
  const int8_t* values = pair_values.data_ptr<int8_t>();
  const c10::Half* scales = pair_scales.data_ptr<c10::Half>();
  const int8_t* v_values = values + num_slots * kv_heads * head_dim;
  const c10::Half* v_scales = scales + num_slots * kv_heads * groups;
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
#define WIDEBEAM_ATTEND(DIM)                                                                                \
  attend_keys<DIM>(q_head, rows, head_dim, groups, values, scales, v_values, v_scales, kv_heads, head, \
                   slot_index, start, key_begin, key_end, bf16, partial)
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

// A decode group (the beams of one request): q_rows float32 [KV, B*G, d] (scaled, stored domain; row
// b * G + g is beam b's head g of the KV head) against the shared prefix (slots start..end, or `index`)
// and each beam's own keys (suffix_slots [B, S], real where suffix_mask [B, S]), merged by log-sum-exp:
// out float32 [KV, B*G, d], as backends._attend_group's prefix and suffix parts compute it together.
at::Tensor int8_group_attention(const at::Tensor& q_rows, const at::Tensor& pair_values,
                                const at::Tensor& pair_scales, int64_t start, int64_t end,
                                const std::optional<at::Tensor>& index, const at::Tensor& suffix_slots,
                                const at::Tensor& suffix_mask, bool bf16) {
  auto [prefix_out, prefix_lse] = int8_attention(q_rows, pair_values, pair_scales, start, end, index, bf16);
  const int64_t num_slots = pair_values.size(1), kv_heads = pair_values.size(2);
  const int64_t head_dim = pair_values.size(3), groups = pair_scales.size(3), rows = q_rows.size(1);
  TORCH_CHECK(suffix_slots.scalar_type() == at::kLong && suffix_slots.dim() == 2 && suffix_slots.is_contiguous(),
              "suffix_slots: contiguous int64 [beams, keys]");
  TORCH_CHECK(suffix_mask.scalar_type() == at::kBool && suffix_mask.sizes() == suffix_slots.sizes() &&
                  suffix_mask.is_contiguous(),
              "suffix_mask: contiguous bool [beams, keys]");
  const int64_t beams = suffix_slots.size(0), keys = suffix_slots.size(1);
  TORCH_CHECK(beams > 0 && rows % beams == 0, "q_rows: beams x grouped heads rows");
  const int64_t group_heads = rows / beams;
  const int64_t* slot = suffix_slots.data_ptr<int64_t>();
  const bool* real = suffix_mask.data_ptr<bool>();
  for (int64_t i = 0; i < beams * keys; ++i) {
    TORCH_CHECK(!real[i] || (slot[i] >= 0 && slot[i] < num_slots), "suffix slot ", slot[i], " out of range");
  }
  const float* q = q_rows.data_ptr<float>();
  float* out = prefix_out.data_ptr<float>();  // the prefix's normalized output, merged in place
  const float* lse = prefix_lse.data_ptr<float>();
  const int8_t* values = pair_values.data_ptr<int8_t>();
  const c10::Half* scales = pair_scales.data_ptr<c10::Half>();
  const int8_t* v_values = values + num_slots * kv_heads * head_dim;
  const c10::Half* v_scales = scales + num_slots * kv_heads * groups;
  at::parallel_for(0, kv_heads * beams, 1, [&](int64_t begin, int64_t finish) {
    std::vector<int64_t> own;  // the beam's real keys' slots
    std::vector<float> k(keys * head_dim), v(keys * head_dim), q_row(head_dim), p(keys);
    for (int64_t task = begin; task < finish; ++task) {
      const int64_t head = task / beams, beam = task % beams;
      own.clear();
      for (int64_t i = 0; i < keys; ++i) {
        if (real[beam * keys + i]) own.push_back(slot[beam * keys + i]);
      }
      const int64_t n = static_cast<int64_t>(own.size());
      if (n == 0) continue;  // the prefix alone: its output stands
      dequantize_rows(values, scales, kv_heads, head, head_dim, groups, own.data(), 0, 0, n, bf16, k.data());
      dequantize_rows(v_values, v_scales, kv_heads, head, head_dim, groups, own.data(), 0, 0, n, bf16, v.data());
      for (int64_t g = 0; g < group_heads; ++g) {
        const int64_t row = head * rows + beam * group_heads + g;
        for (int64_t j = 0; j < head_dim; ++j) q_row[j] = bf16 ? round_bf16(q[row * head_dim + j]) : q[row * head_dim + j];
        float m = lse[row];
        for (int64_t i = 0; i < n; ++i) {
          float dot = 0.0f;
          for (int64_t j = 0; j < head_dim; ++j) dot += q_row[j] * k[i * head_dim + j];
          p[i] = dot;
          m = std::max(m, dot);
        }
        // the prefix counts as exp(lse) of summed weight, its output already normalized by it
        const float prefix_weight = std::exp(lse[row] - m);
        float total = prefix_weight;
        float* o = out + row * head_dim;
        for (int64_t j = 0; j < head_dim; ++j) o[j] *= prefix_weight;
        for (int64_t i = 0; i < n; ++i) {
          const float w = std::exp(p[i] - m);
          total += w;
          const float wv = bf16 ? round_bf16(w) : w;
          for (int64_t j = 0; j < head_dim; ++j) o[j] += wv * v[i * head_dim + j];
        }
        for (int64_t j = 0; j < head_dim; ++j) o[j] = bf16 ? round_bf16(o[j] / total) : o[j] / total;
      }
    }
  });
  return prefix_out;
}

}  // namespace

TORCH_LIBRARY(widebeam, m) {
  m.def("quantize_write(Tensor k, Tensor v, Tensor? rotation_k, Tensor slots, Tensor(a!) pair_values, "
        "Tensor(b!) pair_scales) -> ()");
  m.def("int8_attention(Tensor q_rows, Tensor pair_values, Tensor pair_scales, int start, int end, "
        "Tensor? index, bool bf16) -> (Tensor, Tensor)");
  m.def("int8_group_attention(Tensor q_rows, Tensor pair_values, Tensor pair_scales, int start, int end, "
        "Tensor? index, Tensor suffix_slots, Tensor suffix_mask, bool bf16) -> Tensor");
}

TORCH_LIBRARY_IMPL(widebeam, CPU, m) {
  m.impl("quantize_write", &quantize_write);
  m.impl("int8_attention", &int8_attention);
  m.impl("int8_group_attention", &int8_group_attention);
}
