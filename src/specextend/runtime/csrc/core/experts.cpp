// A mixture-of-experts layer's row operations (experts.h).
#include "experts.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>

#include "fastexp.h"

namespace spx {

namespace {

// The indices of the `used` largest values, descending; ties keep the lower index first.
void top_indices(const float* v, int64_t count, int64_t used, int64_t* out, int64_t* idx) {
  std::iota(idx, idx + count, 0);
  std::partial_sort(idx, idx + used, idx + count,
                    [&](int64_t a, int64_t b) { return v[a] > v[b] || (v[a] == v[b] && a < b); });
  std::copy(idx, idx + used, out);
}

// p_i = exp(v_i - max) / sum, the sum in order.
void softmax(const float* v, int64_t n, float* p) {
  float m = v[0];
  for (int64_t i = 1; i < n; ++i) m = std::fmax(m, v[i]);
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    p[i] = exp_portable(v[i] - m);
    s += p[i];
  }
  for (int64_t i = 0; i < n; ++i) p[i] = p[i] / s;
}

// 1 / (1 + exp(-x)) with e = exp(-|x|) (|x| clamped to 80: e ~1e-35), e / (1 + e) for negative x:
// plain arithmetic (fastexp.h's exp_neg_plain) that the compiler vectorizes.
inline float sigmoid_plain(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  constexpr uint32_t kCap = 0x42a00000u;  // 80.f
  uint32_t abits = bits & 0x7fffffffu;
  abits = abits < kCap ? abits : kCap;
  float a;
  std::memcpy(&a, &abits, sizeof(a));
  const float e = exp_neg_plain(a);
  const float s = 1.0f / (1.0f + e);
  return (bits >> 31) != 0 ? e * s : s;
}

}  // namespace

void route_row(const float* logits, int64_t count, int64_t used, Weighting kind, const float* select_bias,
               int64_t* experts, float* weights, float* scratch, int64_t* iscratch) {
  if (kind == Weighting::TopkSoftmax) {
    top_indices(logits, count, used, experts, iscratch);
    for (int64_t j = 0; j < used; ++j) scratch[j] = logits[experts[j]];
    softmax(scratch, used, weights);
    return;
  }
  float* p = scratch;
  if (kind == Weighting::SigmoidBiasedTopkNorm) {
    for (int64_t i = 0; i < count; ++i) p[i] = sigmoid_plain(logits[i]);
  } else {
    softmax(logits, count, p);
  }
  if (biased(kind)) {  // the bias picks the experts; the probabilities weigh them
    float* chosen = scratch + count;
    for (int64_t i = 0; i < count; ++i) chosen[i] = p[i] + select_bias[i];
    top_indices(chosen, count, used, experts, iscratch);
  } else {
    top_indices(p, count, used, experts, iscratch);
  }
  for (int64_t j = 0; j < used; ++j) weights[j] = p[experts[j]];
  if (kind != Weighting::SoftmaxTopk) {
    float s = 0.f;
    for (int64_t j = 0; j < used; ++j) s += weights[j];
    if (kind == Weighting::SoftmaxBiasedTopkNorm) s = std::fmax(s, kNormMin);
    if (kind == Weighting::SigmoidBiasedTopkNorm) s = s + kSigmoidNormEps;
    for (int64_t j = 0; j < used; ++j) weights[j] = weights[j] / s;
  }
}

void swiglu_oai_row(const float* gu, int64_t ff, float* out) {
  constexpr float kAlpha = 1.702f, kLimit = 7.0f;
  for (int64_t i = 0; i < ff; ++i) {
    const float g = std::min(gu[i], kLimit);
    const float u = std::min(std::max(gu[ff + i], -kLimit), kLimit);
    out[i] = (u + 1.0f) * (g * sigmoid_plain(g * kAlpha));
  }
}

void weighted_sum_row(const float* const* ys, const float* weights, int64_t used, int64_t hidden, float* out) {
  for (int64_t j = 0; j < used; ++j) {
    const float w = weights[j];
    const float* y = ys[j];
    if (j == 0) {
      for (int64_t i = 0; i < hidden; ++i) out[i] = y[i] * w;
    } else {
      for (int64_t i = 0; i < hidden; ++i) out[i] = out[i] + y[i] * w;
    }
  }
}

void shared_expert_add_row(float* out, float gate, const float* s, int64_t hidden) {
  const float g = sigmoid_plain(gate);
  for (int64_t i = 0; i < hidden; ++i) out[i] = out[i] + g * s[i];
}

void shared_expert_add_row(float* out, const float* s, int64_t hidden) {
  for (int64_t i = 0; i < hidden; ++i) out[i] = out[i] + s[i];
}

}  // namespace spx
