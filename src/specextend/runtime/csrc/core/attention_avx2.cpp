// The avx2 path of the attention kernel (also the avx512 path's on CPUs without AVX512-BF16):
// the arithmetic of attention_portable.cpp with 8-lane float32 FMAs. A bfloat16 pair read as
// one 32-bit word gives its odd element by masking the low half and its even element by
// shifting it out, so the 16 lanes of a VDPBF16PS chain are two registers of odd products
// added before two of even ones; products of bfloat16 values are exact, so an FMA adds each
// with the one rounding the reference has. A block's keys and values are converted to float32
// once and shared by every query row of the item.
#if defined(__x86_64__)

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "attention.h"
#include "kv_q8.h"
#include "target.h"

SPX_BEGIN_AVX2
#include "simd_avx2.h"
#include "tiles.h"

namespace spx {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline __m256i load16(const uint16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// 8 x 8 transpose of 32-bit words: r[i] <- word i of every r[j].
inline void transpose8(__m256i* r) {
  __m256i t[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  __m256i u[8];
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int w = 0; w < 4; ++w) {
    r[w] = _mm256_permute2x128_si256(u[w], u[w + 4], 0x20);
    r[w + 4] = _mm256_permute2x128_si256(u[w], u[w + 4], 0x31);
  }
}

// Half-blocks of 16 keys and halves of 64 value dims keep the float32 copies a block is
// converted into (shared by every row of the item) at 8 KB, inside L1 beside the rows' state.
constexpr int kKeyHalf = 16, kDimHalf = 64;

// Keys [16h, 16h + 16) of the block as float32 planes across key lanes: kf[p][0][j] is the odd
// element (dim 2p + 1) of pair p of key j, kf[p][1][j] the even one; zero past n.
void key_planes(const uint16_t* kb, int n, int64_t d, int h, float* kf) {
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int j8 = 0; j8 < kKeyHalf; j8 += 8)
    for (int64_t p0 = 0; p0 < d / 2; p0 += 8) {
      __m256i r[8];
      for (int j = 0; j < 8; ++j) {
        const int key = kKeyHalf * h + j8 + j;
        r[j] = key < n ? load16(kb + key * d + 2 * p0) : _mm256_setzero_si256();
      }
      transpose8(r);
      for (int i = 0; i < 8; ++i) {
        float* dst = kf + (p0 + i) * 2 * kKeyHalf + j8;
        _mm256_store_ps(dst, _mm256_castsi256_ps(_mm256_and_si256(r[i], hi)));
        _mm256_store_ps(dst + kKeyHalf, _mm256_castsi256_ps(_mm256_slli_epi32(r[i], 16)));
      }
    }
}

// Scores of R rows against the half-block's 16 keys: per row two chains (keys 0-7, 8-15) over
// the pairs in order, odd product then even (attention_portable.cpp's score chain).
template <int R>
inline void score_rows(const float* kf, int64_t pairs, const RowState* rows, float* s, const Ahead& ahead) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  Trickle next_keys(ahead.k, ahead.bytes, pairs);
  for (int64_t p = 0; p < pairs; ++p) {
    next_keys.step();
    const float* k = kf + p * 2 * kKeyHalf;
    const __m256 o0 = _mm256_load_ps(k), o1 = _mm256_load_ps(k + 8);
    const __m256 e0 = _mm256_load_ps(k + 16), e1 = _mm256_load_ps(k + 24);
    for (int r = 0; r < R; ++r) {
      const __m256 qo = _mm256_broadcast_ss(rows[r].qf + 2 * p + 1), qe = _mm256_broadcast_ss(rows[r].qf + 2 * p);
      acc[r][0] = _mm256_fmadd_ps(e0, qe, _mm256_fmadd_ps(o0, qo, acc[r][0]));
      acc[r][1] = _mm256_fmadd_ps(e1, qe, _mm256_fmadd_ps(o1, qo, acc[r][1]));
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(s + r * kBlock, acc[r][0]);
    _mm256_storeu_ps(s + r * kBlock + 8, acc[r][1]);
  }
}

// Scores of every row against keys [16h, 16h + 16) of the block into s[row][32]; the block ahead comes
// in during the first tile of rows.
void scores_half(const uint16_t* kb, int n, int64_t d, int h, RowState* rows, int nrows, float* kf, float* s,
                 const Ahead& ahead) {
  key_planes(kb, n, d, h, kf);
  float* sh = s + kKeyHalf * h;
  row_tiles<4>(nrows, [&](auto R, int r) {  // 8 chains in flight
    score_rows<R>(kf, d / 2, rows + r, sh + r * kBlock, r == 0 ? ahead : Ahead{});
  });
}

// A value row as float32 in the order VPUNPCK{L,H}WD leaves it: per 16 dims, [0-3, 8-11] then
// [4-7, 12-15] (`finish` puts them back).
inline void value_row(const uint16_t* src, int64_t d, float* dst) {
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t i = 0; i < d; i += 16) {
    const __m256i u = load16(src + i);
    _mm256_store_ps(dst + i, _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, u)));
    _mm256_store_ps(dst + i + 8, _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, u)));
  }
}

// acc = acc * alpha, then per key pair + v[2j+1] * w[2j+1] + v[2j] * w[2j], for NC x 8 dims of
// the converted values vf [kBlock][kDimHalf] (the reference's value chain, dim by dim).
template <int NC>
inline void weigh_values(const float* vf, const float* w, int pairs, float alpha, float* acc, Trickle& next_values) {
  const __m256 al = _mm256_set1_ps(alpha);
  __m256 a[NC];
  for (int c = 0; c < NC; ++c) a[c] = _mm256_mul_ps(_mm256_load_ps(acc + 8 * c), al);
  for (int j = 0; j < pairs; ++j) {
    next_values.step();
    const __m256 w1 = _mm256_set1_ps(w[2 * j + 1]), w0 = _mm256_set1_ps(w[2 * j]);
    const float* v1 = vf + (2 * j + 1) * kDimHalf;
    const float* v0 = vf + (2 * j) * kDimHalf;
    for (int c = 0; c < NC; ++c) {
      a[c] = _mm256_fmadd_ps(_mm256_load_ps(v1 + 8 * c), w1, a[c]);
      a[c] = _mm256_fmadd_ps(_mm256_load_ps(v0 + 8 * c), w0, a[c]);
    }
  }
  for (int c = 0; c < NC; ++c) _mm256_store_ps(acc + 8 * c, a[c]);
}

void block(const uint16_t* kb, const uint16_t* vb, int n, int64_t d, RowState* rows, int nrows, float* ws,
           const Ahead& ahead) {
  float* s = ws;                               // [nrows][kBlock] scores, then softmax weights
  float* alpha = s + nrows * kBlock;           // [nrows] (padded to 8)
  float* kf = alpha + (nrows + 7) / 8 * 8;     // [d / 2][2][kKeyHalf] key planes
  float* vf = kf + kKeyHalf * d;               // [kBlock][kDimHalf] values
  scores_half(kb, n, d, 0, rows, nrows, kf, s, ahead);
  if (n > kKeyHalf) scores_half(kb, n, d, 1, rows, nrows, kf, s, Ahead{});
  const __m256 neg_inf = _mm256_set1_ps(kNegInf);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 keep = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  for (int r = 0; r < nrows; ++r) {
    RowState& st = rows[r];
    const float inv = st.cap > 0.f ? softcap_inverse(st.cap) : 0.f;
    __m256 sv[4], valid[4];
    for (int jb = 0; jb < 4; ++jb) {
      valid[jb] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n - 8 * jb), lane));
      if (8 * jb >= n) {
        sv[jb] = neg_inf;
        continue;
      }
      sv[jb] = _mm256_load_ps(s + r * kBlock + 8 * jb);
      if (st.cap > 0.f) sv[jb] = softcap_avx2(sv[jb], st.cap, inv);
      sv[jb] = _mm256_blendv_ps(neg_inf, sv[jb], valid[jb]);
    }
    const float bmax = hmax8(_mm256_max_ps(_mm256_max_ps(sv[0], sv[1]), _mm256_max_ps(sv[2], sv[3])));
    const float m_new = std::fmax(st.m, bmax);
    alpha[r] = _mm256_cvtss_f32(exp_avx2(_mm256_set1_ps(st.m - m_new)));
    const __m256 mn = _mm256_set1_ps(m_new);
    __m256 p[4];
    for (int jb = 0; jb < 4; ++jb) {
      p[jb] = _mm256_and_ps(exp_avx2(_mm256_sub_ps(sv[jb], mn)), valid[jb]);
      // round to bfloat16, nearest even (float_to_bf16), kept as the float it stands for
      const __m256i u = _mm256_castps_si256(p[jb]);
      const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
      const __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd));
      _mm256_store_ps(s + r * kBlock + 8 * jb, _mm256_and_ps(_mm256_castsi256_ps(rounded), keep));
    }
    // psum[i] = p[i] + p[i+16], then the 16-lane tree
    const __m256 psum = _mm256_add_ps(_mm256_add_ps(p[0], p[2]), _mm256_add_ps(p[1], p[3]));
    st.l = std::fma(st.l, alpha[r], hsum8_tree(psum));
    st.m = m_new;
  }
  const int pairs = (n + 1) / 2;
  // The block ahead's values come in while these are weighed (its keys came during the scores).
  Trickle next_values(ahead.v, ahead.bytes, (d + kDimHalf - 1) / kDimHalf * nrows * pairs);
  for (int64_t base = 0; base < d; base += kDimHalf) {
    const int width = static_cast<int>(std::min<int64_t>(kDimHalf, d - base));
    for (int j = 0; j < 2 * pairs; ++j) {
      if (j < n) {
        value_row(vb + j * d + base, width, vf + j * kDimHalf);
      } else {
        for (int i = 0; i < width; i += 8) _mm256_store_ps(vf + j * kDimHalf + i, _mm256_setzero_ps());
      }
    }
    for (int r = 0; r < nrows; ++r) {
      if (width == kDimHalf)
        weigh_values<kDimHalf / 8>(vf, s + r * kBlock, pairs, alpha[r], rows[r].acc + base, next_values);
      else  // the last 32 of d % 64
        weigh_values<4>(vf, s + r * kBlock, pairs, alpha[r], rows[r].acc + base, next_values);
    }
  }
}

void finish(const RowState& st, int64_t d, float* out) {
  const float inv = 1.f / st.l;
  for (int64_t i = 0; i < d; ++i) {
    const int64_t c16 = i / 16, h = (i / 4) % 2, l = (i % 4) + 4 * ((i % 16) / 8);
    out[i] = st.acc[16 * c16 + 8 * h + l] * inv;
  }
}

size_t workspace(int64_t d, int nrows) {
  return static_cast<size_t>(nrows) * kBlock + (nrows + 7) / 8 * 8 + kKeyHalf * d + kBlock * kDimHalf;
}

}  // namespace

namespace {

// 8 floats rounded to bfloat16 (float_to_bf16's integer rounding: no bf16 conversion in AVX2), in
// the low 16 bits of each 32-bit lane.
inline __m256i bf16_bits(__m256 f) {
  const __m256i u = _mm256_castps_si256(f);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
}

// q8 rows into bfloat16 (kv_q8.h): q * scale exact in float32, then float_to_bf16's rounding.
void dequant(const uint16_t* rows, int n, int64_t d, uint16_t* out) {
  for_each_q8_group(rows, n, d, out, [](const int8_t* q, float scale, uint16_t* o) {
    const __m256 sf = _mm256_set1_ps(scale);
    for (int h = 0; h < 2; ++h) {  // 16 values: two registers of 8, packed in order
      const int8_t* src = q + 16 * h;
      const __m256i lo = bf16_bits(_mm256_mul_ps(
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)))), sf));
      const __m256i hi = bf16_bits(_mm256_mul_ps(
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + 8)))), sf));
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16 * h), packed);
    }
  });
}

}  // namespace

bool block_kernel_avx2(int64_t d, BlockKernel* out) {
  if (!cpu_supports(Path::AVX2) || d % 32 != 0 || d > 256) return false;
  *out = {block, finish, workspace, dequant};
  return true;
}

}  // namespace spx

SPX_END

#endif  // __x86_64__
