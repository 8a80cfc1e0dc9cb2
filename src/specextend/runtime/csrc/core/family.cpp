// A model family's row operations (family.h).
#include "family.h"

#include <cmath>

#include "fastexp.h"

namespace spx {

void rms_row(const float* x, int64_t k, const float* w, float eps, float* out) {
  float sq = 0.f;
  for (int64_t i = 0; i < k; ++i) sq += x[i] * x[i];
  const float inv = 1.f / std::sqrt(sq / static_cast<float>(k) + eps);
  for (int64_t i = 0; i < k; ++i) out[i] = w != nullptr ? w[i] * (x[i] * inv) : x[i] * inv;
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

float tanh_portable(float x) {
  // exp_portable clamps its argument to [-80, 80]: 2 / (exp(2x) + 1) is then 2 (x far below 0)
  // or about 1e-35 (far above), so the result saturates at -1 and 1.
  return 1.f - 2.f / (exp_portable(2.f * x) + 1.f);
}

void gelu_mul_row(const float* gu, int64_t inter, float* out) {
  constexpr float kBeta = 0.7978845608028654f;  // sqrt(2 / pi)
  constexpr float kKappa = 0.044715f;
  for (int64_t i = 0; i < inter; ++i) {
    const float g = gu[i], u = gu[inter + i];
    const float inner = kBeta * (g + kKappa * (g * g * g));
    out[i] = (0.5f * g * (1.f + tanh_portable(inner))) * u;
  }
}

}  // namespace spx
