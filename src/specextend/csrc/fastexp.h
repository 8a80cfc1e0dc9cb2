// exp(x) as 2^n * poly(r), r = x - n ln2, in one place for every kernel: the portable and the
// AVX-512 paths must compute it with the same constants and the same operation order, so that a
// row's bits do not depend on which path or which kernel ran it.
#pragma once

#include <cmath>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kExpLo = -80.0f;  // exp stays a normal float (no denormal rounding)
constexpr float kExpHi = 80.0f;   // and finite
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

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,fma")

// The same exp on 16 lanes, operation for operation.
inline __m512 exp_avx512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kExpLo)), _mm512_set1_ps(kExpHi));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Hi), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kP[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

#pragma GCC pop_options
#endif

}  // namespace
