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

// tanh_portable on 4 lanes: both of its forms, each operation for operation, blended by |x|.
inline float32x4_t tanh_neon(float32x4_t x) {
  const float32x4_t a = vabsq_f32(x);
  const float32x4_t z = vmulq_f32(x, x);
  float32x4_t p = vdupq_n_f32(kT[0]);
  for (int i = 1; i < 7; ++i) p = vfmaq_f32(vdupq_n_f32(kT[i]), p, z);
  const float32x4_t small = vfmaq_f32(x, vmulq_f32(x, z), p);
  const float32x4_t u = exp_neon(vmulq_f32(a, vdupq_n_f32(-2.f)));
  const float32x4_t one = vdupq_n_f32(1.f);
  const float32x4_t large = vdivq_f32(vsubq_f32(one, u), vaddq_f32(one, u));  // >= 0
  const uint32x4_t sign = vandq_u32(vreinterpretq_u32_f32(x), vdupq_n_u32(0x80000000u));
  const float32x4_t signed_large = vreinterpretq_f32_u32(vorrq_u32(vreinterpretq_u32_f32(large), sign));
  return vbslq_f32(vcltq_f32(a, vdupq_n_f32(kTanhSmall)), small, signed_large);
}

// softcap_portable on 4 lanes.
inline float32x4_t softcap_neon(float32x4_t s, float cap, float inv) {
  return vmulq_f32(vdupq_n_f32(cap), tanh_neon(vmulq_f32(s, vdupq_n_f32(inv))));
}

// 4 halves (IEEE binary16) as float32: exact.
inline float32x4_t load_f16x4(const uint8_t* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p)))); }

}  // namespace spx
