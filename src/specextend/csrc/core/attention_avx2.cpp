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
#include <limits>

#include "attention.h"
#include "target.h"

SPX_BEGIN_AVX2
#include "simd_avx2.h"

namespace spx {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline __m256i load16(const uint16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// 32 dims of bfloat16 (one chunk) as float32 planes: [x8][odd 8 | even 8], lane x of half x8
// holding dims 32c + 16*x8 + 2x (even) and + 1 (odd).
inline void chunk_planes(const uint16_t* src, float* dst) {
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int x8 = 0; x8 < 2; ++x8) {
    const __m256i u = load16(src + 16 * x8);
    _mm256_store_ps(dst + 16 * x8, _mm256_castsi256_ps(_mm256_and_si256(u, hi)));
    _mm256_store_ps(dst + 16 * x8 + 8, _mm256_castsi256_ps(_mm256_slli_epi32(u, 16)));
  }
}

// The lanes of keys [0, keys) against one query, for one half x8 of the 16 lanes: each key's two
// chains (chunks 0,1 and 2..) added. The query's planes for the half stay in registers while
// the keys stream past, one FMA per loaded key register.
template <int DC>
inline void key_half_lanes(const float* kf, const float* qf, int keys, int x8, __m256* out) {
  __m256 qo[DC], qe[DC];
  for (int c = 0; c < DC; ++c) {
    qo[c] = _mm256_load_ps(qf + 32 * c + 16 * x8);
    qe[c] = _mm256_load_ps(qf + 32 * c + 16 * x8 + 8);
  }
  for (int j = 0; j < keys; ++j) {
    const float* kp = kf + j * 32 * DC + 16 * x8;
    __m256 a = _mm256_fmadd_ps(_mm256_load_ps(kp), qo[0], _mm256_setzero_ps());
    a = _mm256_fmadd_ps(_mm256_load_ps(kp + 8), qe[0], a);
    __m256 b = _mm256_setzero_ps();
    for (int c = 1; c < DC; ++c) {
      __m256& acc = c < 2 ? a : b;
      acc = _mm256_fmadd_ps(_mm256_load_ps(kp + 32 * c), qo[c], acc);
      acc = _mm256_fmadd_ps(_mm256_load_ps(kp + 32 * c + 8), qe[c], acc);
    }
    out[j] = DC > 2 ? _mm256_add_ps(a, b) : a;
  }
}

// The rest of the tree (i+4, i+2, i+1) for 8 keys at once; lane j of the result is key j's score.
inline __m256 reduce8(const __m256* L) {
  __m256 b[4];
  for (int i = 0; i < 4; ++i)
    b[i] = _mm256_add_ps(_mm256_permute2f128_ps(L[2 * i], L[2 * i + 1], 0x20),
                         _mm256_permute2f128_ps(L[2 * i], L[2 * i + 1], 0x31));
  const __m256 c0 = _mm256_add_ps(_mm256_shuffle_ps(b[0], b[1], 0x44), _mm256_shuffle_ps(b[0], b[1], 0xEE));
  const __m256 c1 = _mm256_add_ps(_mm256_shuffle_ps(b[2], b[3], 0x44), _mm256_shuffle_ps(b[2], b[3], 0xEE));
  const __m256 s = _mm256_add_ps(_mm256_shuffle_ps(c0, c1, 0x88), _mm256_shuffle_ps(c0, c1, 0xDD));
  return _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));  // keys 0,2,4,6,1,3,5,7 -> 0..7
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

// Half-blocks of 16 keys and halves of 64 value dims keep the float32 copies a block is
// converted into (shared by every row of the item) at 8 KB, inside L1 beside the rows' state.
constexpr int kKeyHalf = 16, kDimHalf = 64;

// Scores of every row against keys [16h, 16h + 16) of the block into s[row][32].
template <int DC>
void scores_half(const uint16_t* kb, int n, int64_t d, int h, RowState* rows, int nrows, float* kf, float* qf,
                 float* s) {
  const int j0 = kKeyHalf * h, keys = std::min(kKeyHalf, n - j0);
  for (int j = 0; j < kKeyHalf; ++j)
    for (int c = 0; c < DC; ++c) {
      if (j < keys) {
        chunk_planes(kb + (j0 + j) * d + 32 * c, kf + j * d + 32 * c);
      } else {
        for (int i = 0; i < 32; i += 8) _mm256_store_ps(kf + j * d + 32 * c + i, _mm256_setzero_ps());
      }
    }
  const int keys8 = (keys + 7) / 8 * 8;
  for (int r = 0; r < nrows; ++r) {
    for (int c = 0; c < DC; ++c) chunk_planes(rows[r].q + 32 * c, qf + 32 * c);
    __m256 half[2][kKeyHalf];
    key_half_lanes<DC>(kf, qf, keys8, 0, half[0]);
    key_half_lanes<DC>(kf, qf, keys8, 1, half[1]);
    for (int jb = 0; jb < keys8; jb += 8) {
      __m256 L[8];  // lane i + lane i+8: the first level of the reference's tree
      for (int t = 0; t < 8; ++t) L[t] = _mm256_add_ps(half[0][jb + t], half[1][jb + t]);
      _mm256_store_ps(s + r * kBlock + j0 + jb, reduce8(L));
    }
  }
}

// acc = acc * alpha, then per key pair + v[2j+1] * w[2j+1] + v[2j] * w[2j], for NC x 8 dims of
// the converted values vf [kBlock][kDimHalf] (the reference's value chain, dim by dim).
template <int NC>
inline void weigh_values(const float* vf, const float* w, int pairs, float alpha, float* acc) {
  const __m256 al = _mm256_set1_ps(alpha);
  __m256 a[NC];
  for (int c = 0; c < NC; ++c) a[c] = _mm256_mul_ps(_mm256_load_ps(acc + 8 * c), al);
  for (int j = 0; j < pairs; ++j) {
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

template <int DC>
void block(const uint16_t* kb, const uint16_t* vb, int n, int64_t d, RowState* rows, int nrows, float* ws) {
  float* s = ws;                               // [nrows][kBlock] scores, then softmax weights
  float* alpha = s + nrows * kBlock;           // [nrows] (padded to 8)
  float* kf = alpha + (nrows + 7) / 8 * 8;     // [kKeyHalf][d] key planes
  float* vf = kf + kKeyHalf * d;               // [kBlock][kDimHalf] values
  float* qf = vf + kBlock * kDimHalf;          // [d] one query's planes
  scores_half<DC>(kb, n, d, 0, rows, nrows, kf, qf, s);
  if (n > kKeyHalf) scores_half<DC>(kb, n, d, 1, rows, nrows, kf, qf, s);
  const __m256 neg_inf = _mm256_set1_ps(kNegInf);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 keep = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  for (int r = 0; r < nrows; ++r) {
    RowState& st = rows[r];
    __m256 sv[4], valid[4];
    for (int jb = 0; jb < 4; ++jb) {
      valid[jb] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n - 8 * jb), lane));
      sv[jb] = 8 * jb < n ? _mm256_blendv_ps(neg_inf, _mm256_load_ps(s + r * kBlock + 8 * jb), valid[jb]) : neg_inf;
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
      if (width == kDimHalf) weigh_values<kDimHalf / 8>(vf, s + r * kBlock, pairs, alpha[r], rows[r].acc + base);
      else weigh_values<4>(vf, s + r * kBlock, pairs, alpha[r], rows[r].acc + base);  // the last 32 of d % 64
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
  return static_cast<size_t>(nrows) * kBlock + (nrows + 7) / 8 * 8 + kKeyHalf * d + kBlock * kDimHalf + d;
}

using BlockFn = void (*)(const uint16_t*, const uint16_t*, int, int64_t, RowState*, int, float*);

}  // namespace

bool block_kernel_avx2(int64_t d, BlockKernel* out) {
  if (!cpu_supports(Path::AVX2) || d % 32 != 0 || d > 256) return false;
  constexpr BlockFn by_chunks[8] = {block<1>, block<2>, block<3>, block<4>, block<5>, block<6>, block<7>, block<8>};
  *out = {by_chunks[d / 32 - 1], finish, workspace};
  return true;
}

}  // namespace spx

SPX_END

#endif  // __x86_64__
