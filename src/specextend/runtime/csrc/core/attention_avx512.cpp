// The avx512 path of the attention kernel: VDPBF16PS (32 bfloat16 multiply-adds an instruction),
// the arithmetic of attention_portable.cpp lane for lane. A block's keys are shared by every
// query row of the item; its values are interleaved by key pairs once for all of them.
#if defined(__x86_64__)

#include "x86.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "attention.h"
#include "cpu.h"
#include "kv_q8.h"
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

// r[i] <- dword i of every r[j] (a 16 x 16 transpose of 32-bit words).
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // r[4b + w] now holds, in 128-bit lane L, word w of rows 4L..4L+3 for rows 4b..4b+3's quartet.
  for (int i = 0; i < 8; ++i) {
    const int a = (i / 4) * 8 + i % 4;  // pairs (0,4) (1,5) (2,6) (3,7) (8,12) ...
    t[a] = _mm512_shuffle_i32x4(r[a], r[a + 4], 0x88);
    t[a + 4] = _mm512_shuffle_i32x4(r[a], r[a + 4], 0xDD);
  }
  for (int i = 0; i < 8; ++i) {
    const int a = i;  // pairs (0,8) (1,9) ... (7,15)
    const __m512i lo = _mm512_shuffle_i32x4(t[a], t[a + 8], 0x88), hi = _mm512_shuffle_i32x4(t[a], t[a + 8], 0xDD);
    r[a] = lo;
    r[a + 8] = hi;
  }
}

// The block's keys as dimension pairs across key lanes: kt[2p + h] holds pair p (dims 2p, 2p+1)
// of keys 16h..16h+15, zero past n. Shared by every query row of the item.
template <int DP>
void transpose_keys(const uint16_t* kb, int n, int64_t d, __m512i* kt) {
  for (int h = 0; h < 2; ++h)
    for (int c = 0; c < DP / 16; ++c) {
      __m512i r[16];
      for (int j = 0; j < 16; ++j) {
        const int key = 16 * h + j;
        r[j] = key < n ? _mm512_loadu_si512(kb + key * d + 32 * c) : _mm512_setzero_si512();
      }
      transpose16(r);
      for (int i = 0; i < 16; ++i) kt[2 * (16 * c + i) + h] = r[i];
    }
}

// Scores of R rows against the block's 32 keys: per row, two chains (keys 0-15, 16-31) over the
// pairs in order, one VDPBF16PS per pair and half (attention_portable.cpp's score chain).
template <int DP, int R>
inline void score_rows(const __m512i* kt, const RowState* rows, float* s) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
#pragma GCC unroll 2
  for (int p = 0; p < DP; ++p) {
    const __m512bh k0 = (__m512bh)_mm512_load_si512(kt + 2 * p), k1 = (__m512bh)_mm512_load_si512(kt + 2 * p + 1);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, rows[r].q + 2 * p, 4);
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(pair);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], k0, qb);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], k1, qb);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(s + r * kBlock, acc[r][0]);
    _mm512_storeu_ps(s + r * kBlock + 16, acc[r][1]);
  }
}

template <int DP>
void block_scores(const __m512i* kt, const RowState* rows, int nrows, float* s) {
  constexpr int kRows = 6;  // 12 chains in flight: enough to cover VDPBF16PS latency
  int r = 0;
  for (; r + kRows <= nrows; r += kRows) score_rows<DP, kRows>(kt, rows + r, s + r * kBlock);
  switch (nrows - r) {
    case 5: score_rows<DP, 5>(kt, rows + r, s + r * kBlock); break;
    case 4: score_rows<DP, 4>(kt, rows + r, s + r * kBlock); break;
    case 3: score_rows<DP, 3>(kt, rows + r, s + r * kBlock); break;
    case 2: score_rows<DP, 2>(kt, rows + r, s + r * kBlock); break;
    case 1: score_rows<DP, 1>(kt, rows + r, s + r * kBlock); break;
    default: break;
  }
}

template <int DC>
void block_dc(const uint16_t* kb, const __m512i (*vi)[2 * DC], int n, int64_t d, RowState* rows, int nrows,
              float* sbuf) {
  constexpr int DV = 2 * DC;  // float32 accumulators of 16 dims
  alignas(64) __m512i kt[DC * 16 * 2];
  transpose_keys<DC * 16>(kb, n, d, kt);
  block_scores<DC * 16>(kt, rows, nrows, sbuf);
  const __mmask16 k0 = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
  const __mmask16 k1 = n >= 32 ? 0xFFFF : (n > 16 ? static_cast<__mmask16>((1u << (n - 16)) - 1) : 0);
  // Softmax weights of every row first (bfloat16 pairs in pw), then the values two rows at a
  // time, so each interleaved value register loaded serves both.
  alignas(64) int32_t pw[2][16];
  float alpha[2];
  const int pairs = (n + 1) / 2;  // weights past n are zero: their products add nothing
  for (int r0 = 0; r0 < nrows; r0 += 2) {
    const int rn = std::min(2, nrows - r0);
    for (int i = 0; i < rn; ++i) {
      RowState& st = rows[r0 + i];
      const float* sr = sbuf + (r0 + i) * kBlock;
      __m512 s[2] = {_mm512_loadu_ps(sr), n > 16 ? _mm512_loadu_ps(sr + 16) : _mm512_setzero_ps()};
      s[0] = _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), k0, s[0]);
      s[1] = _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), k1, s[1]);
      const float bmax = _mm512_reduce_max_ps(_mm512_max_ps(s[0], s[1]));
      const float m_new = std::fmax(st.m, bmax);
      alpha[i] = _mm_cvtss_f32(_mm512_castps512_ps128(exp_avx512(_mm512_set1_ps(st.m - m_new))));
      const __m512 mn = _mm512_set1_ps(m_new);
      const __m512 p0 = _mm512_maskz_mov_ps(k0, exp_avx512(_mm512_sub_ps(s[0], mn)));
      const __m512 p1 = _mm512_maskz_mov_ps(k1, exp_avx512(_mm512_sub_ps(s[1], mn)));
      st.l = std::fma(st.l, alpha[i], hsum16_avx512(_mm512_add_ps(p0, p1)));
      _mm512_store_si512(pw[i], (__m512i)_mm512_cvtne2ps_pbh(p1, p0));  // pairs (2j, 2j+1)
      st.m = m_new;
    }
    if (rn == 2) {
      float* acc0 = rows[r0].acc;
      float* acc1 = rows[r0 + 1].acc;
      __m512 a[DV], b[DV];
      const __m512 al0 = _mm512_set1_ps(alpha[0]), al1 = _mm512_set1_ps(alpha[1]);
      for (int c = 0; c < DV; ++c) {
        a[c] = _mm512_mul_ps(_mm512_load_ps(acc0 + 16 * c), al0);
        b[c] = _mm512_mul_ps(_mm512_load_ps(acc1 + 16 * c), al1);
      }
#pragma GCC unroll 4
      for (int j = 0; j < pairs; ++j) {
        const __m512bh w0 = (__m512bh)_mm512_set1_epi32(pw[0][j]), w1 = (__m512bh)_mm512_set1_epi32(pw[1][j]);
        for (int c = 0; c < DV; ++c) {
          const __m512bh v = (__m512bh)vi[j][c];
          a[c] = _mm512_dpbf16_ps(a[c], v, w0);
          b[c] = _mm512_dpbf16_ps(b[c], v, w1);
        }
      }
      for (int c = 0; c < DV; ++c) {
        _mm512_store_ps(acc0 + 16 * c, a[c]);
        _mm512_store_ps(acc1 + 16 * c, b[c]);
      }
    } else {
      float* acc0 = rows[r0].acc;
      __m512 a[DV];
      const __m512 al0 = _mm512_set1_ps(alpha[0]);
      for (int c = 0; c < DV; ++c) a[c] = _mm512_mul_ps(_mm512_load_ps(acc0 + 16 * c), al0);
#pragma GCC unroll 4
      for (int j = 0; j < pairs; ++j) {
        const __m512bh w0 = (__m512bh)_mm512_set1_epi32(pw[0][j]);
        for (int c = 0; c < DV; ++c) a[c] = _mm512_dpbf16_ps(a[c], (__m512bh)vi[j][c], w0);
      }
      for (int c = 0; c < DV; ++c) _mm512_store_ps(acc0 + 16 * c, a[c]);
    }
  }
}

void block(const uint16_t* kb, const uint16_t* vb, int n, int64_t d, RowState* rows, int nrows, float* ws) {
  alignas(64) __m512i vi[kBlock / 2][8];
  if (d == 128) {
    interleave_values<8>(vb, n, d, vi);
    block_dc<4>(kb, vi, n, d, rows, nrows, ws);
  } else {
    auto v4 = reinterpret_cast<__m512i(*)[4]>(vi);
    interleave_values<4>(vb, n, d, v4);
    block_dc<2>(kb, v4, n, d, rows, nrows, ws);
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

// q8 rows into bfloat16 (kv_q8.h): q * scale is exact in float32 and never subnormal, so
// VCVTNE2PS2BF16's rounding is float_to_bf16's.
void dequant(const uint16_t* rows, int n, int64_t d, uint16_t* out) {
  for_each_q8_group(rows, n, d, out, [](const int8_t* q, float scale, uint16_t* o) {
    const __m512 sf = _mm512_set1_ps(scale);
    const __m128i* src = reinterpret_cast<const __m128i*>(q);
    const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(src))), sf);
    const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(src + 1))), sf);
    _mm512_storeu_si512(o, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  });
}

}  // namespace

bool block_kernel_avx512(int64_t d, BlockKernel* out) {
  if (!cpu_has_avx512_bf16() || (d != 64 && d != 128)) return false;
  *out = {block, finish, workspace, dequant};
  return true;
}

}  // namespace spx

SPX_END

#endif  // __x86_64__
