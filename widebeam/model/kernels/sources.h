// Where attention reads a layer's K or V from, one token's head at a time as floats (attention.cpp and
// flash_rows.h): the int8 pool (dequantized as read; quantized_kv.py is the format and the reference) or a
// float32/bfloat16 cache (widened as read).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

#include "common.h"

namespace widebeam_kernels {

// Where a layer's K (or V) is read from, one token's head at a time, as floats.
// The int8 pool's half (K or V): values int8 [num_slots, kv_heads, head_dim], scales float16 [num_slots,
// kv_heads, groups]; dequantized as read.
struct Int8Source {
  const int8_t* values;
  const c10::Half* scales;
  int64_t kv_heads, head_dim, groups;
  static constexpr bool kRoundsOnRead = true;  // a bfloat16 read rounds what it dequantizes
  void read(int64_t slot, int64_t head, float* dst) const {
    const int64_t group_size = head_dim / groups;
    const int8_t* src = values + (slot * kv_heads + head) * head_dim;
    const c10::Half* scale = scales + (slot * kv_heads + head) * groups;
    for (int64_t g = 0; g < groups; ++g) {
      const float s = static_cast<float>(scale[g]);
      for (int64_t j = g * group_size; j < (g + 1) * group_size; ++j) dst[j] = static_cast<float>(src[j]) * s;
    }
  }
};

// A float32 or bfloat16 cache [num_slots, kv_heads, head_dim], widened to float32 as read (a bfloat16
// value is exact in float32: nothing to round).
template <typename T>
struct DenseSource {
  const T* data;
  int64_t kv_heads, head_dim;
  static constexpr bool kRoundsOnRead = false;
  void read(int64_t slot, int64_t head, float* dst) const {
    const T* src = data + (slot * kv_heads + head) * head_dim;
    for (int64_t j = 0; j < head_dim; ++j) dst[j] = static_cast<float>(src[j]);
  }
};

// `count` keys' heads (keys key.., their slots from slot_index or consecutive from first_slot) into rows
// of `out` ([count][head_dim] floats).
template <typename Source>
inline void read_rows(const Source& source, int64_t head, const int64_t* slot_index, int64_t first_slot,
                      int64_t key, int64_t count, bool bf16, float* out) {
  for (int64_t b = 0; b < count; ++b) {
    const int64_t slot = slot_index != nullptr ? slot_index[key + b] : first_slot + key + b;
    float* dst = out + b * source.head_dim;
    source.read(slot, head, dst);
    if (Source::kRoundsOnRead && bf16) {
      for (int64_t j = 0; j < source.head_dim; ++j) dst[j] = round_bf16(dst[j]);
    }
  }
}

}  // namespace widebeam_kernels
