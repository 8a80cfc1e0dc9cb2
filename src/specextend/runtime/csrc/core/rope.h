// RoPE and the KV-cache write of new tokens, in plain scalar code (no SIMD, no contraction): the
// same bits whatever the CPU, and a small part of a step next to the products and attention.
#pragma once

#include <cstdint>

namespace spx {

// From the fused QKV projection h [T, (H + 2 Hkv) D]: queries (and keys) optionally RMS-normed
// per head (Qwen3), both rotated (rotate-half: x*cos + rotate_half(x)*sin, cos/sin [T, D]);
// (partial rotary: the leading rot dimensions); keys and values stored in bfloat16 at cache slots [start, start + T) of k/v [Hkv, capacity, D]
// (head strides given); rotated queries to q [H, T, D].
struct Rope {
  const float* h;
  const float* cos;
  const float* sin;
  const float* q_norm;  // [D] or null
  const float* k_norm;  // [D] or null
  float eps;
  int64_t t, heads, kv_heads, d, start;
  float* q;
  uint16_t* k;
  uint16_t* v;
  int64_t k_head_stride, v_head_stride;
  // Partial rotary (Phi-4-mini): the leading `rot` dimensions of each head rotate (rotate-half
  // within them, cos/sin [T, rot]) and the rest pass; 0: all d of them.
  int64_t rot = 0;
  // The cache holds q8 rows (kv_q8.h): keys and values are quantized as they are written (head
  // strides in 16-bit units either way).
  bool q8 = false;
  // [kv_heads, d] or null: a vector subtracted from each key before it is quantized into a q8 row
  // (the model's keys' common component, which would otherwise take a group's scale: kv_cache.py).
  // It shifts every score of a query by the same q.c, which softmax ignores. Unused for bfloat16.
  const float* k_offset = nullptr;
};

constexpr int64_t kMaxHeadDim = 1024;

// Tokens [t0, t1); d <= kMaxHeadDim.
void rope_tokens(const Rope& op, int64_t t0, int64_t t1);

}  // namespace spx
