// The neon path of the attention kernel: the arithmetic of attention_portable.cpp with 4-lane
// float32 FMAs (vfmaq_f32). As on AVX2, a bfloat16 pair read as one 32-bit word gives its odd
// element by masking and its even element by shifting; the 16 lanes of a VDPBF16PS chain are
// four registers. A block's keys and values are converted once for every query row of the item.
#if defined(__aarch64__)

#include <arm_neon.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "attention.h"
#include "target.h"

SPX_BEGIN_NEON
#include "simd_neon.h"

namespace spx {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// 4 x 4 transpose of 32-bit words: r[i] <- word i of every r[j].
inline void transpose4(uint32x4_t* r) {
  const uint32x4_t t0 = vtrn1q_u32(r[0], r[1]), t1 = vtrn2q_u32(r[0], r[1]);
  const uint32x4_t t2 = vtrn1q_u32(r[2], r[3]), t3 = vtrn2q_u32(r[2], r[3]);
  auto zip1 = [](uint32x4_t x, uint32x4_t y) {
    return vreinterpretq_u32_u64(vzip1q_u64(vreinterpretq_u64_u32(x), vreinterpretq_u64_u32(y)));
  };
  auto zip2 = [](uint32x4_t x, uint32x4_t y) {
    return vreinterpretq_u32_u64(vzip2q_u64(vreinterpretq_u64_u32(x), vreinterpretq_u64_u32(y)));
  };
  r[0] = zip1(t0, t2);
  r[1] = zip1(t1, t3);
  r[2] = zip2(t0, t2);
  r[3] = zip2(t1, t3);
}

inline float32x4_t round_bf16(float32x4_t p) {
  const uint32x4_t u = vreinterpretq_u32_f32(p);
  const uint32x4_t odd = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
  const uint32x4_t r = vaddq_u32(u, vaddq_u32(vdupq_n_u32(0x7FFF), odd));
  return vreinterpretq_f32_u32(vandq_u32(r, vdupq_n_u32(0xFFFF0000u)));
}

// Keys as float32 planes across key lanes (kf[p][0][j]: the odd element, dim 2p + 1, of key j;
// kf[p][1][j]: the even one; zero past n) and values as float32 rows, zero-padded to key pairs.
void convert_block(const uint16_t* kb, const uint16_t* vb, int n, int64_t d, float* kf, float* vf) {
  const int pairs = (n + 1) / 2;
  const uint32x4_t hi = vdupq_n_u32(0xFFFF0000u);
  for (int j4 = 0; j4 < kBlock; j4 += 4)
    for (int64_t p0 = 0; p0 < d / 2; p0 += 4) {
      uint32x4_t r[4];
      for (int j = 0; j < 4; ++j)
        r[j] = j4 + j < n ? vld1q_u32(reinterpret_cast<const uint32_t*>(kb + (j4 + j) * d + 2 * p0)) : vdupq_n_u32(0);
      transpose4(r);
      for (int i = 0; i < 4; ++i) {
        float* dst = kf + (p0 + i) * 2 * kBlock + j4;
        vst1q_f32(dst, vreinterpretq_f32_u32(vandq_u32(r[i], hi)));
        vst1q_f32(dst + kBlock, vreinterpretq_f32_u32(vshlq_n_u32(r[i], 16)));
      }
    }
  for (int j = 0; j < 2 * pairs; ++j) {
    for (int64_t i = 0; i < d; i += 8) {
      if (j < n) {
        const uint16x8_t u = vld1q_u16(vb + j * d + i);
        vst1q_f32(vf + j * d + i, vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(u), 16)));
        vst1q_f32(vf + j * d + i + 4, vreinterpretq_f32_u32(vshll_high_n_u16(u, 16)));
      } else {
        std::fill(vf + j * d + i, vf + j * d + i + 8, 0.f);
      }
    }
  }
}

// One query's scores against the block's 32 keys: eight 4-key chains over the pairs in order,
// odd product then even (attention_portable.cpp's score chain); -inf past n.
void block_scores(const float* kf, const float* qf, int n, int64_t d, float* s) {
  float32x4_t acc[8];
  for (int c = 0; c < 8; ++c) acc[c] = vdupq_n_f32(0.f);
  for (int64_t p = 0; p < d / 2; ++p) {
    const float* k = kf + p * 2 * kBlock;
    const float qo = qf[2 * p + 1], qe = qf[2 * p];
    for (int c = 0; c < 8; ++c) acc[c] = vfmaq_n_f32(vfmaq_n_f32(acc[c], vld1q_f32(k + 4 * c), qo), vld1q_f32(k + kBlock + 4 * c), qe);
  }
  for (int c = 0; c < 8; ++c) vst1q_f32(s + 4 * c, acc[c]);
  for (int j = n; j < kBlock; ++j) s[j] = kNegInf;
}

// The block's softmax weights against the new maximum, rounded to bfloat16 into pw; returns the
// sum of the unrounded weights in the reference's tree order.
float block_weights(const float* s, int n, float m_new, float* pw) {
  float32x4_t p[8];
  for (int q4 = 0; q4 < 8; ++q4) {
    const float32x4_t e = exp_neon(vsubq_f32(vld1q_f32(s + 4 * q4), vdupq_n_f32(m_new)));
    const uint32x4_t idx = {static_cast<uint32_t>(4 * q4), static_cast<uint32_t>(4 * q4 + 1),
                            static_cast<uint32_t>(4 * q4 + 2), static_cast<uint32_t>(4 * q4 + 3)};
    p[q4] = vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(e), vcltq_u32(idx, vdupq_n_u32(n))));
    vst1q_f32(pw + 4 * q4, round_bf16(p[q4]));
  }
  // psum[i] = p[i] + p[i+16]; then the 16-lane tree i+8, i+4, i+2, i+1
  float32x4_t ps[4];
  for (int i = 0; i < 4; ++i) ps[i] = vaddq_f32(p[i], p[i + 4]);
  const float32x4_t bsum = vaddq_f32(vaddq_f32(ps[0], ps[2]), vaddq_f32(ps[1], ps[3]));
  return (vgetq_lane_f32(bsum, 0) + vgetq_lane_f32(bsum, 2)) + (vgetq_lane_f32(bsum, 1) + vgetq_lane_f32(bsum, 3));
}

// acc = acc * alpha + the weighted values, 64 dimensions at a time, key pairs odd then even.
void accumulate_values(const float* vf, const float* pw, int n, int64_t d, float alpha, float* acc) {
  const int pairs = (n + 1) / 2;
  for (int64_t base = 0; base < d; base += 64) {
    const int nc = static_cast<int>(std::min<int64_t>(16, (d - base) / 4));
    float32x4_t a[16];
    for (int c = 0; c < nc; ++c) a[c] = vmulq_n_f32(vld1q_f32(acc + base + 4 * c), alpha);
    for (int j = 0; j < pairs; ++j) {
      const float w1 = pw[2 * j + 1], w0 = pw[2 * j];
      const float* v1 = vf + (2 * j + 1) * d + base;
      const float* v0 = vf + (2 * j) * d + base;
      for (int c = 0; c < nc; ++c) {
        a[c] = vfmaq_n_f32(a[c], vld1q_f32(v1 + 4 * c), w1);
        a[c] = vfmaq_n_f32(a[c], vld1q_f32(v0 + 4 * c), w0);
      }
    }
    for (int c = 0; c < nc; ++c) vst1q_f32(acc + base + 4 * c, a[c]);
  }
}

void block(const uint16_t* kb, const uint16_t* vb, int n, int64_t d, RowState* rows, int nrows, float* ws,
           const Ahead&) {
  float* kf = ws;               // [d / 2][2][kBlock] key planes
  float* vf = kf + kBlock * d;  // [kBlock][d] values, natural order
  convert_block(kb, vb, n, d, kf, vf);
  for (int r = 0; r < nrows; ++r) {
    RowState& st = rows[r];
    alignas(16) float s[kBlock];
    block_scores(kf, st.qf, n, d, s);
    if (st.cap > 0.f) {  // lanes past n are -inf again after
      const float inv = softcap_inverse(st.cap);
      for (int c = 0; c < 8; ++c) vst1q_f32(s + 4 * c, softcap_neon(vld1q_f32(s + 4 * c), st.cap, inv));
      for (int j = n; j < kBlock; ++j) s[j] = kNegInf;
    }
    float bmax = kNegInf;
    for (int j = 0; j < n; ++j) bmax = std::fmax(bmax, s[j]);
    const float m_new = std::fmax(st.m, bmax);
    const float alpha = vgetq_lane_f32(exp_neon(vdupq_n_f32(st.m - m_new)), 0);
    alignas(16) float pw[kBlock];
    st.l = std::fma(st.l, alpha, block_weights(s, n, m_new, pw));
    accumulate_values(vf, pw, n, d, alpha, st.acc);
    st.m = m_new;
  }
}

void finish(const RowState& st, int64_t d, float* out) {
  const float inv = 1.f / st.l;
  for (int64_t x = 0; x < d; ++x) out[x] = st.acc[x] * inv;
}

size_t workspace(int64_t d, int) { return static_cast<size_t>(2 * kBlock) * d; }

}  // namespace

bool block_kernel_neon(int64_t d, BlockKernel* out) {
  if (!cpu_supports(Path::NEON) || d % 32 != 0 || d > 256) return false;
  *out = {block, finish, workspace};
  return true;
}

}  // namespace spx

SPX_END

#endif  // __aarch64__
