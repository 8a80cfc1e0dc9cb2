// exp(x) as 2^n * poly(r), r = x - n ln2: the constants and the scalar reference that every
// path's vector exp (simd_<isa>.h) computes operation for operation, so that a row's bits do not
// depend on which path or which kernel ran it.
#pragma once

#include <cmath>

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

}  // namespace spx
