// RoPE and the KV-cache write (rope.h).
#include "rope.h"

#include <cmath>

#include "half.h"
#include "kv_q8.h"

namespace spx {

namespace {

void rotate(const Rope& op, const float* src, const float* norm, int64_t tok, float* dst) {
  const int64_t d = op.d, r = op.rot > 0 ? op.rot : d, half = r / 2;
  float buf[kMaxHeadDim];
  const float* x = src;
  if (norm != nullptr) {
    float sq = 0.f;
    for (int64_t i = 0; i < d; ++i) sq += src[i] * src[i];
    const float inv = 1.f / std::sqrt(sq / static_cast<float>(d) + op.eps);
    for (int64_t i = 0; i < d; ++i) buf[i] = norm[i] * (src[i] * inv);
    x = buf;
  }
  const float* c = op.cos + tok * r;
  const float* s = op.sin + tok * r;
  for (int64_t i = 0; i < r; ++i) {
    const float rot = i < half ? -x[i + half] : x[i - half];
    dst[i] = x[i] * c[i] + rot * s[i];
  }
  for (int64_t i = r; i < d; ++i) dst[i] = x[i];
}

}  // namespace

void rope_tokens(const Rope& op, int64_t t0, int64_t t1) {
  const int64_t d = op.d, width = (op.heads + 2 * op.kv_heads) * d;
  float tmp[kMaxHeadDim];
  for (int64_t tok = t0; tok < t1; ++tok) {
    const float* row = op.h + tok * width;
    for (int64_t hh = 0; hh < op.heads; ++hh) rotate(op, row + hh * d, op.q_norm, tok, op.q + (hh * op.t + tok) * d);
    for (int64_t hh = 0; hh < op.kv_heads; ++hh) {
      rotate(op, row + (op.heads + hh) * d, op.k_norm, tok, tmp);
      const int64_t unit = op.q8 ? q8_row_units(d) : d;
      uint16_t* kd = op.k + hh * op.k_head_stride + (op.start + tok) * unit;
      uint16_t* vd = op.v + hh * op.v_head_stride + (op.start + tok) * unit;
      const float* v = row + (op.heads + op.kv_heads + hh) * d;
      if (op.q8) {
        if (op.k_offset != nullptr)
          for (int64_t i = 0; i < d; ++i) tmp[i] -= op.k_offset[hh * d + i];
        quantize_q8_row(tmp, d, kd);
        quantize_q8_row(v, d, vd);
        continue;
      }
      for (int64_t i = 0; i < d; ++i) {
        kd[i] = float_to_bf16(tmp[i]);
        vd[i] = float_to_bf16(v[i]);
      }
    }
  }
}

}  // namespace spx
