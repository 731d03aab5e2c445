// Attention of many query rows (a wide decode group's rows against its shared prompt) in tiles that stay in
// cache, with register-blocked products: the rows of a KV head are split into tiles of kFlashRowTile, each
// tile walks the keys kFlashKeyBlock at a time keeping a running max and sum per row (the online softmax),
// so no [rows, keys] score matrix is written. Every head's K is transposed once per call ([d][keys]) so the
// score product runs 16 keys to a register; V is read in place when it is a float32 run of slots, else
// widened (or dequantized) once per call.
//
// Why: at W = 256 over a 2,048-token prompt PyTorch's fused CPU attention ran ~145 GFLOP/s (bmm ~118) where
// this CPU's products run ~220: prompt attention was 1.7x its floor, the largest part of the step over it.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <type_traits>

#include "common.h"
#include "sources.h"

namespace widebeam_kernels {

constexpr int64_t kFlashRowTile = 48;    // query rows one task owns: 8 score tiles of 6 rows
constexpr int64_t kFlashKeyBlock = 256;  // keys scored, exponentiated and summed at a time (128: 2% slower)
constexpr int64_t kScoreRows = 6;        // a score tile: 6 rows x 64 keys, 24 accumulators

inline bool flash_supports(int64_t head_dim) { return head_dim == 64 || head_dim == 128; }

// s[r][0..64) = q[r] . k_t[.][0..64) for the tile's 6 rows (scores' row stride kFlashKeyBlock); the sum runs
// over head_dim in order, as the few-row path's does.
template <int64_t kDim>
inline void score_tile(const float* q, const float* k_t, int64_t k_stride, float* s) {
  Vec16 acc[kScoreRows][4] = {};
  for (int64_t j = 0; j < kDim; ++j) {
    const float* kj = k_t + j * k_stride;
    const Vec16 k0 = load16(kj), k1 = load16(kj + 16), k2 = load16(kj + 32), k3 = load16(kj + 48);
#pragma GCC unroll 6
    for (int64_t r = 0; r < kScoreRows; ++r) {
      const float qr = q[r * kDim + j];
      acc[r][0] += qr * k0;
      acc[r][1] += qr * k1;
      acc[r][2] += qr * k2;
      acc[r][3] += qr * k3;
    }
  }
#pragma GCC unroll 6
  for (int64_t r = 0; r < kScoreRows; ++r) {
    for (int64_t c = 0; c < 4; ++c) store16(s + r * kFlashKeyBlock + 16 * c, acc[r][c]);
  }
}

// o[r] += sum_b p[r][b] * v[b] for kRows rows (weights' row stride kFlashKeyBlock, v's row stride v_stride):
// the rows' outputs held in 24 registers across the block's keys.
template <int64_t kDim, int64_t kRows>
inline void value_tile(const float* p, int64_t num_keys, const float* v, int64_t v_stride, float* o) {
  constexpr int64_t kVecs = kDim / 16;
  Vec16 acc[kRows][kVecs];
#pragma GCC unroll 8
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t c = 0; c < kVecs; ++c) acc[r][c] = load16(o + r * kDim + 16 * c);
  }
  for (int64_t b = 0; b < num_keys; ++b) {
    const float* vb = v + b * v_stride;
    Vec16 vc[kVecs];
#pragma GCC unroll 8
    for (int64_t c = 0; c < kVecs; ++c) vc[c] = load16(vb + 16 * c);
#pragma GCC unroll 8
    for (int64_t r = 0; r < kRows; ++r) {
      const float w = p[r * kFlashKeyBlock + b];
      for (int64_t c = 0; c < kVecs; ++c) acc[r][c] += w * vc[c];
    }
  }
#pragma GCC unroll 8
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t c = 0; c < kVecs; ++c) store16(o + r * kDim + 16 * c, acc[r][c]);
  }
}

// q [KV, R, d] (scaled; bfloat16-rounded already when bf16) against num_keys keys (slots first_slot..
// consecutively, or slot_index): out [KV, R, d] normalized, lse [KV, R]. `bf16`: the weights and the output
// rounded to bfloat16 as the torch path's bfloat16 product rounds them.
template <int64_t kDim, typename Source>
void flash_rows(const float* q, int64_t rows, const Source& k_source, const Source& v_source,
                const int64_t* slot_index, int64_t first_slot, int64_t num_keys, bool bf16, float* out,
                float* lse) {
  static_assert(kDim % 64 == 0, "score tiles read 64 keys of a head_dim-row");
  constexpr int64_t kValueRows = 24 / (kDim / 16);  // 6 rows at head_dim 64, 3 at 128
  static_assert(kFlashRowTile % kScoreRows == 0 && kFlashRowTile % kValueRows == 0, "whole tiles");
  const int64_t kv_heads = k_source.kv_heads;
  const int64_t padded = (num_keys + kFlashKeyBlock - 1) / kFlashKeyBlock * kFlashKeyBlock;
  // A float32 run of slots is read in place; anything else is widened into [KV, padded, d] once.
  constexpr bool kFloatSource = std::is_same_v<Source, DenseSource<float>>;
  const bool v_in_place = kFloatSource && slot_index == nullptr;
  std::unique_ptr<float[]> k_t(new float[kv_heads * kDim * padded]);
  std::unique_ptr<float[]> v_wide(v_in_place ? nullptr : new float[kv_heads * padded * kDim]);
  const int64_t chunks = padded / 64;
  at::parallel_for(0, kv_heads * chunks, 1, [&](int64_t begin, int64_t finish) {
    std::unique_ptr<float[]> block(new float[64 * kDim]);
    for (int64_t task = begin; task < finish; ++task) {
      const int64_t head = task / chunks, key0 = (task % chunks) * 64;
      const int64_t n = std::max<int64_t>(0, std::min<int64_t>(64, num_keys - key0));
      read_rows(k_source, head, slot_index, first_slot, key0, n, bf16, block.get());
      std::fill(block.get() + n * kDim, block.get() + 64 * kDim, 0.0f);  // padding keys score 0, then dropped
      float* dst = k_t.get() + head * kDim * padded + key0;
      for (int64_t j = 0; j < kDim; ++j) {
        for (int64_t b = 0; b < 64; ++b) dst[j * padded + b] = block[b * kDim + j];
      }
      if (!v_in_place) {
        float* v_dst = v_wide.get() + (head * padded + key0) * kDim;
        read_rows(v_source, head, slot_index, first_slot, key0, n, bf16, v_dst);
        std::fill(v_dst + n * kDim, v_dst + 64 * kDim, 0.0f);
      }
    }
  });
  const int64_t tiles = (rows + kFlashRowTile - 1) / kFlashRowTile;
  // Few tiles (a narrow group: 3 KV heads x one tile leave a thread of 2 idle a third of the time): each
  // tile's keys split into runs of whole blocks, their partial sums merged by log-sum-exp afterwards.
  const int64_t threads = at::get_num_threads();
  int64_t runs = 1;
  if (kv_heads * tiles < 4 * threads) {
    runs = std::min((4 * threads + kv_heads * tiles - 1) / (kv_heads * tiles),
                    std::max<int64_t>(1, num_keys / (2 * kFlashKeyBlock)));
  }
  const int64_t run_len = ((num_keys + runs - 1) / runs + kFlashKeyBlock - 1) / kFlashKeyBlock * kFlashKeyBlock;
  runs = (num_keys + run_len - 1) / run_len;
  const int64_t tasks = kv_heads * tiles * runs;
  // per task's rows, with runs: the running max, the sum and the unnormalized output
  std::unique_ptr<float[]> part_m(runs > 1 ? new float[tasks * kFlashRowTile] : nullptr);
  std::unique_ptr<float[]> part_l(runs > 1 ? new float[tasks * kFlashRowTile] : nullptr);
  std::unique_ptr<float[]> part_o(runs > 1 ? new float[tasks * kFlashRowTile * kDim] : nullptr);
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t finish) {
    std::unique_ptr<float[]> q_tile(new float[kFlashRowTile * kDim]);
    std::unique_ptr<float[]> s(new float[kFlashRowTile * kFlashKeyBlock]);
    std::unique_ptr<float[]> o(new float[kFlashRowTile * kDim]);
    float m[kFlashRowTile], l[kFlashRowTile];
    for (int64_t task = begin; task < finish; ++task) {
      const int64_t head = task / (tiles * runs), r0 = (task / runs % tiles) * kFlashRowTile;
      const int64_t key_begin = task % runs * run_len, key_end = std::min(num_keys, key_begin + run_len);
      const int64_t nr = std::min(kFlashRowTile, rows - r0);
      const float* q_rows = q + (head * rows + r0) * kDim;
      std::copy(q_rows, q_rows + nr * kDim, q_tile.get());
      std::fill(q_tile.get() + nr * kDim, q_tile.get() + kFlashRowTile * kDim, 0.0f);
      std::fill(m, m + kFlashRowTile, -std::numeric_limits<float>::infinity());
      std::fill(l, l + kFlashRowTile, 0.0f);
      std::fill(o.get(), o.get() + kFlashRowTile * kDim, 0.0f);
      const int64_t score_rows = (nr + kScoreRows - 1) / kScoreRows * kScoreRows;
      const int64_t value_rows = (nr + kValueRows - 1) / kValueRows * kValueRows;
      const float* k_head = k_t.get() + head * kDim * padded;
      const float* v_head = nullptr;
      int64_t v_stride = kDim;
      if constexpr (kFloatSource) {
        if (v_in_place) {
          v_head = v_source.data + (first_slot * kv_heads + head) * kDim;
          v_stride = kv_heads * kDim;
        }
      }
      if (!v_in_place) {
        v_head = v_wide.get() + head * padded * kDim;
        v_stride = kDim;
      }
      for (int64_t k0 = key_begin; k0 < key_end; k0 += kFlashKeyBlock) {
        const int64_t nk = std::min(kFlashKeyBlock, key_end - k0);
        for (int64_t r = 0; r < score_rows; r += kScoreRows) {
          for (int64_t c = 0; c < nk; c += 64) {
            score_tile<kDim>(q_tile.get() + r * kDim, k_head + k0 + c, padded, s.get() + r * kFlashKeyBlock + c);
          }
        }
        for (int64_t r = 0; r < nr; ++r) {  // the online softmax: rescale what came before to the new max
          float* row = s.get() + r * kFlashKeyBlock;
          const int64_t whole = nk / 16 * 16;
          float block_max = row[0];
          if (whole > 0) {
            Vec16 lanes = load16(row);
            for (int64_t b = 16; b < whole; b += 16) {
              const Vec16 x = load16(row + b);
              lanes = lanes < x ? x : lanes;
            }
            for (int64_t t = 0; t < 16; ++t) block_max = std::max(block_max, lanes[t]);
          }
          for (int64_t b = whole; b < nk; ++b) block_max = std::max(block_max, row[b]);
          const float new_max = std::max(m[r], block_max);
          const float alpha = exp_nonpositive(m[r] - new_max);  // 0 on the first block (m = -inf)
          Vec16 lanes = {};
          for (int64_t b = 0; b < whole; b += 16) {
            const Vec16 e = vexp_nonpositive(load16(row + b) - new_max);
            store16(row + b, e);
            lanes += e;
          }
          float sum = 0.0f;
          for (int64_t b = whole; b < nk; ++b) {
            row[b] = exp_nonpositive(row[b] - new_max);
            sum += row[b];
          }
          for (int64_t t = 0; t < 16; ++t) sum += lanes[t];
          if (bf16) {
            for (int64_t b = 0; b < nk; ++b) row[b] = round_bf16(row[b]);
          }
          l[r] = l[r] * alpha + sum;
          m[r] = new_max;
          if (alpha != 1.0f) {
            float* o_row = o.get() + r * kDim;
            for (int64_t j = 0; j < kDim; ++j) o_row[j] *= alpha;
          }
        }
        // rows past the tile's real ones weigh nothing
        std::fill(s.get() + nr * kFlashKeyBlock, s.get() + value_rows * kFlashKeyBlock, 0.0f);
        for (int64_t r = 0; r < value_rows; r += kValueRows) {
          value_tile<kDim, kValueRows>(s.get() + r * kFlashKeyBlock, nk, v_head + k0 * v_stride, v_stride,
                                       o.get() + r * kDim);
        }
      }
      if (runs > 1) {  // merged below
        std::copy(m, m + nr, part_m.get() + task * kFlashRowTile);
        std::copy(l, l + nr, part_l.get() + task * kFlashRowTile);
        std::copy(o.get(), o.get() + nr * kDim, part_o.get() + task * kFlashRowTile * kDim);
        continue;
      }
      for (int64_t r = 0; r < nr; ++r) {
        float* dst = out + (head * rows + r0 + r) * kDim;
        const float* src = o.get() + r * kDim;
        for (int64_t j = 0; j < kDim; ++j) dst[j] = bf16 ? round_bf16(src[j] / l[r]) : src[j] / l[r];
        lse[head * rows + r0 + r] = m[r] + std::log(l[r]);
      }
    }
  });
  if (runs == 1) return;
  at::parallel_for(0, kv_heads * rows, 16, [&](int64_t begin, int64_t finish) {
    for (int64_t at_row = begin; at_row < finish; ++at_row) {
      const int64_t head = at_row / rows, row = at_row % rows;
      // the tasks of this row's tile, one per run: task = (head * tiles + tile) * runs + run
      const int64_t first_task = (head * tiles + row / kFlashRowTile) * runs, r = row % kFlashRowTile;
      float row_max = -std::numeric_limits<float>::infinity();
      for (int64_t run = 0; run < runs; ++run) row_max = std::max(row_max, part_m[(first_task + run) * kFlashRowTile + r]);
      float total = 0.0f;
      float* dst = out + at_row * kDim;
      std::fill(dst, dst + kDim, 0.0f);
      for (int64_t run = 0; run < runs; ++run) {
        const int64_t at = (first_task + run) * kFlashRowTile + r;
        const float weight = exp_nonpositive(part_m[at] - row_max);
        total += part_l[at] * weight;
        const float* src = part_o.get() + at * kDim;
        for (int64_t j = 0; j < kDim; ++j) dst[j] += src[j] * weight;
      }
      for (int64_t j = 0; j < kDim; ++j) dst[j] = bf16 ? round_bf16(dst[j] / total) : dst[j] / total;
      lse[at_row] = row_max + std::log(total);
    }
  });
}

}  // namespace widebeam_kernels
