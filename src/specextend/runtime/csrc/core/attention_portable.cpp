// The portable path of the attention kernel: the reference arithmetic in scalar code
// (attention.h), modelled on the lanes of VDPBF16PS so that vector paths can reproduce it.
#include <cmath>
#include <limits>

#include "attention.h"
#include "fastexp.h"
#include "half.h"

// GCC 12's vectorizer reorders the two products of a score pair (it adds them in element
// order, even before odd) when it turns the chain below into vector code at -O2/-O3, which
// changes the reference's bits; the reference is plain scalar code, so it stays scalar.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-tree-vectorize")
#endif

namespace spx {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The horizontal sum of 16 lanes in a fixed tree: i+8, i+4, i+2, i+1.
inline float hsum16_portable(const float* p) {
  float a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) a[i] = p[i] + p[i + 8];
  for (int i = 0; i < 4; ++i) b[i] = a[i] + a[i + 4];
  for (int i = 0; i < 2; ++i) c[i] = b[i] + b[i + 2];
  return c[0] + c[1];
}

// One VDPBF16PS lane: acc + a1*b1, then + a0*b0 (products of bfloat16 are exact in float32).
inline float dot2(float acc, uint16_t a0, uint16_t a1, uint16_t b0, uint16_t b1) {
  acc = acc + bf16_to_float(a1) * bf16_to_float(b1);
  return acc + bf16_to_float(a0) * bf16_to_float(b0);
}

// q.k as one chain over the dimension pairs in order, each pair as a VDPBF16PS lane takes it
// (odd product, then even): a key's score is one lane of a register whose lanes are the block's
// keys, so many-row tiles compute it as a matrix product with no horizontal sums.
inline float score_portable(const uint16_t* k, const uint16_t* q, int64_t d) {
  float acc = 0.f;
  for (int64_t i = 0; i < d; i += 2) acc = dot2(acc, k[i], k[i + 1], q[i], q[i + 1]);
  return acc;
}

void block_portable(const uint16_t* kb, const uint16_t* vb, int n, int64_t d, RowState* rows, int nrows, float*,
                    const Ahead&) {
  float s[kBlock], p[kBlock];
  uint16_t pb[kBlock];
  for (int r = 0; r < nrows; ++r) {
    RowState& st = rows[r];
    const float inv = st.cap > 0.f ? softcap_inverse(st.cap) : 0.f;
    float bmax = kNegInf;
    for (int j = 0; j < kBlock; ++j) {
      if (j >= n) {
        s[j] = kNegInf;
        continue;
      }
      s[j] = score_portable(kb + j * d, st.q, d);
      if (st.cap > 0.f) s[j] = softcap_portable(s[j], st.cap, inv);
      bmax = std::fmax(bmax, s[j]);
    }
    const float m_new = std::fmax(st.m, bmax);
    const float alpha = exp_portable(st.m - m_new);
    float psum[16];
    for (int i = 0; i < 16; ++i) psum[i] = 0.f;
    for (int j = 0; j < kBlock; ++j) {
      p[j] = j < n ? exp_portable(s[j] - m_new) : 0.f;
      psum[j % 16] += p[j];
      pb[j] = float_to_bf16(p[j]);
    }
    st.l = std::fma(st.l, alpha, hsum16_portable(psum));
    for (int64_t i = 0; i < d; ++i) {
      float a = st.acc[i] * alpha;
      for (int j = 0; j < kBlock / 2; ++j) {
        const uint16_t v0 = 2 * j < n ? vb[(2 * j) * d + i] : 0, v1 = 2 * j + 1 < n ? vb[(2 * j + 1) * d + i] : 0;
        a = dot2(a, v0, v1, pb[2 * j], pb[2 * j + 1]);
      }
      st.acc[i] = a;
    }
    st.m = m_new;
  }
}

void finish_portable(const RowState& st, int64_t d, float* out) {
  const float inv = 1.f / st.l;
  for (int64_t x = 0; x < d; ++x) out[x] = st.acc[x] * inv;
}

size_t no_workspace(int64_t, int) { return 0; }

}  // namespace

BlockKernel block_kernel_portable() { return {block_portable, finish_portable, no_workspace}; }

}  // namespace spx
