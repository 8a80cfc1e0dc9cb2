// The neon path of the quantized linear layers: ARMv8.2 dot products (SDOT: 16 int8 products a
// instruction into 4 int32 lanes). The blob's steps already have SDOT's shape, a 32-bit lane per
// channel holding 4 inputs, so one SDOT against 4 activation bytes selected by lane covers 4
// channels x 4 inputs; a 16-channel panel is 4 registers. Codes are signed operands: Q4K (0..15)
// and Q6K (0..63) as they are, Q8's bytes as code - 128. The float epilogue is the reference's
// (qlinear.h), 4 channels an instruction.
#if defined(__aarch64__)

#include <arm_neon.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>

#include "qlinear.h"
#include "target.h"

SPX_BEGIN_NEON
#include "simd_neon.h"
#include "tiles.h"

namespace spx {

namespace {

constexpr int kTile = 4;

inline float32x4_t cvt_u8x4(const uint8_t* p) {
  uint8_t b[8] = {p[0], p[1], p[2], p[3], 0, 0, 0, 0};
  return vcvtq_f32_u32(vmovl_u16(vget_low_u16(vmovl_u8(vld1_u8(b)))));
}
inline float32x4_t cvt_i8x4(const uint8_t* p) {
  int8_t b[8] = {static_cast<int8_t>(p[0]), static_cast<int8_t>(p[1]), static_cast<int8_t>(p[2]),
                 static_cast<int8_t>(p[3]), 0, 0, 0, 0};
  return vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(vld1_s8(b)))));
}

// acc + (float(dot) * d8) * scale, fused: the reference epilogue, 4 channels.
inline float32x4_t epilogue(int32x4_t dot, float d8, float32x4_t scale, float32x4_t acc) {
  return vfmaq_f32(acc, vmulq_n_f32(vcvtq_f32_s32(dot), d8), scale);
}

// dot[c4] += codes of step `lane` (w[c4]) x the 4 activation bytes in lane `lane` of a.
#define SPX_SDOT4(dot, w, a, lane)                   \
  do {                                               \
    dot[0] = vdotq_laneq_s32(dot[0], w[0], a, lane); \
    dot[1] = vdotq_laneq_s32(dot[1], w[1], a, lane); \
    dot[2] = vdotq_laneq_s32(dot[2], w[2], a, lane); \
    dot[3] = vdotq_laneq_s32(dot[3], w[3], a, lane); \
  } while (0)

template <int R>
void panel_q4k(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, float32x4_t (*acc)[4]) {
  const int64_t sbg = s.sbg, nsb = s.k / (32 * sbg), kb = s.k / 32, sb_bytes = 64 + 288 * sbg;
  const uint8x16_t low = vdupq_n_u8(0x0F);
  for (int64_t sb = 0; sb < nsb; ++sb, p += sb_bytes) {
    for (int g = 0; g < sbg; ++g) {
      const int64_t k0 = (sb * sbg + g) * 32;
      const uint8_t* cb = p + 64 + 32 * sbg + 256 * g;
      int32x4_t dot[R][4];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < 4; ++c) dot[r][c] = vdupq_n_s32(0);
      int8x16_t a0[R], a1[R];
      for (int r = 0; r < R; ++r) {
        a0[r] = vld1q_s8(x.q8 + (r0 + r) * x.k + k0);  // steps 0..3
        a1[r] = vld1q_s8(x.q8 + (r0 + r) * x.k + k0 + 16);  // steps 4..7
      }
#define SPX_Q4K_STEP(i)                                                                    \
  {                                                                                        \
    int8x16_t lo[4], hi[4];                                                                \
    for (int c = 0; c < 4; ++c) {                                                          \
      const uint8x16_t v = vld1q_u8(cb + 64 * (i) + 16 * c);                              \
      lo[c] = vreinterpretq_s8_u8(vandq_u8(v, low));                                      \
      hi[c] = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));                                      \
    }                                                                                      \
    for (int r = 0; r < R; ++r) {                                                          \
      SPX_SDOT4(dot[r], lo, a0[r], i);                                                     \
      SPX_SDOT4(dot[r], hi, a1[r], i);                                                     \
    }                                                                                      \
  }
      SPX_Q4K_STEP(0)
      SPX_Q4K_STEP(1)
      SPX_Q4K_STEP(2)
      SPX_Q4K_STEP(3)
#undef SPX_Q4K_STEP
      for (int c = 0; c < 4; ++c) {
        const float32x4_t scale = vmulq_f32(load_f16x4(p + 8 * c), cvt_u8x4(p + 64 + 16 * g + 4 * c));
        const float32x4_t mins = vmulq_f32(load_f16x4(p + 32 + 8 * c), cvt_u8x4(p + 64 + 16 * sbg + 16 * g + 4 * c));
        for (int r = 0; r < R; ++r) {
          const int64_t b = (r0 + r) * kb + k0 / 32;
          const float32x4_t t = epilogue(dot[r][c], x.d8[b], scale, acc[r][c]);
          acc[r][c] = vfmsq_f32(t, mins, vdupq_n_f32(x.xs[b]));  // t - mins * xs, fused
        }
      }
    }
  }
}

// Quad c (channels 4c..4c+3) of a super-block's d: its f16 halves as floats, or its float32 (f32_d).
inline float32x4_t load_d(int64_t fmt, const uint8_t* sb, int c) {
  return f32_d(fmt) ? vld1q_f32(reinterpret_cast<const float*>(sb) + 4 * c) : load_f16x4(sb + 8 * c);
}

// Group g's four steps of 6-bit codes, quad c (channels 4c..4c+3), of the Q6K, Q3K, Q2K or table
// (q3_table) super-block at sb: q6_code (qlinear.h) on 16 lanes.
inline void q6_quad(int64_t fmt, const uint8_t* sb, int g, int c, int8x16_t* w) {
  if (fmt == Q2K) {
    const uint8x16_t v = vld1q_u8(sb + 320 + 64 * g + 16 * c), three = vdupq_n_u8(3);
    w[0] = vreinterpretq_s8_u8(vandq_u8(v, three));
    w[1] = vreinterpretq_s8_u8(vandq_u8(vshrq_n_u8(v, 2), three));
    w[2] = vreinterpretq_s8_u8(vandq_u8(vshrq_n_u8(v, 4), three));
    w[3] = vreinterpretq_s8_u8(vshrq_n_u8(v, 6));
    return;
  }
  if (fmt == Q3K || q3_table(fmt)) {
    const uint8_t* pair = sb + q6_header(fmt) + 192 * (g / 2);
    const uint8x16_t lo = vld1q_u8(pair + 64 * (g % 2) + 16 * c), hi = vld1q_u8(pair + 128 + 16 * c);
    for (int st = 0; st < 4; ++st) {
      const uint8x16_t l = vandq_u8(vshlq_u8(lo, vdupq_n_s8(static_cast<int8_t>(-2 * st))), vdupq_n_u8(3));
      const uint8x16_t t = vandq_u8(vshlq_u8(hi, vdupq_n_s8(static_cast<int8_t>(-(4 * (g % 2) + st)))), vdupq_n_u8(1));
      const uint8x16_t raw = vorrq_u8(l, vshlq_n_u8(t, 2));
      w[st] = vreinterpretq_s8_u8(q3_table(fmt) ? vqtbl1q_u8(vld1q_u8(q3_table_bytes(fmt)), raw) : vaddq_u8(raw, vdupq_n_u8(28)));
    }
    return;
  }
  const uint8_t* cb = sb + 288 + 192 * g;
  const uint8x16_t low = vdupq_n_u8(0x0F), top = vdupq_n_u8(0x30);
  const uint8x16_t a = vld1q_u8(cb + 16 * c), b = vld1q_u8(cb + 64 + 16 * c), hb = vld1q_u8(cb + 128 + 16 * c);
  w[0] = vreinterpretq_s8_u8(vorrq_u8(vandq_u8(a, low), vandq_u8(vshlq_n_u8(hb, 4), top)));
  w[1] = vreinterpretq_s8_u8(vorrq_u8(vandq_u8(b, low), vandq_u8(vshlq_n_u8(hb, 2), top)));
  w[2] = vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8(a, 4), vandq_u8(hb, top)));
  w[3] = vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8(b, 4), vandq_u8(vshrq_n_u8(hb, 2), top)));
}

// Group g's float scales and (Q2K: a 4-bit scale and minimum a byte) minimums, quad c, of the
// 6-bit super-block at sb.
inline void q6_scales(int64_t fmt, const uint8_t* sb, int g, int c, float32x4_t* scale, float32x4_t* mins) {
  if (fmt != Q2K) {
    *scale = vmulq_f32(load_d(fmt, sb, c), cvt_i8x4(sb + q6_scales_at(fmt) + 16 * g + 4 * c));
    return;
  }
  const uint8_t* sm = sb + 64 + 16 * g + 4 * c;
  const uint8_t b[8] = {sm[0], sm[1], sm[2], sm[3], 0, 0, 0, 0};
  const uint32x4_t v = vmovl_u16(vget_low_u16(vmovl_u8(vld1_u8(b))));
  *scale = vmulq_f32(load_f16x4(sb + 8 * c), vcvtq_f32_u32(vandq_u32(v, vdupq_n_u32(15))));
  *mins = vmulq_f32(load_f16x4(sb + 32 + 8 * c), vcvtq_f32_u32(vshrq_n_u32(v, 4)));
}

template <int R>
void panel_q6k(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, float32x4_t (*acc)[4]) {
  const int64_t nsb = s.k / 256, kb = s.k / 32, k16 = s.k / 16;
  const int32_t zero = q6_zero(s.fmt);
  for (int64_t sb = 0; sb < nsb; ++sb, p += s.fi().bytes) {
    for (int g = 0; g < 16; ++g) {
      const int64_t k0 = sb * 256 + g * 16;
      int8x16_t w[4][4];  // [step][channel quad]
      float32x4_t scale[4], mins[4];
      for (int c = 0; c < 4; ++c) {
        int8x16_t v[4];
        q6_quad(s.fmt, p, g, c, v);
        for (int st = 0; st < 4; ++st) w[st][c] = v[st];
        q6_scales(s.fmt, p, g, c, &scale[c], &mins[c]);
      }
      for (int r = 0; r < R; ++r) {
        const int64_t row = r0 + r;
        const int8x16_t a = vld1q_s8(x.q8 + row * x.k + k0);
        int32x4_t dot[4] = {vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)};
        SPX_SDOT4(dot, w[0], a, 0);
        SPX_SDOT4(dot, w[1], a, 1);
        SPX_SDOT4(dot, w[2], a, 2);
        SPX_SDOT4(dot, w[3], a, 3);
        const int32x4_t off = vdupq_n_s32(zero * x.s16[row * k16 + k0 / 16]);
        const float d8 = x.d8[row * kb + k0 / 32];
        for (int c = 0; c < 4; ++c) {
          acc[r][c] = epilogue(vsubq_s32(dot[c], off), d8, scale[c], acc[r][c]);
          if (s.fmt == Q2K) acc[r][c] = vfmsq_f32(acc[r][c], mins[c], vdupq_n_f32(q16_xs(x, row, k0)));  // fused
        }
      }
    }
  }
}

// Step st's byte codes of a byte-code group at cb, quad c (channels 4c..4c+3): byte_code
// (qlinear.h) on 16 lanes.
inline uint8x16_t step_bytes(int64_t fmt, const uint8_t* cb, int st, int c) {
  if (fmt == Q8) return vld1q_u8(cb + 64 * st + 16 * c);
  const uint8x16_t v = vld1q_u8(cb + 64 * (st % 4) + 16 * c);
  const uint8x16_t nib = st < 4 ? vandq_u8(v, vdupq_n_u8(0x0F)) : vshrq_n_u8(v, 4);
  if (code_kind(fmt) == Q40) return nib;
  if (code_kind(fmt) == IQ4) return vqtbl1q_u8(vld1q_u8(code_table(fmt)), nib);
  const uint8x16_t bit = vshlq_u8(vld1q_u8(cb + 256 + 16 * c), vdupq_n_s8(static_cast<int8_t>(4 - st)));
  return vorrq_u8(nib, vandq_u8(bit, vdupq_n_u8(0x10)));
}

// 4 channels' E8M0 bytes at p as e8m0_half's floats (qlinear.h), the same bits from shifts:
// (e - 1) << 23, or 0x00200000 << e for e < 2.
inline float32x4_t e8m0_half4(const uint8_t* p) {
  const uint8_t b[8] = {p[0], p[1], p[2], p[3], 0, 0, 0, 0};
  const uint32x4_t e = vmovl_u16(vget_low_u16(vmovl_u8(vld1_u8(b))));
  const uint32x4_t big = vshlq_n_u32(vsubq_u32(e, vdupq_n_u32(1)), 23);
  const uint32x4_t small = vshlq_u32(vdupq_n_u32(0x00200000), vreinterpretq_s32_u32(e));
  return vreinterpretq_f32_u32(vbslq_u32(vcltq_u32(e, vdupq_n_u32(2)), small, big));
}

// Quad c (channels 4c..4c+3) of a byte-code group's float scales and minimums (qlinear.h: d and
// dmin, each times its code where the format has codes); returns whether the format has minimums.
inline bool byte_scales(const Segment& s, const uint8_t* p, int g, int c, float32x4_t* scale, float32x4_t* mins) {
  *scale = e8m0_header(s.fmt) ? e8m0_half4(p + 4 * c) : load_d(s.fmt, p, c);
  if (scale_codes(s.fmt)) *scale = vmulq_f32(*scale, cvt_i8x4(group_scales(s.fmt, p, g) + 4 * c));
  *mins = has_minimum(s.fmt) ? load_f16x4(p + 32 + 8 * c) : vdupq_n_f32(0.f);
  if (k_header(s.fmt)) *mins = vmulq_f32(*mins, cvt_u8x4(group_mins(s.sbg, p, g) + 4 * c));
  return has_minimum(s.fmt);
}

// acc + one row's group, 4 channels: the byte-code formats' reference epilogue, the codes having
// run signed (code - 128), so the correction is (128 - offset) * sum(q).
inline float32x4_t q8_epilogue(int32x4_t dot, int32_t fix, float d8, float xs, float32x4_t scale, float32x4_t mins,
                               bool has_mins, float32x4_t acc) {
  acc = epilogue(vaddq_s32(dot, vdupq_n_s32(fix)), d8, scale, acc);
  return has_mins ? vfmsq_f32(acc, mins, vdupq_n_f32(xs)) : acc;  // acc - mins * xs, fused
}

template <int R>
void panel_q8(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, float32x4_t (*acc)[4]) {
  const int64_t kb = s.k / 32;
  const int32_t fix = 128 - static_cast<int32_t>(s.offset);
  const uint8x16_t flip = vdupq_n_u8(0x80);
  for_q8_groups(s, p, [&](int64_t blk, const uint8_t* sb, int g, const uint8_t* cb) {
    int32x4_t dot[R][4];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) dot[r][c] = vdupq_n_s32(0);
    for (int half = 0; half < 2; ++half) {  // steps 4*half .. 4*half + 3
      int8x16_t a[R];
      for (int r = 0; r < R; ++r) a[r] = vld1q_s8(x.q8 + (r0 + r) * x.k + blk * 32 + 16 * half);
#define SPX_Q8_STEP(i)                                                                            \
  {                                                                                               \
    int8x16_t w[4];                                                                               \
    for (int c = 0; c < 4; ++c)                                                                   \
      w[c] = vreinterpretq_s8_u8(veorq_u8(step_bytes(s.fmt, cb, 4 * half + (i), c), flip));       \
    for (int r = 0; r < R; ++r) SPX_SDOT4(dot[r], w, a[r], i);                                    \
  }
      SPX_Q8_STEP(0)
      SPX_Q8_STEP(1)
      SPX_Q8_STEP(2)
      SPX_Q8_STEP(3)
#undef SPX_Q8_STEP
    }
    for (int c = 0; c < 4; ++c) {
      float32x4_t scale, mins;
      const bool has_mins = byte_scales(s, sb, g, c, &scale, &mins);
      for (int r = 0; r < R; ++r) {
        const int64_t b = (r0 + r) * kb + blk;
        acc[r][c] = q8_epilogue(dot[r][c], fix * x.s32[b], x.d8[b], x.xs[b], scale, mins, has_mins, acc[r][c]);
      }
    }
  });
}

#undef SPX_SDOT4

template <int R>
void tile(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, const TileOut& out) {
  float32x4_t acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = vdupq_n_f32(0.f);
  switch (s.fmt) {
    case Q4K: panel_q4k<R>(s, p, x, r0, acc); break;
    case Q6K:
    case Q3K:
    case Q2K:
    case IQ2XS:
    case IQ1M: panel_q6k<R>(s, p, x, r0, acc); break;
    default: panel_q8<R>(s, p, x, r0, acc); break;
  }
  for (int c = 0; c < 4; ++c) {
    const float32x4_t b = out.bias ? vld1q_f32(out.bias + 4 * c) : vdupq_n_f32(0.f);
    for (int r = 0; r < R; ++r) {
      float32x4_t y = vaddq_f32(acc[r][c], b);
      if (out.residual) y = vaddq_f32(vld1q_f32(out.residual + (r0 + r) * out.ldo + 4 * c), y);
      vst1q_f32(out.y + (r0 + r) * out.ldo + 4 * c, y);
    }
  }
}

// ---------------------------------------------------------------- many rows
//
// One panel times any number of rows (up to kRowBlock): each weight group is unpacked into
// registers once for half the panel (8 channels: 2 registers a step, 16 for a Q4K or Q8 group or
// a pair of Q6K groups) and applied to every row in turn, the rows' float accumulators living in
// `acc` (L1) instead of registers. The tile above decodes every group again for each 4 rows.
// SDOT's lane form takes its activation lane as an immediate, hence the macros.

// dot[c] += codes of step `st` (w[st][c]) x the 4 activation bytes in lane `lane` of a, both quads.
#define SPX_SDOT2(dot, w, st, a, lane)                     \
  do {                                                     \
    dot[0] = vdotq_laneq_s32(dot[0], w[st][0], a, lane);   \
    dot[1] = vdotq_laneq_s32(dot[1], w[st][1], a, lane);   \
  } while (0)

// The exact int32 dot products of one row and one group of 8 steps (two chains: steps 0-3 and 4-7).
inline void row_dots8(const int8x16_t (*w)[2], const int8_t* q, int32x4_t* dot) {
  const int8x16_t a0 = vld1q_s8(q), a1 = vld1q_s8(q + 16);
  int32x4_t lo[2] = {vdupq_n_s32(0), vdupq_n_s32(0)}, hi[2] = {vdupq_n_s32(0), vdupq_n_s32(0)};
  SPX_SDOT2(lo, w, 0, a0, 0);
  SPX_SDOT2(hi, w, 4, a1, 0);
  SPX_SDOT2(lo, w, 1, a0, 1);
  SPX_SDOT2(hi, w, 5, a1, 1);
  SPX_SDOT2(lo, w, 2, a0, 2);
  SPX_SDOT2(hi, w, 6, a1, 2);
  SPX_SDOT2(lo, w, 3, a0, 3);
  SPX_SDOT2(hi, w, 7, a1, 3);
  dot[0] = vaddq_s32(lo[0], hi[0]);
  dot[1] = vaddq_s32(lo[1], hi[1]);
}

void rows_q4k(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int n, float* acc) {
  const int64_t sbg = s.sbg, nsb = s.k / (32 * sbg), sb_bytes = 64 + 288 * sbg, kb = x.k / 32, xk = x.k;
  const uint8x16_t low = vdupq_n_u8(0x0F);
  for (int64_t sb = 0; sb < nsb; ++sb, p += sb_bytes)
    for (int g = 0; g < sbg; ++g) {
      const int64_t k0 = (sb * sbg + g) * 32;
      const uint8_t* cb = p + 64 + 32 * sbg + 256 * g;
      for (int h = 0; h < 2; ++h) {  // channels 8h .. 8h + 7: quads 2h and 2h + 1
        int8x16_t w[8][2];
        float32x4_t scale[2], mins[2];
        for (int c = 0; c < 2; ++c) {
          const int quad = 2 * h + c;
          for (int i = 0; i < 4; ++i) {
            const uint8x16_t v = vld1q_u8(cb + 64 * i + 16 * quad);
            w[i][c] = vreinterpretq_s8_u8(vandq_u8(v, low));
            w[i + 4][c] = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
          }
          scale[c] = vmulq_f32(load_f16x4(p + 8 * quad), cvt_u8x4(p + 64 + 16 * g + 4 * quad));
          mins[c] = vmulq_f32(load_f16x4(p + 32 + 8 * quad), cvt_u8x4(p + 64 + 16 * sbg + 16 * g + 4 * quad));
        }
        for (int r = 0; r < n; ++r) {
          int32x4_t dot[2];
          row_dots8(w, x.q8 + (r0 + r) * xk + k0, dot);
          const int64_t b = (r0 + r) * kb + k0 / 32;
          float* a = acc + 16 * r + 8 * h;
          for (int c = 0; c < 2; ++c) {
            const float32x4_t t = epilogue(dot[c], x.d8[b], scale[c], vld1q_f32(a + 4 * c));
            vst1q_f32(a + 4 * c, vfmsq_f32(t, mins[c], vdupq_n_f32(x.xs[b])));  // t - mins * xs, fused
          }
        }
      }
    }
}

// Q6K's groups of 16 go in pairs (both halves of one activation block share its scale): each
// row's accumulators are loaded and stored once for the two, updated in group order.
void rows_q6k(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int n, float* acc) {
  const int64_t nsb = s.k / 256, kb = x.k / 32, k16 = x.k / 16, xk = x.k;
  const int32_t zero = q6_zero(s.fmt);
  for (int64_t sb = 0; sb < nsb; ++sb, p += s.fi().bytes)
    for (int g = 0; g < 16; g += 2) {
      const int64_t k0 = sb * 256 + g * 16;
      for (int h = 0; h < 2; ++h) {
        int8x16_t w[2][4][2];  // [group][step][quad]
        float32x4_t scale[2][2], mins[2][2];
        for (int j = 0; j < 2; ++j) {
          for (int c = 0; c < 2; ++c) {
            const int quad = 2 * h + c;
            int8x16_t v[4];
            q6_quad(s.fmt, p, g + j, quad, v);
            for (int st = 0; st < 4; ++st) w[j][st][c] = v[st];
            q6_scales(s.fmt, p, g + j, quad, &scale[j][c], &mins[j][c]);
          }
        }
        for (int r = 0; r < n; ++r) {
          const int64_t row = r0 + r;
          const int8_t* q = x.q8 + row * xk + k0;
          const int8x16_t a0 = vld1q_s8(q), a1 = vld1q_s8(q + 16);
          int32x4_t d0[2] = {vdupq_n_s32(0), vdupq_n_s32(0)}, d1[2] = {vdupq_n_s32(0), vdupq_n_s32(0)};
          SPX_SDOT2(d0, w[0], 0, a0, 0);
          SPX_SDOT2(d1, w[1], 0, a1, 0);
          SPX_SDOT2(d0, w[0], 1, a0, 1);
          SPX_SDOT2(d1, w[1], 1, a1, 1);
          SPX_SDOT2(d0, w[0], 2, a0, 2);
          SPX_SDOT2(d1, w[1], 2, a1, 2);
          SPX_SDOT2(d0, w[0], 3, a0, 3);
          SPX_SDOT2(d1, w[1], 3, a1, 3);
          const int32x4_t off0 = vdupq_n_s32(zero * x.s16[row * k16 + k0 / 16]);
          const int32x4_t off1 = vdupq_n_s32(zero * x.s16[row * k16 + k0 / 16 + 1]);
          const float d8 = x.d8[row * kb + k0 / 32];
          float* a = acc + 16 * r + 8 * h;
          for (int c = 0; c < 2; ++c) {
            float32x4_t v = epilogue(vsubq_s32(d0[c], off0), d8, scale[0][c], vld1q_f32(a + 4 * c));
            if (s.fmt == Q2K) v = vfmsq_f32(v, mins[0][c], vdupq_n_f32(q16_xs(x, row, k0)));
            v = epilogue(vsubq_s32(d1[c], off1), d8, scale[1][c], v);
            if (s.fmt == Q2K) v = vfmsq_f32(v, mins[1][c], vdupq_n_f32(q16_xs(x, row, k0 + 16)));
            vst1q_f32(a + 4 * c, v);
          }
        }
      }
    }
}

void rows_q8(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int n, float* acc) {
  const int64_t kb = x.k / 32, xk = x.k;
  const int32_t fix = 128 - static_cast<int32_t>(s.offset);
  const uint8x16_t flip = vdupq_n_u8(0x80);
  for_q8_groups(s, p, [&](int64_t blk, const uint8_t* sb, int g, const uint8_t* cb) {
    for (int h = 0; h < 2; ++h) {
      int8x16_t w[8][2];
      float32x4_t scale[2], mins[2];
      bool has_mins = false;
      for (int c = 0; c < 2; ++c) {
        const int quad = 2 * h + c;
        for (int st = 0; st < 8; ++st) w[st][c] = vreinterpretq_s8_u8(veorq_u8(step_bytes(s.fmt, cb, st, quad), flip));
        has_mins = byte_scales(s, sb, g, quad, &scale[c], &mins[c]);
      }
      for (int r = 0; r < n; ++r) {
        int32x4_t dot[2];
        row_dots8(w, x.q8 + (r0 + r) * xk + blk * 32, dot);
        const int64_t b = (r0 + r) * kb + blk;
        float* a = acc + 16 * r + 8 * h;
        for (int c = 0; c < 2; ++c)
          vst1q_f32(a + 4 * c, q8_epilogue(dot[c], fix * x.s32[b], x.d8[b], x.xs[b], scale[c], mins[c], has_mins,
                                           vld1q_f32(a + 4 * c)));
      }
    }
  });
}

#undef SPX_SDOT2

// ---------------------------------------------------------------- float weights
//
// F16 and BF16 (qlinear.h), 4 channels a register: the avx2 path's scheme (one row converts as it
// streams into its even and odd chains; more rows share a block converted once into L1). FMLA by
// element (vfmaq_lane_f32) takes the activation from a lane, fused as the reference's fma.

// The 16 channels of one input as float32 (exact): FCVTL, or BF16's bits shifted to the top.
template <int64_t FMT>
inline void float_w(const uint8_t* p, float32x4_t* w) {
  const uint16x8_t a = vld1q_u16(reinterpret_cast<const uint16_t*>(p)), b = vld1q_u16(reinterpret_cast<const uint16_t*>(p + 16));
  if constexpr (FMT == F16) {
    w[0] = vcvt_f32_f16(vreinterpret_f16_u16(vget_low_u16(a)));
    w[1] = vcvt_f32_f16(vreinterpret_f16_u16(vget_high_u16(a)));
    w[2] = vcvt_f32_f16(vreinterpret_f16_u16(vget_low_u16(b)));
    w[3] = vcvt_f32_f16(vreinterpret_f16_u16(vget_high_u16(b)));
  } else {
    w[0] = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(a), 16));
    w[1] = vreinterpretq_f32_u32(vshll_n_u16(vget_high_u16(a), 16));
    w[2] = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(b), 16));
    w[3] = vreinterpretq_f32_u32(vshll_n_u16(vget_high_u16(b), 16));
  }
}

template <int64_t FMT>
void one_float(const Segment& s, const uint8_t* p, const float* x, float* sum) {
  float32x4_t e[4], o[4];
  for (int c = 0; c < 4; ++c) e[c] = o[c] = vdupq_n_f32(0.f);
  for (int64_t i = 0; i < s.k; i += 2, p += 64) {
    const float32x2_t a = vld1_f32(x + i);
    float32x4_t w[4], v[4];
    float_w<FMT>(p, w);
    float_w<FMT>(p + 32, v);
    for (int c = 0; c < 4; ++c) {
      e[c] = vfmaq_lane_f32(e[c], w[c], a, 0);
      o[c] = vfmaq_lane_f32(o[c], v[c], a, 1);
    }
  }
  for (int c = 0; c < 4; ++c) vst1q_f32(sum + 4 * c, vaddq_f32(e[c], o[c]));
}

// R rows of one converted block (w: [len][16] floats): part[r] holds row r's even and odd chains.
template <int R>
inline void float_tile_rows(const float* w, int len, const float* x, int64_t xk, float (*part)[2][16]) {
  float32x4_t c[R][2][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 2; ++j)
      for (int q = 0; q < 4; ++q) c[r][j][q] = vld1q_f32(part[r][j] + 4 * q);
  for (int i = 0; i < len; i += 2) {
    float32x2_t a[R];
    for (int r = 0; r < R; ++r) a[r] = vld1_f32(x + r * xk + i);
    for (int q = 0; q < 4; ++q) {
      const float32x4_t we = vld1q_f32(w + 16 * i + 4 * q), wo = vld1q_f32(w + 16 * i + 16 + 4 * q);
      for (int r = 0; r < R; ++r) {
        c[r][0][q] = vfmaq_lane_f32(c[r][0][q], we, a[r], 0);
        c[r][1][q] = vfmaq_lane_f32(c[r][1][q], wo, a[r], 1);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 2; ++j)
      for (int q = 0; q < 4; ++q) vst1q_f32(part[r][j] + 4 * q, c[r][j][q]);
}

// float_sums' pieces (qlinear.h) for format FMT.
template <int64_t FMT>
struct FloatNeon {
  static void one(const Segment& s, const uint8_t* p, const float* x, float* sum) { one_float<FMT>(s, p, x, sum); }
  static void convert(const uint8_t* p, int len, float* w) {
    for (int i = 0; i < len; ++i, p += 32) {
      float32x4_t v[4];
      float_w<FMT>(p, v);
      for (int q = 0; q < 4; ++q) vst1q_f32(w + 16 * i + 4 * q, v[q]);
    }
  }
  static void tiles(const float* w, int len, const float* x, int64_t xk, float (*part)[2][16], int n) {
    int r = 0;
    for (; r + 3 <= n; r += 3) float_tile_rows<3>(w, len, x + r * xk, xk, part + r);
    for (; r < n; ++r) float_tile_rows<1>(w, len, x + r * xk, xk, part + r);
  }
};

// Rows [r0, r0 + n) of a panel's sums (16 floats a row) + bias (+ residual) into out.
inline void store_rows(const float* acc, int64_t r0, int n, const TileOut& out) {
  for (int c = 0; c < 4; ++c) {
    const float32x4_t b = out.bias ? vld1q_f32(out.bias + 4 * c) : vdupq_n_f32(0.f);
    for (int r = 0; r < n; ++r) {
      float32x4_t y = vaddq_f32(vld1q_f32(acc + 16 * r + 4 * c), b);
      if (out.residual) y = vaddq_f32(vld1q_f32(out.residual + (r0 + r) * out.ldo + 4 * c), y);
      vst1q_f32(out.y + (r0 + r) * out.ldo + 4 * c, y);
    }
  }
}

// A full panel of a float format times rows [r0, r0 + n), n <= kRowBlock, written to out.
void float_panel(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int n, const TileOut& out) {
  alignas(16) float sum[kRowBlock * 16];
  (s.fmt == BF16 ? float_sums<FloatNeon<BF16>> : float_sums<FloatNeon<F16>>)(s, p, x, r0, n, sum);
  store_rows(sum, r0, n, out);
}

const auto kTiles = count_table<kTile>([](auto R) { return &tile<R>; });  // kTiles[rows - 1]

}  // namespace

int tile_rows_neon() { return kTile; }

void tile_neon(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int rows, const TileOut& out) {
  if (float_format(s.fmt)) return float_panel(s, p, x, r0, rows, out);
  kTiles[rows - 1](s, p, x, r0, out);
}

// Up to 4 rows one tile decodes each group once with the accumulators in registers; from 5 rows
// tiles would decode every group again for each 4 rows, and the rows kernel decodes it once.
// (Chosen by counting, not timed: no aarch64 machine was at hand.)
int rows_from_neon() { return 5; }

// Full panels only, n <= kRowBlock rows; acc: kRowBlock * 16 floats.
void rows_neon(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int n, const TileOut& out, float* acc) {
  if (float_format(s.fmt)) return float_panel(s, p, x, r0, n, out);
  for (int i = 0; i < 4 * n; ++i) vst1q_f32(acc + 4 * i, vdupq_n_f32(0.f));
  switch (s.fmt) {
    case Q4K: rows_q4k(s, p, x, r0, n, acc); break;
    case Q6K:
    case Q3K:
    case Q2K:
    case IQ2XS:
    case IQ1M: rows_q6k(s, p, x, r0, n, acc); break;
    default: rows_q8(s, p, x, r0, n, acc); break;
  }
  store_rows(acc, r0, n, out);
}

void quantize_row_neon(const float* x, int64_t k, int8_t* q, float* d8, int32_t* s16, int32_t* s32, float* xs) {
  for (int64_t b = 0; b < k / kActBlock; ++b) {
    const float* xb = x + b * kActBlock;
    float32x4_t v[8];
    float32x4_t m = vdupq_n_f32(0.f);
    for (int i = 0; i < 8; ++i) {
      v[i] = vld1q_f32(xb + 4 * i);
      m = vmaxq_f32(m, vabsq_f32(v[i]));
    }
    const float d = vmaxvq_f32(m) / 127.f;
    const float id = d != 0.f ? 1.f / d : 0.f;
    int32x4_t c[8];
    for (int i = 0; i < 8; ++i) c[i] = vcvtnq_s32_f32(vmulq_n_f32(v[i], id));  // nearest, ties to even
    for (int h = 0; h < 2; ++h) {
      const int16x8_t lo = vcombine_s16(vqmovn_s32(c[4 * h]), vqmovn_s32(c[4 * h + 1]));
      const int16x8_t hi = vcombine_s16(vqmovn_s32(c[4 * h + 2]), vqmovn_s32(c[4 * h + 3]));
      vst1q_s8(q + b * kActBlock + 16 * h, vcombine_s8(vqmovn_s16(lo), vqmovn_s16(hi)));
      s16[2 * b + h] = vaddvq_s32(vaddq_s32(vaddq_s32(c[4 * h], c[4 * h + 1]), vaddq_s32(c[4 * h + 2], c[4 * h + 3])));
    }
    d8[b] = d;
    s32[b] = s16[2 * b] + s16[2 * b + 1];
    xs[b] = d * static_cast<float>(s32[b]);
  }
}

// pre_op_row_portable with the same arithmetic: RMSNorm's 16 partial sums in four registers.
void pre_op_row_neon(const float* x, int64_t k, const PreOp& op, float* out) {
  if (op.silu_mul) {
    const float32x4_t one = vdupq_n_f32(1.f);
    for (int64_t i = 0; i < k; i += 4) {
      const float32x4_t g = vld1q_f32(x + i);
      const float32x4_t e = exp_neon(vsubq_f32(vdupq_n_f32(0.f), g));
      vst1q_f32(out + i, vmulq_f32(vdivq_f32(g, vaddq_f32(one, e)), vld1q_f32(x + k + i)));
    }
    return;
  }
  float32x4_t sq[4] = {vdupq_n_f32(0.f), vdupq_n_f32(0.f), vdupq_n_f32(0.f), vdupq_n_f32(0.f)};
  for (int64_t i = 0; i < k; i += 16)
    for (int j = 0; j < 4; ++j) {
      const float32x4_t v = vld1q_f32(x + i + 4 * j);
      sq[j] = vfmaq_f32(sq[j], v, v);
    }
  float lanes[16];
  for (int j = 0; j < 4; ++j) vst1q_f32(lanes + 4 * j, sq[j]);
  float total = 0.f;
  for (float v : lanes) total += v;
  const float inv = 1.f / std::sqrt(total / static_cast<float>(k) + op.eps);
  for (int64_t i = 0; i < k; i += 4) vst1q_f32(out + i, vmulq_f32(vmulq_n_f32(vld1q_f32(x + i), inv), vld1q_f32(op.norm + i)));
}

}  // namespace spx

SPX_END

#endif  // __aarch64__
