// The avx2 path of the attention kernel (also the avx512 path's on CPUs without AVX512-BF16):
// the arithmetic of attention_portable.cpp with 8-lane float32 FMAs. A bfloat16 pair read as
// one 32-bit word gives its odd element by masking the low half and its even element by
// shifting it out, so the 16 lanes of a VDPBF16PS chain are two registers of odd products
// added before two of even ones; products of bfloat16 values are exact, so an FMA adds each
// with the one rounding the reference has. A block's keys and values are converted to float32
// once and shared by every query row of the item; many rows (a prefill chunk) run with rows across
// the lanes (`run`).
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

// ------------------------------------------------------------------ many rows: rows across the lanes
//
// A run of full blocks read by many rows (a prefill chunk's tokens) puts 8 rows in a register's lanes (a
// group), as the avx512 path's `FmaDot` run does with 16: the block's keys and values widened to float32
// once and broadcast from memory, each broadcast serving every group of a tile, the maximum and the sum
// running across registers, a group's rescale one exponential. Each lane computes its row's chains as
// `block` does (a score: the pairs in order, odd product then even; the sum of weights: key i + key i + 16,
// then the tree i+8, i+4, i+2, i+1; a value: the key pairs in order, odd key first), so the bits are `block`'s.

// A tile: GT groups (2, or 3 where the count is odd, 1 alone), TK keys (scores) or stored dimensions (values)
// broadcast a step: GT * TK accumulators, 2 GT query or weight registers and 2 broadcasts in 16 registers.
template <int GT>
constexpr int kLaneKeys = GT == 3 ? 2 : 4;

// The run's workspace (floats, 32-byte aligned): per group the queries' odd and even elements of each pair,
// the block's scores (then weights), the value accumulators, maximum, sum and rescale, and the rows' folds.
struct Lanes8 {
  __m256* qo;   // [d / 2][G]: lane i = the odd element of query pair p of row 8g + i
  __m256* qe;   // [d / 2][G]: the even element
  __m256* s;    // [kBlock][G]
  __m256* acc;  // [d][G], in `value_row`'s stored order
  __m256 *m, *l, *alpha;  // [G]
  __m256 *tm, *tl, *tacc;  // the folds (ChunkFolds): [G], [G], [d][G]
  int* started;            // [G]: a group's lanes whose fold holds a chunk, a bit a lane
  float cap = 0.f;
};

inline int64_t lanes8_floats(int64_t d, int groups) { return (d + kBlock + 2 * d + 6 + 1) * groups * 8; }

Lanes8 lanes8(float* ws, int64_t d, int groups, float cap) {
  __m256* z = reinterpret_cast<__m256*>(ws);
  Lanes8 sp;
  sp.cap = cap;
  sp.qo = z;
  sp.qe = z + d / 2 * groups;
  z += d * groups;
  sp.s = z;
  z += kBlock * groups;
  sp.acc = z;
  z += d * groups;
  sp.m = z;
  sp.l = z + groups;
  sp.alpha = z + 2 * groups;
  sp.tm = z + 3 * groups;
  sp.tl = z + 4 * groups;
  sp.started = reinterpret_cast<int*>(z + 5 * groups);
  sp.tacc = z + 6 * groups;
  return sp;
}

// A block widened to float32: the keys in place (kf [kBlock][D]), and each value pair's odd and even key in
// the stored order (vo, ve [kBlock / 2][D]).
template <int D>
struct Block8 {
  alignas(32) float kf[kBlock * D], vo[kBlock / 2 * D], ve[kBlock / 2 * D];
  void load(const uint16_t* k, const uint16_t* v) {
    for (int64_t i = 0; i < kBlock * D; i += 8)
      _mm256_store_ps(kf + i, _mm256_castsi256_ps(_mm256_slli_epi32(
                                  _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k + i))), 16)));
    for (int j = 0; j < kBlock / 2; ++j) {
      value_row(v + (2 * j + 1) * D, D, vo + j * D);
      value_row(v + 2 * j * D, D, ve + j * D);
    }
  }
};

template <int D, int GT>
void lane8_scores(const Block8<D>& blk, const Lanes8& sp, int groups, int g0, Trickle& next_keys) {
  constexpr int kLaneKeys = spx::kLaneKeys<GT>;
  for (int k0 = 0; k0 < kBlock; k0 += kLaneKeys) {
    next_keys.step();
    __m256 acc[kLaneKeys][GT];
    for (int k = 0; k < kLaneKeys; ++k)
      for (int g = 0; g < GT; ++g) acc[k][g] = _mm256_setzero_ps();
#pragma GCC unroll 2
    for (int p = 0; p < D / 2; ++p) {
      __m256 qo[GT], qe[GT];
      for (int g = 0; g < GT; ++g) {
        qo[g] = sp.qo[p * groups + g0 + g];
        qe[g] = sp.qe[p * groups + g0 + g];
      }
      const float* key = blk.kf + k0 * D + 2 * p;
      for (int k = 0; k < kLaneKeys; ++k) {
        const __m256 ko = _mm256_broadcast_ss(key + k * D + 1), ke = _mm256_broadcast_ss(key + k * D);
        for (int g = 0; g < GT; ++g) acc[k][g] = _mm256_fmadd_ps(ke, qe[g], _mm256_fmadd_ps(ko, qo[g], acc[k][g]));
      }
    }
    for (int k = 0; k < kLaneKeys; ++k)
      for (int g = 0; g < GT; ++g) sp.s[(k0 + k) * groups + g0 + g] = acc[k][g];
  }
}

// Group g's online-softmax step over the block's scores (soft-capped first where the rows are): maximum,
// rescale, weights (rounded to bfloat16 in place, float_to_bf16's integer rounding), sum.
void lane8_softmax(const Lanes8& sp, int groups, int g) {
  __m256* s = sp.s + g;
  if (sp.cap > 0.f) {
    const float inv = softcap_inverse(sp.cap);
    for (int k = 0; k < kBlock; ++k) s[k * groups] = softcap_avx2(s[k * groups], sp.cap, inv);
  }
  __m256 mx = s[0];
  for (int k = 1; k < kBlock; ++k) mx = _mm256_max_ps(mx, s[k * groups]);
  const __m256 m_new = _mm256_max_ps(sp.m[g], mx);
  sp.alpha[g] = exp_avx2(_mm256_sub_ps(sp.m[g], m_new));
  __m256 x[16];
  for (int k = 0; k < kBlock; ++k) {
    const __m256 p = exp_avx2(_mm256_sub_ps(s[k * groups], m_new));
    if (k < 16)
      x[k] = p;
    else
      x[k - 16] = _mm256_add_ps(x[k - 16], p);
    const __m256i u = _mm256_castps_si256(p);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd));
    s[k * groups] = _mm256_castsi256_ps(_mm256_and_si256(rounded, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  for (int w = 8; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) x[i] = _mm256_add_ps(x[i], x[i + w]);
  sp.l[g] = _mm256_fmadd_ps(sp.l[g], sp.alpha[g], x[0]);
  sp.m[g] = m_new;
}

template <int D, int GT>
void lane8_values(const Block8<D>& blk, const Lanes8& sp, int groups, int g0, Trickle& next_values) {
  constexpr int kLaneKeys = spx::kLaneKeys<GT>;
  bool rescale = false;
  for (int g = 0; g < GT; ++g)  // x * 1 = x
    rescale |= _mm256_movemask_ps(_mm256_cmp_ps(sp.alpha[g0 + g], _mm256_set1_ps(1.f), _CMP_NEQ_UQ)) != 0;
  for (int x0 = 0; x0 < D; x0 += kLaneKeys) {
    next_values.step();
    __m256 acc[kLaneKeys][GT];
    for (int x = 0; x < kLaneKeys; ++x)
      for (int g = 0; g < GT; ++g) {
        acc[x][g] = sp.acc[(x0 + x) * groups + g0 + g];
        if (rescale) acc[x][g] = _mm256_mul_ps(acc[x][g], sp.alpha[g0 + g]);
      }
#pragma GCC unroll 4
    for (int j = 0; j < kBlock / 2; ++j) {
      __m256 wo[GT], we[GT];
      for (int g = 0; g < GT; ++g) {
        wo[g] = sp.s[(2 * j + 1) * groups + g0 + g];
        we[g] = sp.s[2 * j * groups + g0 + g];
      }
      for (int x = 0; x < kLaneKeys; ++x) {
        const __m256 o = _mm256_broadcast_ss(blk.vo + j * D + x0 + x), e = _mm256_broadcast_ss(blk.ve + j * D + x0 + x);
        for (int g = 0; g < GT; ++g) acc[x][g] = _mm256_fmadd_ps(e, we[g], _mm256_fmadd_ps(o, wo[g], acc[x][g]));
      }
    }
    for (int x = 0; x < kLaneKeys; ++x)
      for (int g = 0; g < GT; ++g) sp.acc[(x0 + x) * groups + g0 + g] = acc[x][g];
  }
}

// Rows' d floats (row(r), 32-byte aligned) into lanes [d][G] and out, 8 x 8 words at a time; lanes past nrows
// get zeros and are never read back.
template <class Row>
void floats8_in(Row row, int nrows, int64_t d, __m256* lanes, int groups) {
  __m256i t[8];
  for (int g = 0; g < groups; ++g)
    for (int64_t x0 = 0; x0 < d; x0 += 8) {
      for (int i = 0; i < 8; ++i) {
        const int r = 8 * g + i;
        t[i] = r < nrows ? _mm256_castps_si256(_mm256_loadu_ps(row(r) + x0)) : _mm256_setzero_si256();
      }
      transpose8(t);
      for (int i = 0; i < 8; ++i) lanes[(x0 + i) * groups + g] = _mm256_castsi256_ps(t[i]);
    }
}

template <class Row>
void floats8_out(Row row, int nrows, int64_t d, const __m256* lanes, int groups) {
  __m256i t[8];
  for (int g = 0; g < groups; ++g)
    for (int64_t x0 = 0; x0 < d; x0 += 8) {
      for (int i = 0; i < 8; ++i) t[i] = _mm256_castps_si256(lanes[(x0 + i) * groups + g]);
      transpose8(t);
      for (int i = 0; i < 8 && 8 * g + i < nrows; ++i) _mm256_storeu_ps(row(8 * g + i) + x0, _mm256_castsi256_ps(t[i]));
    }
}

// The rows' states and queries into the lanes (rows past nrows: zeros), and the states out.
void lanes8_in(const RowState* rows, int nrows, int64_t d, const Lanes8& sp, int groups) {
  float* m = reinterpret_cast<float*>(sp.m);
  float* l = reinterpret_cast<float*>(sp.l);
  for (int r = 0; r < groups * 8; ++r) {
    m[r] = r < nrows ? rows[r].m : 0.f;
    l[r] = r < nrows ? rows[r].l : 0.f;
  }
  floats8_in([&](int r) { return rows[r].acc; }, nrows, d, sp.acc, groups);
  __m256i t[8];
  for (int g = 0; g < groups; ++g)
    for (int64_t x0 = 0; x0 < d; x0 += 8) {  // the queries' float32 values, dims x0.. x0 + 7: pairs x0 / 2..
      for (int i = 0; i < 8; ++i) {
        const int r = 8 * g + i;
        t[i] = r < nrows ? _mm256_castps_si256(_mm256_loadu_ps(rows[r].qf + x0)) : _mm256_setzero_si256();
      }
      transpose8(t);
      for (int i = 0; i < 8; i += 2) {
        sp.qe[(x0 + i) / 2 * groups + g] = _mm256_castsi256_ps(t[i]);
        sp.qo[(x0 + i) / 2 * groups + g] = _mm256_castsi256_ps(t[i + 1]);
      }
    }
}

void lanes8_out(RowState* rows, int nrows, int64_t d, const Lanes8& sp, int groups) {
  const float* m = reinterpret_cast<const float*>(sp.m);
  const float* l = reinterpret_cast<const float*>(sp.l);
  for (int r = 0; r < nrows; ++r) {
    rows[r].m = m[r];
    rows[r].l = l[r];
  }
  floats8_out([&](int r) { return rows[r].acc; }, nrows, d, sp.acc, groups);
}

void folds8_in(const ChunkFolds& f, int nrows, int64_t d, const Lanes8& sp, int groups) {
  float* tm = reinterpret_cast<float*>(sp.tm);
  float* tl = reinterpret_cast<float*>(sp.tl);
  for (int g = 0; g < groups; ++g) sp.started[g] = 0;
  for (int r = 0; r < groups * 8; ++r) {
    tm[r] = r < nrows ? f.tml[2 * r] : 0.f;
    tl[r] = r < nrows ? f.tml[2 * r + 1] : 0.f;
    if (r < nrows && f.started[r]) sp.started[r / 8] |= 1 << (r % 8);
  }
  floats8_in([&](int r) { return f.tacc + r * d; }, nrows, d, sp.tacc, groups);
}

void folds8_out(const ChunkFolds& f, int nrows, int64_t d, const Lanes8& sp, int groups) {
  const float* tm = reinterpret_cast<const float*>(sp.tm);
  const float* tl = reinterpret_cast<const float*>(sp.tl);
  for (int r = 0; r < nrows; ++r) {
    f.tml[2 * r] = tm[r];
    f.tml[2 * r + 1] = tl[r];
    f.started[r] = (sp.started[r / 8] >> (r % 8)) & 1;
  }
  floats8_out([&](int r) { return f.tacc + r * d; }, nrows, d, sp.tacc, groups);
}

// Every lane's chunk into its fold as fold_state puts it, lane for lane (a lane whose fold holds no chunk yet
// takes the chunk's state as it is), then a fresh chunk in every lane.
void lane8_fold(const Lanes8& sp, int64_t d, int groups) {
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  for (int g = 0; g < groups; ++g) {
    const __m256 st = _mm256_castsi256_ps(
        _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(sp.started[g]), bit), bit));
    const __m256 m = sp.m[g], l = sp.l[g], tm = sp.tm[g];
    const __m256 mn = _mm256_max_ps(tm, m);
    const __m256 a = exp_avx2(_mm256_sub_ps(tm, mn)), b = exp_avx2(_mm256_sub_ps(m, mn));
    sp.tl[g] = _mm256_blendv_ps(l, _mm256_add_ps(_mm256_mul_ps(sp.tl[g], a), _mm256_mul_ps(l, b)), st);
    sp.tm[g] = _mm256_blendv_ps(m, mn, st);
    for (int64_t x = 0; x < d; ++x) {
      const __m256 acc = sp.acc[x * groups + g];
      __m256& t = sp.tacc[x * groups + g];
      t = _mm256_blendv_ps(acc, _mm256_add_ps(_mm256_mul_ps(t, a), _mm256_mul_ps(acc, b)), st);
      sp.acc[x * groups + g] = _mm256_setzero_ps();
    }
    sp.started[g] = 0xFF;
    sp.m[g] = _mm256_set1_ps(kNegInf);
    sp.l[g] = _mm256_setzero_ps();
  }
}

// The lane-group tiles of a block: f(GT, g0) for groups [g0, g0 + GT), pairs, the last three where the count
// is odd (a lone group only where there is one: a tile of one group is bound by its loads).
template <class F>
void each_tile8(int groups, F&& f) {
  if (groups == 1) return f(std::integral_constant<int, 1>{}, 0);
  int g0 = 0;
  for (; groups - g0 > 3 || groups - g0 == 2; g0 += 2) f(std::integral_constant<int, 2>{}, g0);
  if (g0 < groups) f(std::integral_constant<int, 3>{}, g0);
}

// A block's steps over the tiles (the scores' or, per key, values' `per` keys or dimensions at a tile's pace).
int tile8_steps(int groups, int per) {
  int steps = 0;
  each_tile8(groups, [&](auto GT, int) { steps += per / kLaneKeys<GT>; });
  return steps;
}

template <int D>
void run_d(const uint16_t* k, const uint16_t* v, int nblocks, RowState* rows, int nrows, float* ws,
           const ChunkFolds* chunks) {
  const int groups = (nrows + 7) / 8;
  const Lanes8 sp = lanes8(ws, D, groups, rows[0].cap);
  lanes8_in(rows, nrows, D, sp, groups);
  const ChunkStarts starts(chunks, nblocks);
  const bool folds = starts.any();
  if (folds) folds8_in(*chunks, nrows, D, sp, groups);
  Block8<D> blk;
  const int key_steps = tile8_steps(groups, kBlock), value_steps = tile8_steps(groups, D);
  for (int b = 0; b < nblocks; ++b) {
    if (starts.at(b)) lane8_fold(sp, D, groups);
    const uint16_t* kb = k + b * kBlock * D;
    const uint16_t* vb = v + b * kBlock * D;
    const bool ahead = b + kAheadBlocks < nblocks;  // the block kAheadBlocks on comes in over this one's work
    const int64_t on = kAheadBlocks * kBlock * D;
    Trickle next_keys(ahead ? kb + on : nullptr, kBlock * D * 2, key_steps);
    Trickle next_values(ahead ? vb + on : nullptr, kBlock * D * 2, value_steps);
    blk.load(kb, vb);
    each_tile8(groups, [&](auto GT, int g0) { lane8_scores<D, GT>(blk, sp, groups, g0, next_keys); });
    for (int g = 0; g < groups; ++g) lane8_softmax(sp, groups, g);
    each_tile8(groups, [&](auto GT, int g0) { lane8_values<D, GT>(blk, sp, groups, g0, next_values); });
  }
  lanes8_out(rows, nrows, D, sp, groups);
  if (folds) folds8_out(*chunks, nrows, D, sp, groups);
}

void run(const uint16_t* k, const uint16_t* v, int nblocks, int64_t d, RowState* rows, int nrows, float* ws,
         const ChunkFolds* chunks) {
  if (d == 256)
    run_d<256>(k, v, nblocks, rows, nrows, ws, chunks);
  else if (d == 128)
    run_d<128>(k, v, nblocks, rows, nrows, ws, chunks);
  else
    run_d<64>(k, v, nblocks, rows, nrows, ws, chunks);
}

// fold_state with its bits: its two exponentials as two lanes of exp_avx2 (exp_portable lane for lane), each
// weighted value as fold_state computes it (two products, then their sum), 8 at a time.
void fold(float m, float l, const float* acc, char* started, float* tml, float* tacc, int64_t d) {
  float a, b;
  const auto exp2 = [](float x, float y, float* ex, float* ey) {
    alignas(32) float e[8];
    _mm256_store_ps(e, exp_avx2(_mm256_setr_ps(x, y, 0, 0, 0, 0, 0, 0)));
    *ex = e[0];
    *ey = e[1];
  };
  if (!fold_scalars(m, l, acc, started, tml, tacc, d, exp2, &a, &b)) return;
  const __m256 va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b);
  for (int64_t x = 0; x < d; x += 8)
    _mm256_storeu_ps(tacc + x, _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(tacc + x), va),
                                             _mm256_mul_ps(_mm256_loadu_ps(acc + x), vb)));
}

// From this many rows a run of blocks computes faster with rows across the lanes.
constexpr int kRunRows = 48;

// The block kernel's (per row: scores, rescale; the key planes and values), or a run's lanes.
size_t workspace(int64_t d, int nrows) {
  const size_t rows = static_cast<size_t>(nrows) * kBlock + (nrows + 7) / 8 * 8 + kKeyHalf * d + kBlock * kDimHalf;
  return std::max<size_t>(rows, lanes8_floats(d, (nrows + 7) / 8));
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
  if (d == 64 || d == 128 || d == 256)
    *out = {block, finish, workspace, dequant, run, kRunRows, fold};
  else
    *out = {block, finish, workspace, dequant, nullptr, 0, fold};
  return true;
}

}  // namespace spx

SPX_END

#endif  // __x86_64__
