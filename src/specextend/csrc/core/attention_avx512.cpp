// The avx512 path of the attention kernel: VDPBF16PS (32 bfloat16 multiply-adds an instruction),
// the arithmetic of attention_portable.cpp lane for lane. A block's keys are shared by every
// query row of the item; its values are interleaved by key pairs once for all of them.
#if defined(__x86_64__)

#include "x86.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "attention.h"
#include "cpu.h"
#include "target.h"

SPX_BEGIN_AVX512BF16
#include "simd_avx512.h"

namespace spx {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float hsum16_avx512(__m512 v) {
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}

// Lane sums of 16 vectors at once: lane j of the result is v[perm[j]]'s sum, each summed by the
// tree of the portable path (i+8, then i+4, i+2, i+1); `ReducePerm` undoes the lane order.
inline __m512 reduce16(const __m512* v) {
  __m512 w[8], u[4], y[2];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88), _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44), _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
}

// Which input vector's sum reduce16 leaves in each output lane, found once by reducing markers.
struct ReducePerm {
  int of_lane[16];
  ReducePerm() {
    __m512 v[16];
    for (int j = 0; j < 16; ++j) v[j] = _mm512_maskz_mov_ps(1, _mm512_set1_ps(static_cast<float>(j + 1)));
    alignas(64) float out[16];
    _mm512_store_ps(out, reduce16(v));
    for (int l = 0; l < 16; ++l) of_lane[l] = static_cast<int>(out[l]) - 1;
  }
};

// Values of one block interleaved by key pairs: vi[j][c] holds keys (2j, 2j+1) for 16 dims of
// chunk c, in unpacklo/unpackhi lane order (see `stored_dim`).
template <int DV>
void interleave_values(const uint16_t* vb, int n, int64_t d, __m512i (*vi)[DV]) {
  for (int j = 0; j < kBlock / 2; ++j) {
    for (int c = 0; c < DV / 2; ++c) {
      const __m512i a = 2 * j < n ? _mm512_loadu_si512(vb + (2 * j) * d + 32 * c) : _mm512_setzero_si512();
      const __m512i b = 2 * j + 1 < n ? _mm512_loadu_si512(vb + (2 * j + 1) * d + 32 * c) : _mm512_setzero_si512();
      vi[j][2 * c] = _mm512_unpacklo_epi16(a, b);
      vi[j][2 * c + 1] = _mm512_unpackhi_epi16(a, b);
    }
  }
}

// Scores of `nrows` query rows (bfloat16 in registers, lanes over dimensions) against 16 keys:
// three rows share each key's loads; each (row, key) is a VDPBF16PS chain per pair of chunks.
template <int DC>  // 32-dimension chunks per row
void scores16(const uint16_t* kb, int n, int64_t d, RowState* rows, int nrows, float* s, int ld,
              const ReducePerm& perm) {
  alignas(64) __m512 part[3][16];
  for (int r0 = 0; r0 < nrows; r0 += 3) {
    const int rn = std::min(3, nrows - r0);
    __m512i q[3][DC];
    for (int r = 0; r < rn; ++r)
      for (int c = 0; c < DC; ++c) q[r][c] = _mm512_loadu_si512(rows[r0 + r].q + 32 * c);
    for (int j = 0; j < 16; ++j) {
      __m512i k[DC];
      for (int c = 0; c < DC; ++c) k[c] = j < n ? _mm512_loadu_si512(kb + j * d + 32 * c) : _mm512_setzero_si512();
      for (int r = 0; r < rn; ++r) {
        __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)k[0], (__m512bh)q[r][0]);
        a = _mm512_dpbf16_ps(a, (__m512bh)k[1], (__m512bh)q[r][1]);
        if constexpr (DC > 2) {
          __m512 b = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)k[2], (__m512bh)q[r][2]);
          b = _mm512_dpbf16_ps(b, (__m512bh)k[3], (__m512bh)q[r][3]);
          a = _mm512_add_ps(a, b);
        }
        part[r][j] = a;
      }
    }
    for (int r = 0; r < rn; ++r) {
      alignas(64) float out[16];
      _mm512_store_ps(out, reduce16(part[r]));
      for (int l = 0; l < 16; ++l) s[(r0 + r) * ld + perm.of_lane[l]] = out[l];
    }
  }
}

template <int DC>
void block_dc(const uint16_t* kb, const __m512i (*vi)[2 * DC], int n, int64_t d, RowState* rows, int nrows,
              const ReducePerm& perm, float* sbuf) {
  constexpr int DV = 2 * DC;  // float32 accumulators of 16 dims
  scores16<DC>(kb, n, d, rows, nrows, sbuf, kBlock, perm);
  if (n > 16) scores16<DC>(kb + 16 * d, n - 16, d, rows, nrows, sbuf + 16, kBlock, perm);
  const __mmask16 k0 = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
  const __mmask16 k1 = n >= 32 ? 0xFFFF : (n > 16 ? static_cast<__mmask16>((1u << (n - 16)) - 1) : 0);
  for (int r = 0; r < nrows; ++r) {
    RowState& st = rows[r];
    __m512 s[2] = {_mm512_loadu_ps(sbuf + r * kBlock), n > 16 ? _mm512_loadu_ps(sbuf + r * kBlock + 16) : _mm512_setzero_ps()};
    s[0] = _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), k0, s[0]);
    s[1] = _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), k1, s[1]);
    const float bmax = _mm512_reduce_max_ps(_mm512_max_ps(s[0], s[1]));
    const float m_new = std::fmax(st.m, bmax);
    const float alpha = _mm_cvtss_f32(_mm512_castps512_ps128(exp_avx512(_mm512_set1_ps(st.m - m_new))));
    const __m512 mn = _mm512_set1_ps(m_new);
    const __m512 p0 = _mm512_maskz_mov_ps(k0, exp_avx512(_mm512_sub_ps(s[0], mn)));
    const __m512 p1 = _mm512_maskz_mov_ps(k1, exp_avx512(_mm512_sub_ps(s[1], mn)));
    st.l = std::fma(st.l, alpha, hsum16_avx512(_mm512_add_ps(p0, p1)));
    alignas(64) int32_t pp[16];  // bfloat16 weights of key pairs (2j, 2j+1)
    _mm512_store_si512(pp, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    __m512 a[DV];
    const __m512 al = _mm512_set1_ps(alpha);
    for (int c = 0; c < DV; ++c) a[c] = _mm512_mul_ps(_mm512_load_ps(st.acc + 16 * c), al);
    const int pairs = (n + 1) / 2;  // weights past n are zero: their products add nothing
#pragma GCC unroll 16
    for (int j = 0; j < pairs; ++j) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(pp[j]);
      for (int c = 0; c < DV; ++c) a[c] = _mm512_dpbf16_ps(a[c], (__m512bh)vi[j][c], w);
    }
    for (int c = 0; c < DV; ++c) _mm512_store_ps(st.acc + 16 * c, a[c]);
    st.m = m_new;
  }
}

void block(const uint16_t* kb, const uint16_t* vb, int n, int64_t d, RowState* rows, int nrows, float* ws) {
  static const ReducePerm perm;
  alignas(64) __m512i vi[kBlock / 2][8];
  if (d == 128) {
    interleave_values<8>(vb, n, d, vi);
    block_dc<4>(kb, vi, n, d, rows, nrows, perm, ws);
  } else {
    auto v4 = reinterpret_cast<__m512i(*)[4]>(vi);
    interleave_values<4>(vb, n, d, v4);
    block_dc<2>(kb, v4, n, d, rows, nrows, perm, ws);
  }
}

// Accumulator c = 2*chunk + half holds, in lane l, dim 32*chunk + 8*(l/4) + 4*half + l%4 (the
// unpacklo/unpackhi order of 16-bit pairs).
inline int64_t stored_dim(int64_t c, int l) { return 32 * (c / 2) + 8 * (l / 4) + 4 * (c % 2) + l % 4; }

void finish(const RowState& st, int64_t d, float* out) {
  const float inv = 1.f / st.l;
  for (int64_t c = 0; c < d / 16; ++c)
    for (int l = 0; l < 16; ++l) out[stored_dim(c, l)] = st.acc[16 * c + l] * inv;
}

size_t workspace(int64_t, int nrows) { return static_cast<size_t>(nrows) * kBlock; }

}  // namespace

bool block_kernel_avx512(int64_t d, BlockKernel* out) {
  if (!cpu_has_avx512_bf16() || (d != 64 && d != 128)) return false;
  *out = {block, finish, workspace};
  return true;
}

}  // namespace spx

SPX_END

#endif  // __x86_64__
