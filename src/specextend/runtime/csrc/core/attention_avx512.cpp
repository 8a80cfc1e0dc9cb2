// The avx512 path of the attention kernel: VDPBF16PS (32 bfloat16 multiply-adds an instruction),
// the arithmetic of attention_portable.cpp lane for lane. A block's keys are shared by every
// query row of the item; its values are interleaved by key pairs once for all of them. Many rows
// (a prefill chunk) run on FMAs instead where those are the faster (Intel: `FmaDot`).
#if defined(__x86_64__)

#include "x86.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "attention.h"
#include "cpu.h"
#include "kv_q8.h"
#include "target.h"

SPX_BEGIN_AVX512BF16
#include "simd_avx512.h"
#include "tiles.h"

namespace spx {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float hsum16_avx512(__m512 v) {
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), hi);
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

// A few rows' products, two ways with the same bits: `Bf16Dot`, one VDPBF16PS per pair and half; `FmaDot`,
// where VDPBF16PS is the slower (avx512_bf16_dot_pays: Intel's Xeons run it at half the FMA rate), each
// step as two float32 FMAs, odd product then even — each pair register split into its odd and even halves
// as float32 (an AND and a shift), the softmax weights rounded to bfloat16 in place (`float_to_bf16`'s
// integer rounding, as `lane_softmax<FmaDot>`). A decode step's or a small tree's attention over a long cache is
// bound by these products on such a CPU, not by the bytes.
struct Bf16Dot {};
struct FmaDot {};

inline __m512 odd_half(__m512i pairs) {
  return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(-65536)));
}
inline __m512 even_half(__m512i pairs) { return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)); }

// Scores of R rows against the block's 32 keys: per row, two chains (keys 0-15, 16-31) over the
// pairs in order (attention_portable.cpp's score chain).
template <class Dot, int DP, int R>
inline void score_rows(const __m512i* kt, const RowState* rows, float* s, const Ahead& ahead) {
  Trickle next_keys(ahead.k, ahead.bytes, DP);
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
#pragma GCC unroll 2
  for (int p = 0; p < DP; ++p) {
    const __m512i k0 = _mm512_load_si512(kt + 2 * p), k1 = _mm512_load_si512(kt + 2 * p + 1);
    next_keys.step();
    if constexpr (std::is_same_v<Dot, FmaDot>) {
      const __m512 ko0 = odd_half(k0), ke0 = even_half(k0), ko1 = odd_half(k1), ke1 = even_half(k1);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 qo = _mm512_set1_ps(rows[r].qf[2 * p + 1]), qe = _mm512_set1_ps(rows[r].qf[2 * p]);
        acc[r][0] = _mm512_fmadd_ps(ke0, qe, _mm512_fmadd_ps(ko0, qo, acc[r][0]));
        acc[r][1] = _mm512_fmadd_ps(ke1, qe, _mm512_fmadd_ps(ko1, qo, acc[r][1]));
      }
    } else {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, rows[r].q + 2 * p, 4);
        const __m512bh qb = (__m512bh)_mm512_set1_epi32(pair);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)k0, qb);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)k1, qb);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(s + r * kBlock, acc[r][0]);
    _mm512_storeu_ps(s + r * kBlock + 16, acc[r][1]);
  }
}

// One row's softmax step over the block's scores sr[kBlock] (keys past n masked): soft-capped where the row
// asks, its maximum and sum moved on, its weights in p (zero past n), its accumulator's rescale returned.
inline float softmax_step(const float* sr, int n, RowState& st, __m512 p[2]) {
  const __mmask16 k0 = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
  const __mmask16 k1 = n >= 32 ? 0xFFFF : (n > 16 ? static_cast<__mmask16>((1u << (n - 16)) - 1) : 0);
  __m512 s[2] = {_mm512_loadu_ps(sr), n > 16 ? _mm512_loadu_ps(sr + 16) : _mm512_setzero_ps()};
  if (st.cap > 0.f) {  // masked below, as every other score past n
    const float inv = softcap_inverse(st.cap);
    s[0] = softcap_avx512(s[0], st.cap, inv);
    s[1] = softcap_avx512(s[1], st.cap, inv);
  }
  s[0] = _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), k0, s[0]);
  s[1] = _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), k1, s[1]);
  const float bmax = _mm512_reduce_max_ps(_mm512_max_ps(s[0], s[1]));
  const float m_new = std::fmax(st.m, bmax);
  const float alpha = _mm_cvtss_f32(_mm512_castps512_ps128(exp_avx512(_mm512_set1_ps(st.m - m_new))));
  const __m512 mn = _mm512_set1_ps(m_new);
  p[0] = _mm512_maskz_mov_ps(k0, exp_avx512(_mm512_sub_ps(s[0], mn)));
  p[1] = _mm512_maskz_mov_ps(k1, exp_avx512(_mm512_sub_ps(s[1], mn)));
  st.l = std::fma(st.l, alpha, hsum16_avx512(_mm512_add_ps(p[0], p[1])));
  st.m = m_new;
  return alpha;
}

// VDPBF16PS's values read where they lie: for each 32 dimensions, each key pair's two rows interleaved in
// registers (the `interleave_values` order) and used at once by R rows, so the interleaved block is never
// stored and loaded back (on Zen 4 that store and reload cost as much as the products). pw: the rows' weight
// pairs, [R][16]; past n a value row counts as zero (its weight is zero, but its bytes need not be numbers).
template <int DV, int R>
inline void dot_value_rows(const uint16_t* vb, int n, int64_t d, const int32_t* pw, const float* alpha, int pairs,
                           RowState* rows, Trickle& next_values) {
  for (int c = 0; c < DV; c += 2) {
    __m512 a[R][2];
    for (int r = 0; r < R; ++r) {
      a[r][0] = _mm512_load_ps(rows[r].acc + 16 * c);
      a[r][1] = _mm512_load_ps(rows[r].acc + 16 * c + 16);
      if (alpha[r] != 1.f) {  // exactly 1 where the maximum did not move (exp_portable(0) = 1): x * 1 = x
        const __m512 al = _mm512_set1_ps(alpha[r]);
        a[r][0] = _mm512_mul_ps(a[r][0], al);
        a[r][1] = _mm512_mul_ps(a[r][1], al);
      }
    }
    const uint16_t* col = vb + 16 * c;
#pragma GCC unroll 2
    for (int j = 0; j < pairs; ++j) {
      next_values.step();
      const __m512i x0 = _mm512_loadu_si512(col + 2 * j * d);
      const __m512i x1 = 2 * j + 1 < n ? _mm512_loadu_si512(col + (2 * j + 1) * d) : _mm512_setzero_si512();
      const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x0, x1), hi = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(pw[16 * r + j]);
        a[r][0] = _mm512_dpbf16_ps(a[r][0], lo, w);
        a[r][1] = _mm512_dpbf16_ps(a[r][1], hi, w);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm512_store_ps(rows[r].acc + 16 * c, a[r][0]);
      _mm512_store_ps(rows[r].acc + 16 * c + 16, a[r][1]);
    }
  }
}

// Rows [0, R)'s values: each accumulator rescaled, then the key pairs in order, two registers of 16
// dimensions at a time for all R rows (vi: the block's values interleaved by key pairs, each register
// split into its odd and even key as float32 where used; w: the rows' rounded weights, [R][kBlock]).
template <int DV, int R>
inline void fma_value_rows(const __m512i (*vi)[DV], const float* w, const float* alpha, int pairs, RowState* rows,
                           const Ahead& ahead) {
  Trickle next_values(ahead.v, ahead.bytes, static_cast<int64_t>(DV / 2) * pairs);
  for (int c = 0; c < DV; c += 2) {
    __m512 a[R][2];
    for (int r = 0; r < R; ++r) {
      const __m512 al = _mm512_set1_ps(alpha[r]);
      a[r][0] = _mm512_mul_ps(_mm512_load_ps(rows[r].acc + 16 * c), al);
      a[r][1] = _mm512_mul_ps(_mm512_load_ps(rows[r].acc + 16 * c + 16), al);
    }
#pragma GCC unroll 2
    for (int j = 0; j < pairs; ++j) {
      next_values.step();
      const __m512 o0 = odd_half(vi[j][c]), e0 = even_half(vi[j][c]);
      const __m512 o1 = odd_half(vi[j][c + 1]), e1 = even_half(vi[j][c + 1]);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 wo = _mm512_set1_ps(w[r * kBlock + 2 * j + 1]), we = _mm512_set1_ps(w[r * kBlock + 2 * j]);
        a[r][0] = _mm512_fmadd_ps(e0, we, _mm512_fmadd_ps(o0, wo, a[r][0]));
        a[r][1] = _mm512_fmadd_ps(e1, we, _mm512_fmadd_ps(o1, wo, a[r][1]));
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm512_store_ps(rows[r].acc + 16 * c, a[r][0]);
      _mm512_store_ps(rows[r].acc + 16 * c + 16, a[r][1]);
    }
  }
}

template <class Dot, int DC>
void block_dc(const uint16_t* kb, const uint16_t* vb, int n, int64_t d, RowState* rows, int nrows, float* sbuf,
              const Ahead& ahead) {
  constexpr int DV = 2 * DC;  // float32 accumulators of 16 dims
  alignas(64) __m512i kt[DC * 16 * 2];
  transpose_keys<DC * 16>(kb, n, d, kt);
  row_tiles<6>(nrows, [&](auto R, int r) {  // 12 chains in flight: enough to cover the products' latency
    score_rows<Dot, DC * 16, R>(kt, rows + r, sbuf + r * kBlock, r == 0 ? ahead : Ahead{});  // the block ahead once
  });
  // Softmax weights of every row first (each row's rescale in alpha): the rows' chains are independent,
  // so the out-of-order core overlaps them; then the values.
  float* w = sbuf + nrows * kBlock;  // 64-byte aligned: bfloat16 pairs [nrows][16], or rounded floats [nrows][kBlock]
  float* alpha = w + nrows * kBlock;
  const __m512i half = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1), top = _mm512_set1_epi32(-65536);
  for (int r = 0; r < nrows; ++r) {
    __m512 p[2];
    alpha[r] = softmax_step(sbuf + r * kBlock, n, rows[r], p);
    if constexpr (std::is_same_v<Dot, FmaDot>) {
      for (int h = 0; h < 2; ++h) {
        const __m512i u = _mm512_castps_si512(p[h]);
        const __m512i x = _mm512_add_epi32(u, _mm512_add_epi32(half, _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
        _mm512_store_ps(w + r * kBlock + 16 * h, _mm512_castsi512_ps(_mm512_and_si512(x, top)));
      }
    } else {
      _mm512_store_si512(w + 16 * r, (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));  // pairs (2j, 2j+1)
    }
  }
  const int pairs = (n + 1) / 2;  // weights past n are zero: their products add nothing
  if constexpr (std::is_same_v<Dot, FmaDot>) {  // the values interleaved by key pairs once for all the rows
    alignas(64) __m512i vi[kBlock / 2][DV];
    interleave_values<DV>(vb, n, d, vi);
    row_tiles<6>(nrows, [&](auto R, int r) {
      fma_value_rows<DV, R>(vi, w + r * kBlock, alpha + r, pairs, rows + r, r == 0 ? ahead : Ahead{});
    });
  } else {
    Trickle next_values(ahead.v, ahead.bytes, (nrows + 5) / 6 * (DV / 2) * pairs);
    const int32_t* pw = reinterpret_cast<const int32_t*>(w);
    row_tiles<6>(nrows, [&](auto R, int r) {  // 12 chains, as the scores
      dot_value_rows<DV, R>(vb, n, d, pw + 16 * r, alpha + r, pairs, rows + r, next_values);
    });
  }
}

// One block of a few rows.
template <class Dot>
void block(const uint16_t* kb, const uint16_t* vb, int n, int64_t d, RowState* rows, int nrows, float* ws,
           const Ahead& ahead) {
  if (d == 256)  // Gemma 2 and 3
    block_dc<Dot, 8>(kb, vb, n, d, rows, nrows, ws, ahead);
  else if (d == 128)
    block_dc<Dot, 4>(kb, vb, n, d, rows, nrows, ws, ahead);
  else
    block_dc<Dot, 2>(kb, vb, n, d, rows, nrows, ws, ahead);
}

// ------------------------------------------------------------------ many rows: rows across the lanes
//
// A run of full blocks read by many rows (a prefill chunk's tokens, a tree's nodes) puts 16 rows in a
// register's lanes (a group) where `block` puts 16 keys or dimensions there. The keys' and values'
// pairs are then broadcast from memory where they lie (no key transpose), each broadcast serves every
// group of the tile, the maximum and the sum of a block run across registers (no horizontal steps), and
// a group's rescale is one exponential. Each lane computes its row's chains exactly as `block` does
// (a score: the pairs in order, odd product then even; the sum of weights: lane i + lane i+16, then the
// tree i+8, i+4, i+2, i+1; a value: the key pairs in order), so the bits are `block`'s, block by block.
// With `FmaDot` the block's keys and values are widened to float32 once and broadcast from memory, the
// queries' halves once a run (LaneSpace::qf), and the weights rounded to bfloat16 in place.

constexpr int kTileKeys = 4;       // keys (scores) or dimensions (values) a tile broadcasts per step

// The run's workspace (floats, 64-byte aligned): per group, the queries' pairs, the block's scores
// (then weights), the weights' bfloat16 pairs, the value accumulators, and maximum, sum and rescale.
struct LaneSpace {
  __m512i* qt;  // [dp][G]: lane i = query pair p of row 16g + i
  __m512* s;    // [kBlock][G]: scores, then exp(score - max)
  __m512i* w;   // [kBlock / 2][G]: lane i = the bfloat16 weights of keys (2j, 2j+1)
  __m512* acc;  // [d][G], d in the path's dimension order (`stored_dim`)
  __m512 *m, *l, *alpha;  // [G]
  __m512* qf;  // [dp][2][G]: query pair p's odd, then even element as float32 (the fma runs)
  // The rows' folds, where a run crosses chunks (ChunkFolds): maximum, sum [G], weighted values [d][G], and a
  // group's lanes that hold a chunk yet (started, a mask a group).
  __m512 *tm, *tl, *tacc;
  __mmask16* started;
  float cap = 0.f;  // > 0: scores soft-capped at it (RowState::cap, the same for every row of a run)
};

inline int64_t lane_space_floats(int64_t d, int groups) {
  return (d / 2 + kBlock + kBlock / 2 + d + 3 + d + 3 + d) * groups * 16;
}

LaneSpace lane_space(float* ws, int64_t d, int groups, float cap) {
  __m512* z = reinterpret_cast<__m512*>(ws);
  LaneSpace sp;
  sp.cap = cap;
  sp.qt = reinterpret_cast<__m512i*>(z);
  z += d / 2 * groups;
  sp.s = z;
  z += kBlock * groups;
  sp.w = reinterpret_cast<__m512i*>(z);
  z += kBlock / 2 * groups;
  sp.acc = z;
  z += d * groups;
  sp.m = z;
  sp.l = z + groups;
  sp.alpha = z + 2 * groups;
  sp.qf = z + 3 * groups;
  z += 3 * groups + d * groups;
  sp.tm = z;
  sp.tl = z + groups;
  sp.started = reinterpret_cast<__mmask16*>(z + 2 * groups);
  sp.tacc = z + 3 * groups;
  return sp;
}

// A block as each product reads it (d == D): `Bf16Dot` the keys where they lie and the values interleaved by
// key pairs (`interleave_values`: pair j, stored dimension x at word j * D + x); `FmaDot` the keys widened
// to float32 and each value pair's odd and even key as float32 (vo, ve: [kBlock / 2][D]).
template <class Dot, int D>
struct LaneBlock;

template <int D>
struct LaneBlock<Bf16Dot, D> {
  const uint16_t* kb;
  alignas(64) __m512i vi[kBlock / 2][D / 16];
  void load(const uint16_t* k, const uint16_t* v) {
    kb = k;
    interleave_values<D / 16>(v, kBlock, D, vi);
  }
};

template <int D>
struct LaneBlock<FmaDot, D> {
  alignas(64) float kf[kBlock * D], vo[kBlock / 2 * D], ve[kBlock / 2 * D];
  void load(const uint16_t* k, const uint16_t* v) {
    for (int64_t i = 0; i < kBlock * D; i += 16) {  // bfloat16 words as the float32 values they stand for
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k + i));
      _mm512_store_si512(kf + i, _mm512_slli_epi32(_mm512_cvtepu16_epi32(w), 16));
    }
    alignas(64) __m512i vi[kBlock / 2][D / 16];
    interleave_values<D / 16>(v, kBlock, D, vi);
    const __m512i* vw = &vi[0][0];
    for (int i = 0; i < kBlock / 2 * D / 16; ++i) {
      _mm512_store_ps(vo + 16 * i, odd_half(vw[i]));
      _mm512_store_ps(ve + 16 * i, even_half(vw[i]));
    }
  }
};

// Lane groups a tile: `Bf16Dot` 4 x 5 accumulators, 5 row registers and 4 broadcasts (29 of 32 registers);
// `FmaDot` 4 x 4 accumulators, 8 query or weight registers, 2 broadcasts.
template <class Dot>
constexpr int kTileGroups = std::is_same_v<Dot, FmaDot> ? 4 : 5;

// Scores of groups [g0, g0 + GT) against the block's keys, kTileKeys keys a step.
template <class Dot, int D, int GT>
void lane_scores(const LaneBlock<Dot, D>& blk, const LaneSpace& sp, int groups, int g0, Trickle& next_keys) {
  for (int k0 = 0; k0 < kBlock; k0 += kTileKeys) {
    next_keys.step();
    __m512 acc[kTileKeys][GT];
    for (int k = 0; k < kTileKeys; ++k)
      for (int g = 0; g < GT; ++g) acc[k][g] = _mm512_setzero_ps();
#pragma GCC unroll 2
    for (int p = 0; p < D / 2; ++p) {
      if constexpr (std::is_same_v<Dot, FmaDot>) {
        const float* key = blk.kf + k0 * D;
        __m512 qo[GT], qe[GT];
        for (int g = 0; g < GT; ++g) {
          qo[g] = sp.qf[p * 2 * groups + g0 + g];
          qe[g] = sp.qf[p * 2 * groups + groups + g0 + g];
        }
        for (int k = 0; k < kTileKeys; ++k) {
          const __m512 ko = _mm512_set1_ps(key[k * D + 2 * p + 1]), ke = _mm512_set1_ps(key[k * D + 2 * p]);
          for (int g = 0; g < GT; ++g) acc[k][g] = _mm512_fmadd_ps(ke, qe[g], _mm512_fmadd_ps(ko, qo[g], acc[k][g]));
        }
      } else {
        const uint16_t* key = blk.kb + k0 * D;
        __m512bh q[GT];
        for (int g = 0; g < GT; ++g) q[g] = (__m512bh)_mm512_load_si512(sp.qt + p * groups + g0 + g);
        for (int k = 0; k < kTileKeys; ++k) {
          int32_t pair;
          std::memcpy(&pair, key + k * D + 2 * p, 4);
          const __m512bh kp = (__m512bh)_mm512_set1_epi32(pair);
          for (int g = 0; g < GT; ++g) acc[k][g] = _mm512_dpbf16_ps(acc[k][g], kp, q[g]);
        }
      }
    }
    for (int k = 0; k < kTileKeys; ++k)
      for (int g = 0; g < GT; ++g) sp.s[(k0 + k) * groups + g0 + g] = acc[k][g];
  }
}

// Group g's online-softmax step over the block's scores (soft-capped first where the rows are):
// maximum, rescale, weights, sum.
void lane_softmax_step(const LaneSpace& sp, int groups, int g) {
  __m512* s = sp.s + g;
  if (sp.cap > 0.f) {
    const float inv = softcap_inverse(sp.cap);
    for (int k = 0; k < kBlock; ++k) s[k * groups] = softcap_avx512(s[k * groups], sp.cap, inv);
  }
  __m512 mx = s[0];
  for (int k = 1; k < kBlock; ++k) mx = _mm512_max_ps(mx, s[k * groups]);
  const __m512 m_new = _mm512_max_ps(sp.m[g], mx);
  sp.alpha[g] = exp_avx512(_mm512_sub_ps(sp.m[g], m_new));
  for (int k = 0; k < kBlock; ++k) s[k * groups] = exp_avx512(_mm512_sub_ps(s[k * groups], m_new));
  __m512 x[16];
  for (int i = 0; i < 16; ++i) x[i] = _mm512_add_ps(s[i * groups], s[(i + 16) * groups]);
  for (int w = 8; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) x[i] = _mm512_add_ps(x[i], x[i + w]);
  sp.l[g] = _mm512_fmadd_ps(sp.l[g], sp.alpha[g], x[0]);
  sp.m[g] = m_new;
}

// lane_softmax_step, then the weights as the values' products read them: `Bf16Dot` VDPBF16PS's bfloat16
// pairs (sp.w); `FmaDot` each weight rounded to bfloat16 in place (the integer form of VCVTNE2PS2BF16's
// rounding, float_to_bf16: the weights are normal floats).
template <class Dot>
void lane_softmax(const LaneSpace& sp, int groups, int g) {
  lane_softmax_step(sp, groups, g);
  __m512* s = sp.s + g;
  if constexpr (std::is_same_v<Dot, FmaDot>) {
    const __m512i half = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1), top = _mm512_set1_epi32(-65536);
    for (int k = 0; k < kBlock; ++k) {
      const __m512i u = _mm512_castps_si512(s[k * groups]);
      const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(half, _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
      s[k * groups] = _mm512_castsi512_ps(_mm512_and_si512(r, top));
    }
  } else {
    // Word 2i <- lane i of keys 2j, word 2i + 1 <- lane i of key 2j + 1.
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                                22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int j = 0; j < kBlock / 2; ++j) {
      const __m512i pj = (__m512i)_mm512_cvtne2ps_pbh(s[(2 * j + 1) * groups], s[2 * j * groups]);
      sp.w[j * groups + g] = _mm512_permutexvar_epi16(interleave, pj);
    }
  }
}

// Groups [g0, g0 + GT)'s values: each accumulator rescaled, then the block's key pairs in order,
// kTileKeys dimensions a step.
template <class Dot, int D, int GT>
void lane_values(const LaneBlock<Dot, D>& blk, const LaneSpace& sp, int groups, int g0, Trickle& next_values) {
  bool rescale = false;
  for (int g = 0; g < GT; ++g)
    rescale |= _mm512_cmp_ps_mask(sp.alpha[g0 + g], _mm512_set1_ps(1.f), _CMP_NEQ_UQ) != 0;  // x * 1 = x
  for (int x0 = 0; x0 < D; x0 += kTileKeys) {
    next_values.step();
    __m512 acc[kTileKeys][GT];
    for (int x = 0; x < kTileKeys; ++x)
      for (int g = 0; g < GT; ++g) {
        acc[x][g] = sp.acc[(x0 + x) * groups + g0 + g];
        if (rescale) acc[x][g] = _mm512_mul_ps(acc[x][g], sp.alpha[g0 + g]);
      }
#pragma GCC unroll 4
    for (int j = 0; j < kBlock / 2; ++j) {
      if constexpr (std::is_same_v<Dot, FmaDot>) {
        __m512 wo[GT], we[GT];
        for (int g = 0; g < GT; ++g) {
          wo[g] = sp.s[(2 * j + 1) * groups + g0 + g];
          we[g] = sp.s[2 * j * groups + g0 + g];
        }
        for (int x = 0; x < kTileKeys; ++x) {
          const __m512 o = _mm512_set1_ps(blk.vo[j * D + x0 + x]), e = _mm512_set1_ps(blk.ve[j * D + x0 + x]);
          for (int g = 0; g < GT; ++g) acc[x][g] = _mm512_fmadd_ps(e, we[g], _mm512_fmadd_ps(o, wo[g], acc[x][g]));
        }
      } else {
        const int32_t* vp = reinterpret_cast<const int32_t*>(&blk.vi[0][0]);
        __m512bh w[GT];
        for (int g = 0; g < GT; ++g) w[g] = (__m512bh)_mm512_load_si512(sp.w + j * groups + g0 + g);
        for (int x = 0; x < kTileKeys; ++x) {
          const __m512bh v = (__m512bh)_mm512_set1_epi32(vp[j * D + x0 + x]);
          for (int g = 0; g < GT; ++g) acc[x][g] = _mm512_dpbf16_ps(acc[x][g], v, w[g]);
        }
      }
    }
    for (int x = 0; x < kTileKeys; ++x)
      for (int g = 0; g < GT; ++g) sp.acc[(x0 + x) * groups + g0 + g] = acc[x][g];
  }
}

// Rows' d floats into lanes [d][G] (lane i of group g: row 16g + i; row(r) its floats, 64-byte aligned) and
// out, 16 x 16 words at a time (`transpose16`); lanes past nrows get zeros and are never read back.
template <class Row>
void floats_in(Row row, int nrows, int64_t d, __m512* lanes, int groups) {
  __m512i t[16];
  for (int g = 0; g < groups; ++g)
    for (int64_t x0 = 0; x0 < d; x0 += 16) {
      for (int i = 0; i < 16; ++i) {
        const int r = 16 * g + i;
        t[i] = r < nrows ? _mm512_load_si512(row(r) + x0) : _mm512_setzero_si512();
      }
      transpose16(t);
      for (int i = 0; i < 16; ++i) lanes[(x0 + i) * groups + g] = _mm512_castsi512_ps(t[i]);
    }
}

template <class Row>
void floats_out(Row row, int nrows, int64_t d, const __m512* lanes, int groups) {
  __m512i t[16];
  for (int g = 0; g < groups; ++g)
    for (int64_t x0 = 0; x0 < d; x0 += 16) {
      for (int i = 0; i < 16; ++i) t[i] = _mm512_castps_si512(lanes[(x0 + i) * groups + g]);
      transpose16(t);
      for (int i = 0; i < 16 && 16 * g + i < nrows; ++i) _mm512_store_si512(row(16 * g + i) + x0, t[i]);
    }
}

// The rows' states into the lanes and out; rows past nrows get zero queries and states.
void lanes_in(const RowState* rows, int nrows, int64_t d, const LaneSpace& sp, int groups) {
  float* m = reinterpret_cast<float*>(sp.m);
  float* l = reinterpret_cast<float*>(sp.l);
  for (int r = 0; r < groups * 16; ++r) {
    m[r] = r < nrows ? rows[r].m : 0.f;
    l[r] = r < nrows ? rows[r].l : 0.f;
  }
  floats_in([&](int r) { return rows[r].acc; }, nrows, d, sp.acc, groups);
  __m512i t[16];
  for (int g = 0; g < groups; ++g)
    for (int64_t p0 = 0; p0 < d / 2; p0 += 16) {
      for (int i = 0; i < 16; ++i) {
        const int r = 16 * g + i;
        t[i] = r < nrows ? _mm512_loadu_si512(rows[r].q + 2 * p0) : _mm512_setzero_si512();
      }
      transpose16(t);
      for (int i = 0; i < 16; ++i) {
        sp.qt[(p0 + i) * groups + g] = t[i];
        sp.qf[(p0 + i) * 2 * groups + g] = _mm512_castsi512_ps(_mm512_and_si512(t[i], _mm512_set1_epi32(-65536)));
        sp.qf[(p0 + i) * 2 * groups + groups + g] = _mm512_castsi512_ps(_mm512_slli_epi32(t[i], 16));
      }
    }
}

void lanes_out(RowState* rows, int nrows, int64_t d, const LaneSpace& sp, int groups) {
  const float* m = reinterpret_cast<const float*>(sp.m);
  const float* l = reinterpret_cast<const float*>(sp.l);
  for (int r = 0; r < nrows; ++r) {
    rows[r].m = m[r];
    rows[r].l = l[r];
  }
  floats_out([&](int r) { return rows[r].acc; }, nrows, d, sp.acc, groups);
}

// The rows' folds into the lanes and out (ChunkFolds).
void folds_in(const ChunkFolds& f, int nrows, int64_t d, const LaneSpace& sp, int groups) {
  float* tm = reinterpret_cast<float*>(sp.tm);
  float* tl = reinterpret_cast<float*>(sp.tl);
  for (int g = 0; g < groups; ++g) sp.started[g] = 0;
  for (int r = 0; r < groups * 16; ++r) {
    tm[r] = r < nrows ? f.tml[2 * r] : 0.f;
    tl[r] = r < nrows ? f.tml[2 * r + 1] : 0.f;
    if (r < nrows && f.started[r]) sp.started[r / 16] |= static_cast<__mmask16>(1u << (r % 16));
  }
  floats_in([&](int r) { return f.tacc + r * d; }, nrows, d, sp.tacc, groups);
}

void folds_out(const ChunkFolds& f, int nrows, int64_t d, const LaneSpace& sp, int groups) {
  const float* tm = reinterpret_cast<const float*>(sp.tm);
  const float* tl = reinterpret_cast<const float*>(sp.tl);
  for (int r = 0; r < nrows; ++r) {
    f.tml[2 * r] = tm[r];
    f.tml[2 * r + 1] = tl[r];
    f.started[r] = (sp.started[r / 16] >> (r % 16)) & 1;
  }
  floats_out([&](int r) { return f.tacc + r * d; }, nrows, d, sp.tacc, groups);
}

// Every lane's chunk into its fold as fold_state puts it, lane for lane (a lane whose fold holds no chunk yet
// takes the chunk's state as it is), then a fresh chunk in every lane.
void lane_fold(const LaneSpace& sp, int64_t d, int groups) {
  for (int g = 0; g < groups; ++g) {
    const __mmask16 st = sp.started[g];
    const __m512 m = sp.m[g], l = sp.l[g], tm = sp.tm[g];
    const __m512 mn = _mm512_max_ps(tm, m);
    const __m512 a = exp_avx512(_mm512_sub_ps(tm, mn)), b = exp_avx512(_mm512_sub_ps(m, mn));
    sp.tl[g] = _mm512_mask_blend_ps(st, l, _mm512_add_ps(_mm512_mul_ps(sp.tl[g], a), _mm512_mul_ps(l, b)));
    sp.tm[g] = _mm512_mask_blend_ps(st, m, mn);
    for (int64_t x = 0; x < d; ++x) {
      const __m512 acc = sp.acc[x * groups + g];
      __m512& t = sp.tacc[x * groups + g];
      t = _mm512_mask_blend_ps(st, acc, _mm512_add_ps(_mm512_mul_ps(t, a), _mm512_mul_ps(acc, b)));
      sp.acc[x * groups + g] = _mm512_setzero_ps();
    }
    sp.started[g] = 0xFFFF;
    sp.m[g] = _mm512_set1_ps(kNegInf);
    sp.l[g] = _mm512_setzero_ps();
  }
}

// The lane-group tiles of a block, of balanced sizes: f(Count<GT>{}, g0) for groups [g0, g0 + GT).
template <class Dot>
int tile_count(int groups) {
  return (groups + kTileGroups<Dot> - 1) / kTileGroups<Dot>;
}

template <class Dot, class F>
void each_tile(int groups, F&& f) {
  const int tiles = tile_count<Dot>(groups);
  for (int t = 0, g0 = 0; t < tiles; ++t) {
    const int gt = (groups * (t + 1)) / tiles - g0;
    with_count<kTileGroups<Dot>>(gt, [&](auto GT) { f(GT, g0); });
    g0 += gt;
  }
}

template <class Dot, int D>
void run_d(const uint16_t* k, const uint16_t* v, int nblocks, RowState* rows, int nrows, float* ws,
           const ChunkFolds* chunks) {
  const int groups = (nrows + 15) / 16;
  const LaneSpace sp = lane_space(ws, D, groups, rows[0].cap);
  lanes_in(rows, nrows, D, sp, groups);
  const ChunkStarts starts(chunks, nblocks);
  const bool folds = starts.any();
  if (folds) folds_in(*chunks, nrows, D, sp, groups);
  LaneBlock<Dot, D> blk;
  const int tiles = tile_count<Dot>(groups);
  for (int b = 0; b < nblocks; ++b) {
    if (starts.at(b)) lane_fold(sp, D, groups);
    const uint16_t* kb = k + b * kBlock * D;
    const uint16_t* vb = v + b * kBlock * D;
    // The block kAheadBlocks on (as the few rows' kernels take theirs) comes in over this one's work.
    const bool ahead = b + kAheadBlocks < nblocks;
    const int64_t on = kAheadBlocks * kBlock * D;
    Trickle next_keys(ahead ? kb + on : nullptr, kBlock * D * 2, tiles * kBlock / kTileKeys);
    Trickle next_values(ahead ? vb + on : nullptr, kBlock * D * 2, tiles * D / kTileKeys);
    blk.load(kb, vb);
    each_tile<Dot>(groups, [&](auto GT, int g0) { lane_scores<Dot, D, GT>(blk, sp, groups, g0, next_keys); });
    for (int g = 0; g < groups; ++g) lane_softmax<Dot>(sp, groups, g);
    each_tile<Dot>(groups, [&](auto GT, int g0) { lane_values<Dot, D, GT>(blk, sp, groups, g0, next_values); });
  }
  lanes_out(rows, nrows, D, sp, groups);
  if (folds) folds_out(*chunks, nrows, D, sp, groups);
}

template <class Dot>
void run(const uint16_t* k, const uint16_t* v, int nblocks, int64_t d, RowState* rows, int nrows, float* ws,
         const ChunkFolds* chunks) {
  if (d == 256)
    run_d<Dot, 256>(k, v, nblocks, rows, nrows, ws, chunks);
  else if (d == 128)
    run_d<Dot, 128>(k, v, nblocks, rows, nrows, ws, chunks);
  else
    run_d<Dot, 64>(k, v, nblocks, rows, nrows, ws, chunks);
}

// fold_state with its bits: its two exponentials as two lanes of exp_avx512 (exp_portable lane for lane),
// each weighted value as fold_state computes it (two products, then their sum), 16 at a time.
void fold(float m, float l, const float* acc, char* started, float* tml, float* tacc, int64_t d) {
  float a, b;
  const auto exp2 = [](float x, float y, float* ex, float* ey) {
    alignas(64) float e[16];
    _mm512_store_ps(e, exp_avx512(_mm512_setr_ps(x, y, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)));
    *ex = e[0];
    *ey = e[1];
  };
  if (!fold_scalars(m, l, acc, started, tml, tacc, d, exp2, &a, &b)) return;
  const __m512 va = _mm512_set1_ps(a), vb = _mm512_set1_ps(b);
  for (int64_t x = 0; x < d; x += 16)
    _mm512_storeu_ps(tacc + x, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(tacc + x), va),
                                             _mm512_mul_ps(_mm512_loadu_ps(acc + x), vb)));
}

// Accumulator c = 2*chunk + half holds, in lane l, dim 32*chunk + 8*(l/4) + 4*half + l%4 (the
// unpacklo/unpackhi order of 16-bit pairs).
inline int64_t stored_dim(int64_t c, int l) { return 32 * (c / 2) + 8 * (l / 4) + 4 * (c % 2) + l % 4; }

void finish(const RowState& st, int64_t d, float* out) {
  const float inv = 1.f / st.l;
  for (int64_t c = 0; c < d / 16; ++c)
    for (int l = 0; l < 16; ++l) out[stored_dim(c, l)] = st.acc[16 * c + l] * inv;
}

// Per row: its 32 scores, its 16 weight pairs (`FmaDot`: its 32 weights) and its rescale (padded to
// keep them aligned); and, for `run`, its lanes (`lane_space`).
size_t workspace(int64_t d, int nrows) {
  return std::max<size_t>(static_cast<size_t>(nrows) * (2 * kBlock) + nrows + 16,
                          lane_space_floats(d, (nrows + 15) / 16));
}

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

// From this many rows a run of blocks computes faster with rows across the lanes.
constexpr int kRunRows = 24;

bool block_kernel_avx512(int64_t d, BlockKernel* out) {
  if (!cpu_has_avx512_bf16() || (d != 64 && d != 128 && d != 256)) return false;
  const bool dot = avx512_bf16_dot_pays();
  if (dot)
    *out = {block<Bf16Dot>, finish, workspace, dequant, run<Bf16Dot>, kRunRows, fold};
  else
    *out = {block<FmaDot>, finish, workspace, dequant, run<FmaDot>, kRunRows, fold};
  return true;
}

}  // namespace spx

SPX_END

#endif  // __x86_64__
