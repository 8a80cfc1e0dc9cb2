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

// 32 dims of bfloat16 as float32 planes [x4][odd 4 | even 4]: lane x of quad x4 holds dims
// 8*x4 + 2x (even) and + 1 (odd) of the chunk.
inline void chunk_planes(const uint16_t* src, float* dst) {
  const uint32x4_t hi = vdupq_n_u32(0xFFFF0000u);
  for (int x4 = 0; x4 < 4; ++x4) {
    const uint32x4_t u = vld1q_u32(reinterpret_cast<const uint32_t*>(src + 8 * x4));
    vst1q_f32(dst + 8 * x4, vreinterpretq_f32_u32(vandq_u32(u, hi)));
    vst1q_f32(dst + 8 * x4 + 4, vreinterpretq_f32_u32(vshlq_n_u32(u, 16)));
  }
}

// One key's 16 lanes (two chains, added), then the tree's first two levels: b[i], i < 4.
inline float32x4_t key_b(const float* kp, const float* qf, int dc) {
  float32x4_t a[4], b[4];
  for (int x4 = 0; x4 < 4; ++x4) a[x4] = b[x4] = vdupq_n_f32(0.f);
  for (int c = 0; c < dc; ++c)
    for (int x4 = 0; x4 < 4; ++x4) {
      float32x4_t& acc = c < 2 ? a[x4] : b[x4];
      const float* k = kp + 32 * c + 8 * x4;
      const float* q = qf + 32 * c + 8 * x4;
      acc = vfmaq_f32(acc, vld1q_f32(k), vld1q_f32(q));          // odd
      acc = vfmaq_f32(acc, vld1q_f32(k + 4), vld1q_f32(q + 4));  // even
    }
  float32x4_t lanes[4];
  for (int x4 = 0; x4 < 4; ++x4) lanes[x4] = dc > 2 ? vaddq_f32(a[x4], b[x4]) : a[x4];
  // a[i] = lane i + lane i+8 (quads 0,2 and 1,3), then b[i] = a[i] + a[i+4]
  return vaddq_f32(vaddq_f32(lanes[0], lanes[2]), vaddq_f32(lanes[1], lanes[3]));
}

// The tree's last levels for 4 keys: lane t of the result is (b_t[0] + b_t[2]) + (b_t[1] + b_t[3]).
inline float32x4_t reduce4(const float32x4_t* b) {
  const float32x4_t t0 = vtrn1q_f32(b[0], b[1]), t1 = vtrn2q_f32(b[0], b[1]);
  const float32x4_t t2 = vtrn1q_f32(b[2], b[3]), t3 = vtrn2q_f32(b[2], b[3]);
  auto zip1 = [](float32x4_t x, float32x4_t y) {
    return vreinterpretq_f32_f64(vzip1q_f64(vreinterpretq_f64_f32(x), vreinterpretq_f64_f32(y)));
  };
  auto zip2 = [](float32x4_t x, float32x4_t y) {
    return vreinterpretq_f32_f64(vzip2q_f64(vreinterpretq_f64_f32(x), vreinterpretq_f64_f32(y)));
  };
  const float32x4_t e0 = zip1(t0, t2), e2 = zip2(t0, t2);  // element 0 and element 2 of each key
  const float32x4_t e1 = zip1(t1, t3), e3 = zip2(t1, t3);
  return vaddq_f32(vaddq_f32(e0, e2), vaddq_f32(e1, e3));
}

inline float32x4_t round_bf16(float32x4_t p) {
  const uint32x4_t u = vreinterpretq_u32_f32(p);
  const uint32x4_t odd = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
  const uint32x4_t r = vaddq_u32(u, vaddq_u32(vdupq_n_u32(0x7FFF), odd));
  return vreinterpretq_f32_u32(vandq_u32(r, vdupq_n_u32(0xFFFF0000u)));
}

// Keys as planes and values as float32 rows, zero-padded to whole key groups.
void convert_block(const uint16_t* kb, const uint16_t* vb, int n, int64_t d, float* kf, float* vf) {
  const int dc = static_cast<int>(d / 32);
  const int keys4 = (n + 3) / 4 * 4, pairs = (n + 1) / 2;
  for (int j = 0; j < keys4; ++j)
    for (int c = 0; c < dc; ++c) {
      if (j < n) chunk_planes(kb + j * d + 32 * c, kf + j * d + 32 * c);
      else std::fill(kf + j * d + 32 * c, kf + j * d + 32 * c + 32, 0.f);
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

// One query's scores against the block's keys (-inf past n).
void block_scores(const float* kf, const float* qf, int n, int64_t d, float* s) {
  const int dc = static_cast<int>(d / 32);
  for (int j0 = 0; j0 < kBlock; j0 += 4) {
    if (j0 >= n) {
      for (int t = 0; t < 4; ++t) s[j0 + t] = kNegInf;
      continue;
    }
    float32x4_t b[4];
    for (int t = 0; t < 4; ++t) b[t] = key_b(kf + (j0 + t) * d, qf, dc);
    vst1q_f32(s + j0, reduce4(b));
    for (int t = 0; t < 4; ++t)
      if (j0 + t >= n) s[j0 + t] = kNegInf;
  }
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

void block(const uint16_t* kb, const uint16_t* vb, int n, int64_t d, RowState* rows, int nrows, float* ws) {
  const int dc = static_cast<int>(d / 32);
  float* kf = ws;               // [kBlock][d] key planes
  float* vf = kf + kBlock * d;  // [kBlock][d] values, natural order
  float* qf = vf + kBlock * d;  // [d] one query's planes
  convert_block(kb, vb, n, d, kf, vf);
  for (int r = 0; r < nrows; ++r) {
    RowState& st = rows[r];
    for (int c = 0; c < dc; ++c) chunk_planes(st.q + 32 * c, qf + 32 * c);
    alignas(16) float s[kBlock];
    block_scores(kf, qf, n, d, s);
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

size_t workspace(int64_t d, int) { return static_cast<size_t>(2 * kBlock + 1) * d; }

}  // namespace

bool block_kernel_neon(int64_t d, BlockKernel* out) {
  if (!cpu_supports(Path::NEON) || d % 32 != 0 || d > 256) return false;
  *out = {block, finish, workspace};
  return true;
}

}  // namespace spx

SPX_END

#endif  // __aarch64__
