// AVX-512 helpers shared by the avx512 kernels; include inside an SPX_BEGIN_AVX512* region.
#pragma once

#include "x86.h"

#include "fastexp.h"

namespace spx {

// exp_portable on 16 lanes, operation for operation.
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

// tanh_portable on 16 lanes: both of its forms, each operation for operation, blended by |x|.
inline __m512 tanh_avx512(__m512 x) {
  const __m512 a = _mm512_abs_ps(x);
  const __m512 z = _mm512_mul_ps(x, x);
  __m512 p = _mm512_set1_ps(kT[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(kT[i]));
  const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(x, z), p, x);
  const __m512 u = exp_avx512(_mm512_mul_ps(a, _mm512_set1_ps(-2.f)));
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 large = _mm512_div_ps(_mm512_sub_ps(one, u), _mm512_add_ps(one, u));  // >= 0
  const __m512 signed_large = _mm512_or_ps(large, _mm512_and_ps(x, _mm512_set1_ps(-0.f)));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(kTanhSmall), _CMP_LT_OQ), signed_large, small);
}

// softcap_portable on 16 lanes.
inline __m512 softcap_avx512(__m512 s, float cap, float inv) {
  return _mm512_mul_ps(_mm512_set1_ps(cap), tanh_avx512(_mm512_mul_ps(s, _mm512_set1_ps(inv))));
}

}  // namespace spx
