// The q8 KV cache rows (`--kv-cache q8`): a row of d values (d a multiple of 32) is stored as d
// int8 values, then d/32 bfloat16 scales, one per 32 values: d + d/16 bytes against bfloat16's 2d
// (0.53x for d = 128). The write quantizes (plain scalar code, the same bits on every CPU); a read
// turns a value back into the bfloat16 the attention kernels take, round(q * scale): q * scale is
// exact in float32 (8-bit by 8-bit significands), so every path's conversion gives the same bits,
// and attention then runs the bfloat16 arithmetic of attention.h unchanged.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "half.h"

namespace spx {

constexpr int64_t kQ8Group = 32;
// A scale below this is stored as 0 (its group as zeros), so no product is ever subnormal (a
// vector conversion to bfloat16 would flush it) and every path rounds the same values.
constexpr float kQ8MinScale = 7.8886090522101181e-31f;  // 2^-100

// A q8 row's size in 16-bit units (the caches' unit: rows start 2-byte aligned).
inline int64_t q8_row_units(int64_t d) { return d / 2 + d / 32; }

// x [d] float32 into a q8 row at dst: per group of 32, scale = bfloat16(max |x| / 127), q =
// round-half-even(x / scale) in [-127, 127].
inline void quantize_q8_row(const float* x, int64_t d, uint16_t* dst) {
  int8_t* q = reinterpret_cast<int8_t*>(dst);
  unsigned char* scales = reinterpret_cast<unsigned char*>(dst) + d;
  for (int64_t g = 0; g < d / kQ8Group; ++g) {
    const float* xg = x + g * kQ8Group;
    float amax = 0.f;
    for (int64_t i = 0; i < kQ8Group; ++i) amax = std::fmax(amax, std::fabs(xg[i]));
    uint16_t s = float_to_bf16(amax / 127.f);
    const float sf = bf16_to_float(s);
    const bool zero = !(sf >= kQ8MinScale) || std::isinf(sf);  // also a NaN or infinite group: zeros
    if (zero) s = 0;
    for (int64_t i = 0; i < kQ8Group; ++i) {
      const float r = zero ? 0.f : std::nearbyint(xg[i] / sf);
      q[g * kQ8Group + i] = static_cast<int8_t>(r != r ? 0.f : std::fmin(127.f, std::fmax(-127.f, r)));
    }
    std::memcpy(scales + 2 * g, &s, 2);
  }
}

// Calls group(q, scale, out) for each 32-value group of n q8 rows (stride q8_row_units(d)), `out`
// its place in n bfloat16 rows of d: the walk every path's conversion shares, the path converting a group.
// Always inlined, so a path's conversion (compiled for its ISA) is inlined into its own loop.
template <class Group>
__attribute__((always_inline)) inline void for_each_q8_group(const uint16_t* rows, int n, int64_t d, uint16_t* out, Group group) {
  const int64_t stride = q8_row_units(d);
  for (int r = 0; r < n; ++r) {
    const int8_t* q = reinterpret_cast<const int8_t*>(rows + r * stride);
    const unsigned char* scales = reinterpret_cast<const unsigned char*>(q) + d;
    for (int64_t g = 0; g < d / kQ8Group; ++g) {
      uint16_t s;
      std::memcpy(&s, scales + 2 * g, 2);
      group(q + g * kQ8Group, bf16_to_float(s), out + r * d + g * kQ8Group);
    }
  }
}

// n q8 rows into n bfloat16 rows of d: the reference conversion.
inline void dequant_q8_portable(const uint16_t* rows, int n, int64_t d, uint16_t* out) {
  for_each_q8_group(rows, n, d, out, [](const int8_t* q, float sf, uint16_t* o) {
    for (int64_t i = 0; i < kQ8Group; ++i) o[i] = float_to_bf16(static_cast<float>(q[i]) * sf);
  });
}

}  // namespace spx
