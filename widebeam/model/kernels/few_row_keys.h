// The few-row attention's inner loop (attention.cpp's `attend`): one KV head's query rows against one run
// of keys, blocks of kKeyBlock keys read (or dequantized) into a small buffer, the online softmax kept per
// row in a Partial merged across runs by the caller.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common.h"
#include "sources.h"

namespace widebeam_kernels {

constexpr int64_t kKeyBlock = 64;

// One (KV head, run of keys) of attention: the rows' running max m [R], sum of exponentials l [R] and
// unnormalized output o [R, head_dim] over keys key_begin..key_end, merged across runs afterwards.
struct Partial {
  float* m;
  float* l;
  float* o;
};

// kDim: head_dim as a compile-time constant (a multiple of 16: the loops over it unroll into registers),
// or 0 for any head_dim (the same arithmetic through plain loops).
template <int64_t kDim, typename Source>
void attend_keys(const float* q, int64_t rows, int64_t head_dim_arg, const Source& k_source,
                 const Source& v_source, int64_t head, const int64_t* slot_index, int64_t first_slot,
                 int64_t key_begin, int64_t key_end, bool bf16, Partial partial) {
  const int64_t head_dim = kDim != 0 ? kDim : head_dim_arg;
  const int64_t num_keys = key_end - key_begin;
  std::vector<float> scores(rows * num_keys);
  std::vector<float> block(kKeyBlock * head_dim);  // a block of K or V, as floats: [key][head_dim]
  std::vector<float> k_t(head_dim * kKeyBlock);    // the K block transposed: [head_dim][key]
  // Pass 1: scores [R, keys] = q . k a block of 64 keys at a time; the inner loop runs over the block's
  // keys (four 16-float accumulators), not a reduction over head_dim, so no sum is reassociated.
  for (int64_t b0 = key_begin; b0 < key_end; b0 += kKeyBlock) {
    const int64_t nb = std::min(kKeyBlock, key_end - b0);
    read_rows(k_source, head, slot_index, first_slot, b0, nb, bf16, block.data());
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
    read_rows(v_source, head, slot_index, first_slot, b0, nb, bf16, block.data());
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

}  // namespace widebeam_kernels
