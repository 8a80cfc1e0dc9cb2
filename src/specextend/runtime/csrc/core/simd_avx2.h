// AVX2 helpers shared by the avx2 kernels; include inside an SPX_BEGIN_AVX2 region.
#pragma once

#include <immintrin.h>

#include "fastexp.h"

namespace spx {

// exp_portable on 8 lanes, operation for operation. n is an integer in [-116, 116] and p * 2^n
// a normal float (fastexp.h's clamp), so adding n to the exponent field is the exact ldexp.
inline __m256 exp_avx2(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpLo)), _mm256_set1_ps(kExpHi));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Hi), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kP[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
}

// tanh_portable on 8 lanes: both of its forms, each operation for operation, blended by |x|.
inline __m256 tanh_avx2(__m256 x) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256 a = _mm256_andnot_ps(sign, x);
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 p = _mm256_set1_ps(kT[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(kT[i]));
  const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(x, z), p, x);
  const __m256 u = exp_avx2(_mm256_mul_ps(a, _mm256_set1_ps(-2.f)));
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 large = _mm256_div_ps(_mm256_sub_ps(one, u), _mm256_add_ps(one, u));  // >= 0
  const __m256 signed_large = _mm256_or_ps(large, _mm256_and_ps(x, sign));
  return _mm256_blendv_ps(signed_large, small, _mm256_cmp_ps(a, _mm256_set1_ps(kTanhSmall), _CMP_LT_OQ));
}

// softcap_portable on 8 lanes.
inline __m256 softcap_avx2(__m256 s, float cap, float inv) {
  return _mm256_mul_ps(_mm256_set1_ps(cap), tanh_avx2(_mm256_mul_ps(s, _mm256_set1_ps(inv))));
}

// Sum of 8 lanes by the tree i+4, i+2, i+1 (the last three levels of hsum16_portable).
inline float hsum8_tree(__m256 v) {
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}

inline float hmax8(__m256 v) {
  const __m128 b = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 c = _mm_max_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_max_ss(c, _mm_shuffle_ps(c, c, 1)));
}

inline int32_t hsum8_epi32(__m256i v) {
  const __m128i b = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i c = _mm_add_epi32(b, _mm_unpackhi_epi64(b, b));
  return _mm_cvtsi128_si32(_mm_add_epi32(c, _mm_shuffle_epi32(c, 1)));
}

}  // namespace spx
