// exp(x) as 2^n * poly(r), r = x - n ln2: the constants and the scalar reference that every
// path's vector exp (simd_<isa>.h) computes operation for operation, so that a row's bits do not
// depend on which path or which kernel ran it.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace spx {

constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kExpLo = -80.0f;  // exp stays a normal float (no denormal rounding), so 2^n can
constexpr float kExpHi = 80.0f;   // be applied by adding n to the exponent bits; and finite
constexpr float kP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                         4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// Scalar exp for x clamped to [kExpLo, kExpHi].
inline float exp_portable(float x) {
  x = std::fmin(std::fmax(x, kExpLo), kExpHi);
  const float n = std::nearbyint(x * kLog2e);
  float r = std::fma(n, -kLn2Hi, x);
  r = std::fma(n, -kLn2Lo, r);
  float p = kP[0];
  for (int i = 1; i < 6; ++i) p = std::fma(p, r, kP[i]);
  p = std::fma(p, r * r, r + 1.0f);
  return std::ldexp(p, static_cast<int>(n));
}

// tanh(x), for soft-capped attention scores (Gemma 2: cap * tanh(s / cap)). Below |x| = kTanhSmall,
// x + x^3 p(x^2) with tanh's Taylor coefficients to x^15 (there within an ulp: the next term is under
// 1e-9 of x); from there (1 - u) / (1 + u), u = exp(-2|x|) by exp_portable (1 - u and 1 + u lose
// nothing: u <= 0.45), the sign put back. Every path computes both forms operation for operation and
// keeps the one its lane's |x| selects, so the bits are this function's.
constexpr float kTanhSmall = 0.4f;
constexpr float kT[7] = {-1.4558343682e-3f, 3.5921279341e-3f, -8.8632358238e-3f, 2.1869488060e-2f,
                         -5.3968254477e-2f, 1.3333334029e-1f, -3.3333334327e-1f};

inline float tanh_portable(float x) {
  const float a = std::fabs(x);
  if (a < kTanhSmall) {
    const float z = x * x;
    float p = kT[0];
    for (int i = 1; i < 7; ++i) p = std::fma(p, z, kT[i]);
    return std::fma(x * z, p, x);
  }
  const float u = exp_portable(-2.f * a);
  return std::copysign((1.f - u) / (1.f + u), x);
}

// A soft-capped score: cap * tanh(s * inv), inv = 1 / cap rounded once (softcap_inverse).
inline float softcap_inverse(float cap) { return 1.f / cap; }
inline float softcap_portable(float s, float cap, float inv) { return cap * tanh_portable(s * inv); }

// exp(-a) for a in [0, 80] by fastexp.h's polynomial in plain arithmetic (+, -, *, one rounding
// each: no fma, nearbyint or ldexp, which are C library calls on a baseline x86-64 build and made
// GeGLU a third of a Gemma prefill; family.cpp, experts.cpp), so the compiler inlines and vectorizes it without changing a
// bit: rounding to the nearest integer by adding and subtracting 1.5 * 2^23, 2^n from its
// exponent bits (n >= -116: a normal float, and so is the product).
inline float exp_neg_plain(float a) {
  const float x = -a;
  constexpr float kShift = 12582912.f;  // 1.5 * 2^23
  const float n = (x * kLog2e + kShift) - kShift;
  float r = x - n * kLn2Hi;  // exact: kLn2Hi has 9 significant bits, |n| <= 116
  r = r - n * kLn2Lo;
  float p = kP[0] * r + kP[1];
  p = p * r + kP[2];
  p = p * r + kP[3];
  p = p * r + kP[4];
  p = p * r + kP[5];
  p = p * (r * r) + (r + 1.0f);
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace spx
