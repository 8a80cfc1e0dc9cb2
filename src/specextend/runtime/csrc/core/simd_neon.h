// NEON helpers shared by the neon kernels; include inside an SPX_BEGIN_NEON region.
#pragma once

#include <arm_neon.h>

#include "fastexp.h"

namespace spx {

// exp_portable on 4 lanes, operation for operation (vfmaq_f32(a, b, c) = a + b*c, fused). n is
// an integer in [-116, 116] and p * 2^n a normal float, so adding n to the exponent is exact.
inline float32x4_t exp_neon(float32x4_t x) {
  x = vminq_f32(vmaxq_f32(x, vdupq_n_f32(kExpLo)), vdupq_n_f32(kExpHi));
  const float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(kLog2e)));
  float32x4_t r = vfmaq_f32(x, n, vdupq_n_f32(-kLn2Hi));
  r = vfmaq_f32(r, n, vdupq_n_f32(-kLn2Lo));
  float32x4_t p = vdupq_n_f32(kP[0]);
  for (int i = 1; i < 6; ++i) p = vfmaq_f32(vdupq_n_f32(kP[i]), p, r);
  p = vfmaq_f32(vaddq_f32(r, vdupq_n_f32(1.0f)), p, vmulq_f32(r, r));
  const int32x4_t e = vshlq_n_s32(vcvtq_s32_f32(n), 23);
  return vreinterpretq_f32_s32(vaddq_s32(vreinterpretq_s32_f32(p), e));
}

// 4 halves (IEEE binary16) as float32: exact.
inline float32x4_t load_f16x4(const uint8_t* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p)))); }

}  // namespace spx
