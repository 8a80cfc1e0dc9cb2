// The AVX-512 intrinsics the avx512 kernels use, emulated for a CPU without AVX-512 (tests only:
// the exactness program built with -DSPECEXTEND_EMULATE_AVX512 runs the avx512 path's code on an
// AVX2 machine). SIMDe (Debian's libsimde-dev) provides most; the rest are written out here,
// VDPBF16PS as the hardware computes a lane (SIMDe adds both products before the accumulator).
#pragma once
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <cmath>
#include <cstdint>
#include <cstring>

static inline simde__m512 emu_cvtepi32_ps(simde__m512i a) {
  simde__m512i_private p = simde__m512i_to_private(a);
  simde__m512_private r;
  for (int i = 0; i < 16; ++i) r.f32[i] = static_cast<float>(p.i32[i]);
  return simde__m512_from_private(r);
}
static inline simde__m512i emu_cvtepu8_epi32(simde__m128i a) {
  simde__m128i_private p = simde__m128i_to_private(a);
  simde__m512i_private r;
  for (int i = 0; i < 16; ++i) r.i32[i] = p.u8[i];
  return simde__m512i_from_private(r);
}
static inline simde__m512i emu_cvtepi8_epi32(simde__m128i a) {
  simde__m128i_private p = simde__m128i_to_private(a);
  simde__m512i_private r;
  for (int i = 0; i < 16; ++i) r.i32[i] = p.i8[i];
  return simde__m512i_from_private(r);
}
static inline simde__m512i emu_cvtepu16_epi32(simde__m256i a) {
  simde__m256i_private p = simde__m256i_to_private(a);
  simde__m512i_private r;
  for (int i = 0; i < 16; ++i) r.i32[i] = p.u16[i];
  return simde__m512i_from_private(r);
}
#undef _mm512_cvtepu16_epi32
#define _mm512_cvtepu16_epi32 emu_cvtepu16_epi32
#undef _mm512_cvtepi32_ps
#define _mm512_cvtepi32_ps emu_cvtepi32_ps
#undef _mm512_cvtepu8_epi32
#define _mm512_cvtepu8_epi32 emu_cvtepu8_epi32
#undef _mm512_cvtepi8_epi32
#define _mm512_cvtepi8_epi32 emu_cvtepi8_epi32
static inline simde__m512 emu_cvtph_ps(simde__m256i a) {  // F16C on each half (exact)
  simde__m256i_private p = simde__m256i_to_private(a);
  simde__m512_private r;
  _mm256_storeu_ps(&r.f32[0], _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(&p.u16[0]))));
  _mm256_storeu_ps(&r.f32[8], _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(&p.u16[8]))));
  return simde__m512_from_private(r);
}
#undef _mm512_cvtph_ps
#define _mm512_cvtph_ps emu_cvtph_ps
static inline float emu_reduce_max_ps(simde__m512 a) {
  simde__m512_private p = simde__m512_to_private(a);
  float m = p.f32[0];
  for (int i = 1; i < 16; ++i) m = p.f32[i] > m ? p.f32[i] : m;
  return m;
}
static inline int emu_reduce_add_epi32(simde__m512i a) {
  simde__m512i_private p = simde__m512i_to_private(a);
  int s = 0;
  for (int i = 0; i < 16; ++i) s += p.i32[i];
  return s;
}
static inline simde__m512i emu_cvtps_epi32(simde__m512 a) {  // current rounding mode: nearest even
  simde__m512_private p = simde__m512_to_private(a);
  simde__m512i_private r;
  for (int i = 0; i < 16; ++i) r.i32[i] = static_cast<int32_t>(__builtin_nearbyintf(p.f32[i]));
  return simde__m512i_from_private(r);
}
#undef _mm512_reduce_max_ps
#define _mm512_reduce_max_ps emu_reduce_max_ps
#undef _mm512_reduce_add_epi32
#define _mm512_reduce_add_epi32 emu_reduce_add_epi32
#undef _mm512_cvtps_epi32
#define _mm512_cvtps_epi32 emu_cvtps_epi32
// VDPBF16PS as the hardware computes a lane: src + a1*b1, then + a0*b0, each step one fma with its
// inputs' subnormals read as zero and a subnormal result flushed (the instruction's DAZ and FTZ),
// which is what the references (attention_portable.cpp, BF16D's in qlinear_portable.cpp) model;
// SIMDe adds both products first.
static inline float emu_bf(uint16_t h) { uint32_t u = static_cast<uint32_t>(h) << 16; float f; memcpy(&f, &u, 4); return f; }
static inline float emu_bf_daz(uint16_t h) { return emu_bf((h & 0x7F80) == 0 ? static_cast<uint16_t>(h & 0x8000) : h); }
static inline float emu_ftz(float f) { return std::fpclassify(f) == FP_SUBNORMAL ? std::copysign(0.f, f) : f; }
static inline simde__m512 emu_dpbf16_ps(simde__m512 src, simde__m512bh a, simde__m512bh b) {
  alignas(64) float s[16]; alignas(64) uint16_t x[32], y[32];
  memcpy(s, &src, 64); memcpy(x, &a, 64); memcpy(y, &b, 64);
  for (int i = 0; i < 16; ++i) {
    const float t = emu_ftz(std::fma(emu_bf_daz(x[2 * i + 1]), emu_bf_daz(y[2 * i + 1]), emu_ftz(s[i])));
    s[i] = emu_ftz(std::fma(emu_bf_daz(x[2 * i]), emu_bf_daz(y[2 * i]), t));
  }
  simde__m512 r; memcpy(&r, s, 64); return r;
}
static inline uint16_t emu_to_bf(float f) { uint32_t u; memcpy(&u, &f, 4); u += 0x7FFF + ((u >> 16) & 1); return static_cast<uint16_t>(u >> 16); }
static inline simde__m512bh emu_cvtne2ps_pbh(simde__m512 a, simde__m512 b) {
  alignas(64) float fa[16], fb[16]; alignas(64) uint16_t r[32];
  memcpy(fa, &a, 64); memcpy(fb, &b, 64);
  for (int i = 0; i < 16; ++i) { r[i] = emu_to_bf(fb[i]); r[16 + i] = emu_to_bf(fa[i]); }
  simde__m512bh out; memcpy(&out, r, 64); return out;
}
#undef _mm512_dpbf16_ps
#define _mm512_dpbf16_ps emu_dpbf16_ps
#undef _mm512_cvtne2ps_pbh
#define _mm512_cvtne2ps_pbh emu_cvtne2ps_pbh
static inline simde__m512 emu_shuffle_f32x4(simde__m512 a, simde__m512 b, int imm) {
  alignas(64) float x[16], y[16], r[16];
  memcpy(x, &a, 64); memcpy(y, &b, 64);
  for (int i = 0; i < 4; ++i) {
    const float* src = i < 2 ? x : y;
    const int sel = (imm >> (2 * i)) & 3;
    memcpy(r + 4 * i, src + 4 * sel, 16);
  }
  simde__m512 out; memcpy(&out, r, 64); return out;
}
#undef _mm512_shuffle_f32x4
#define _mm512_shuffle_f32x4 emu_shuffle_f32x4
