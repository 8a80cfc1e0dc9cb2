// A model family's row operations (family.h).
#include "family.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "fastexp.h"

namespace spx {

void rms_row(const float* x, int64_t k, const float* w, float eps, float* out) {
  float sq = 0.f;
  for (int64_t i = 0; i < k; ++i) sq += x[i] * x[i];
  const float inv = 1.f / std::sqrt(sq / static_cast<float>(k) + eps);
  for (int64_t i = 0; i < k; ++i) out[i] = w != nullptr ? w[i] * (x[i] * inv) : x[i] * inv;
}

void center_row(const float* x, int64_t k, float* out) {
  float part[16] = {0.f};
  for (int64_t i = 0; i < k; ++i) part[i % 16] += x[i];
  float total = 0.f;
  for (float v : part) total += v;
  const float mean = total / static_cast<float>(k);
  for (int64_t i = 0; i < k; ++i) out[i] = x[i] - mean;
}

void residual_row(const float* x, const float* y, int64_t k, const float* norm, float eps, float scale, float* out) {
  float inv = 1.f;
  if (norm != nullptr) {
    float sq = 0.f;
    for (int64_t i = 0; i < k; ++i) sq += y[i] * y[i];
    inv = 1.f / std::sqrt(sq / static_cast<float>(k) + eps);
  }
  for (int64_t i = 0; i < k; ++i) {
    float v = norm != nullptr ? norm[i] * (y[i] * inv) : y[i];
    if (scale != 1.f) v = v * scale;
    out[i] = x[i] + v;
  }
}

namespace {

// tanh(y) = sign(y) (1 - e) / (1 + e), e = exp(-2 |y|) with 2 |y| clamped to 80 (e then ~1e-35:
// the result is +-1). The clamp compares the bits as integers (non-negative floats order as
// their bits do): a float comparison may trap, which keeps the compiler from vectorizing it.
inline float tanh_plain(float y) {
  uint32_t bits;
  const float a0 = 2.f * std::fabs(y);
  std::memcpy(&bits, &a0, sizeof(bits));
  constexpr uint32_t kCap = 0x42a00000u;  // 80.f
  bits = bits < kCap ? bits : kCap;
  float a;
  std::memcpy(&a, &bits, sizeof(a));
  const float e = exp_neg_plain(a);
  return std::copysign((1.f - e) / (1.f + e), y);
}

}  // namespace

void gelu_mul_row(const float* gu, int64_t inter, float* out) {
  constexpr float kBeta = 0.7978845608028654f;  // sqrt(2 / pi)
  constexpr float kKappa = 0.044715f;
  for (int64_t i = 0; i < inter; ++i) {
    const float g = gu[i], u = gu[inter + i];
    const float inner = kBeta * (g + kKappa * (g * g * g));
    out[i] = (0.5f * g * (1.f + tanh_plain(inner))) * u;
  }
}

void conv_input_row(const float* bcx, int64_t hidden, float* own) {
  for (int64_t i = 0; i < hidden; ++i) own[i] = bcx[i] * bcx[2 * hidden + i];
}

void conv_row(const float* bcx, int64_t hidden, const float* const* taps, const float* w, int64_t kernel, float* out) {
  const float* c = bcx + hidden;
  for (int64_t i = 0; i < hidden; ++i) {
    float acc = w[i * kernel] * (taps[0] != nullptr ? taps[0][i] : 0.f);
    for (int64_t j = 1; j < kernel; ++j) acc = acc + w[i * kernel + j] * (taps[j] != nullptr ? taps[j][i] : 0.f);
    out[i] = c[i] * acc;
  }
}

}  // namespace spx
