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

}  // namespace spx
