// The avx2 path of the quantized linear layers: AVX2 with FMA and F16C (any x86 CPU since 2013).
//
// Lanes are output channels: a 32-byte register holds 8 channels x 4 inputs of one step, so
// VPMADDUBSW (unsigned codes x signed int8 activations, adjacent pairs summed into int16)
// against the step's 4 activation bytes broadcast leaves each channel's partial products in
// its own 32-bit lane, and no horizontal sum is ever needed. A 16-channel panel is two such
// halves. Partial sums stay in int16 as long as they provably fit (Q4K: 8 steps of
// 2 * 15 * 127; Q6K: 2 steps of 2 * 63 * 127), then VPMADDWD against ones widens them to the
// exact int32 dot product; Q8's byte codes would saturate VPMADDUBSW, so they are made signed
// (code - 128) and multiplied by magnitude and sign. The float epilogue is the reference's
// (qlinear.h), 8 channels an instruction.
#if defined(__x86_64__)

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>

#include "qlinear.h"
#include "target.h"

SPX_BEGIN_AVX2
#include "simd_avx2.h"
#include "tiles.h"

namespace spx {

namespace {

constexpr int kTile = 8;  // rows that share one unpacked weight group

// Keeps an accumulator in its register at this point: without it GCC reassociates a chain of
// integer adds into a tree, computes every product first and spills them to the stack.
inline void in_register(__m256i& v) { __asm__("" : "+x"(v)); }

// Weights stream from memory once per call; while a group's rows are computed the hardware
// prefetcher falls behind, so each group also asks for the bytes kPrefetch ahead into L2. A few
// lines at a time, spread over the loop: a burst of dozens (a whole Q5_K super-block at once)
// stalled one decode row behind its own prefetches.
constexpr int64_t kPrefetch = 9472;

inline void prefetch(const uint8_t* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch + off), _MM_HINT_T1);
}

// A group's share of its super-block's prefetch: sized once per call (a division per group would
// sit on the decode row's path), asked for as each group starts.
struct PrefetchShare {
  int64_t bytes;
  PrefetchShare(int64_t block_bytes, int64_t groups) : bytes((block_bytes + groups - 1) / groups) {}
  void operator()(const uint8_t* block, int64_t g) const { prefetch(block + bytes * g, bytes); }
  // The same share of `block` itself into L1 (block: the next super-block).
  void near(const uint8_t* block, int64_t g) const {
    for (int64_t off = bytes * g; off < bytes * (g + 1); off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(block + off), _MM_HINT_T0);
  }
};

inline __m256i bcast4(const int8_t* q) {
  int32_t v;
  std::memcpy(&v, q, 4);
  return _mm256_set1_epi32(v);
}

inline __m256 cvt_u8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 cvt_i8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 cvt_f16(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256i load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Group g's four steps of codes, half h, of the Q6K, Q3K, Q2K or table (q3_table) super-block at
// sb (q6_code in qlinear.h, less codes_zero's difference). Q6K: step s's high bits sit at bits
// 2s..2s+1 of hb; shifted to bits 4..5 they join the nibble. Q3K, Q2K: 16-bit shifts bring a field
// to the bottom of its byte, where bits from the other byte of the pair miss the mask; the table
// formats' 3-bit codes, so unpacked, index their table (one byte shuffle).
inline void q6k_codes(int64_t fmt, const uint8_t* sb, int g, int h, __m256i* w) {
  if (fmt == Q2K) {
    const __m256i v = load(sb + 320 + 64 * g + 32 * h);
#pragma GCC unroll 4
    for (int st = 0; st < 4; ++st) w[st] = _mm256_and_si256(_mm256_srli_epi16(v, 2 * st), _mm256_set1_epi8(3));
    return;
  }
  if (fmt == Q3K || q3_table(fmt)) {
    const uint8_t* pair = sb + q6_header(fmt) + 192 * (g / 2);
    const __m256i lo = load(pair + 64 * (g % 2) + 32 * h), hi = load(pair + 128 + 32 * h);
    const __m256i three = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
    for (int st = 0; st < 4; ++st) {
      const __m256i l = _mm256_and_si256(_mm256_srl_epi16(lo, _mm_cvtsi32_si128(2 * st)), three);
      // the high bit (bit hb of hi) shifted straight to bit 2: one shift and one mask
      const int hb = 4 * (g % 2) + st;
      const __m256i t = hb >= 2 ? _mm256_srl_epi16(hi, _mm_cvtsi32_si128(hb - 2)) : _mm256_sll_epi16(hi, _mm_cvtsi32_si128(2 - hb));
      w[st] = _mm256_or_si256(l, _mm256_and_si256(t, four));
      if (q3_table(fmt))
        w[st] = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(q3_table_bytes(fmt)))), w[st]);
    }
    return;
  }
  const uint8_t* cb = sb + 288 + 192 * g;
  const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
  const __m256i a = load(cb + 32 * h), b = load(cb + 64 + 32 * h), hb = load(cb + 128 + 32 * h);
  w[0] = _mm256_or_si256(_mm256_and_si256(a, low), _mm256_and_si256(_mm256_slli_epi16(hb, 4), top));
  w[1] = _mm256_or_si256(_mm256_and_si256(b, low), _mm256_and_si256(_mm256_slli_epi16(hb, 2), top));
  w[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), low), _mm256_and_si256(hb, top));
  w[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), low), _mm256_and_si256(_mm256_srli_epi16(hb, 2), top));
}

// A super-block's d, half h (channels 8h..8h+7): its f16 halves as floats, or its float32 (f32_d).
inline __m256 load_d(int64_t fmt, const uint8_t* sb, int h) {
  return f32_d(fmt) ? _mm256_loadu_ps(reinterpret_cast<const float*>(sb) + 8 * h) : cvt_f16(sb + 16 * h);
}

// Group g's float scales and (Q2K) minimums, half h (d, dmin: the super-block's halves h).
inline void q6k_scales(int64_t fmt, const uint8_t* sb, int g, int h, __m256 d, __m256 dmin, __m256* scale,
                       __m256* mins) {
  if (fmt != Q2K) {
    *scale = _mm256_mul_ps(d, cvt_i8(sb + q6_scales_at(fmt) + 16 * g + 8 * h));
    return;
  }
  const __m256i sm = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sb + 64 + 16 * g + 8 * h)));
  *scale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(sm, _mm256_set1_epi32(15))));
  *mins = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_srli_epi32(sm, 4)));
}


// int16 pairs summed into int32 lanes (exact).
inline __m256i widen(__m256i s) { return _mm256_madd_epi16(s, _mm256_set1_epi16(1)); }

// A 6-bit group's four steps' VPMADDUBSW products (int16, pairs of inputs) as one int32 sum: in one
// int16 sum where all four fit (int16_steps: Q3K's and Q2K's small codes, IQ1M's), two pairs (Q6K's
// 63s) or each step widened apart (IQ2XS's 86s).
template <int kSteps>
inline __m256i sum_steps(__m256i p0, __m256i p1, __m256i p2, __m256i p3) {
  if constexpr (kSteps == 1) {
    return _mm256_add_epi32(_mm256_add_epi32(widen(p0), widen(p1)), _mm256_add_epi32(widen(p2), widen(p3)));
  } else {
    __m256i s01 = _mm256_add_epi16(p0, p1), s23 = _mm256_add_epi16(p2, p3);
    in_register(s01);
    in_register(s23);
    return kSteps == 4 ? widen(_mm256_add_epi16(s01, s23)) : _mm256_add_epi32(widen(s01), widen(s23));
  }
}

// acc = fma(float(dot) * d8, scale, acc): the reference epilogue of one group, 8 channels.
inline __m256 epilogue(__m256i dot, float d8, __m256 scale, __m256 acc) {
  return _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d8)), scale, acc);
}

// One row's 16 accumulators in memory (the rows kernels): the epilogue of each half's dot
// products plus the integer correction c (exact in int32).
inline void epilogue_row(float* acc, const __m256i* dot, __m256i c, float d8, const __m256* scale) {
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h)
    _mm256_store_ps(acc + 8 * h, epilogue(_mm256_add_epi32(dot[h], c), d8, scale[h], _mm256_load_ps(acc + 8 * h)));
}

// NR rows' int16 sums of one group (2 registers a row) over its 8 steps; w: the unpacked codes.
template <int NR>
inline void q4k_sums(const __m256i (*w)[2], const int8_t* const* q, __m256i (*sum)[2]) {
  for (int j = 0; j < NR; ++j) sum[j][0] = sum[j][1] = _mm256_setzero_si256();
  for (int st = 0; st < 8; ++st) {
    const __m256i c0 = _mm256_load_si256(&w[st][0]), c1 = _mm256_load_si256(&w[st][1]);
    for (int j = 0; j < NR; ++j) {
      const __m256i a = bcast4(q[j] + 4 * st);
      sum[j][0] = _mm256_add_epi16(sum[j][0], _mm256_maddubs_epi16(c0, a));
      sum[j][1] = _mm256_add_epi16(sum[j][1], _mm256_maddubs_epi16(c1, a));
      in_register(sum[j][0]);
      in_register(sum[j][1]);
    }
  }
}

// The group's codes are unpacked once into `w` (L1) for all the tile's rows, which then run
// two at a time: their int16 sums (4 registers) share each code load.
template <int R>
void panel_q4k(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, __m256 (*acc)[2]) {
  const int64_t sbg = s.sbg, nsb = s.k / (32 * sbg), kb = s.k / 32, sb_bytes = 64 + 288 * sbg;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  alignas(32) __m256i w[8][2];  // [step][half]
  const PrefetchShare share(sb_bytes, sbg);
  for (int64_t sb = 0; sb < nsb; ++sb, p += sb_bytes) {
    const __m256 d[2] = {cvt_f16(p), cvt_f16(p + 16)}, dmin[2] = {cvt_f16(p + 32), cvt_f16(p + 48)};
    for (int g = 0; g < sbg; ++g) {
      const int64_t k0 = (sb * sbg + g) * 32;
      const uint8_t* cb = p + 64 + 32 * sbg + 256 * g;
      share(p, g);
      for (int i = 0; i < 4; ++i)
        for (int h = 0; h < 2; ++h) {
          const __m256i v = load(cb + 64 * i + 32 * h);
          w[i][h] = _mm256_and_si256(v, low);
          w[i + 4][h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
      __m256 scale[2], mins[2];
      for (int h = 0; h < 2; ++h) {
        scale[h] = _mm256_mul_ps(d[h], cvt_u8(p + 64 + 16 * g + 8 * h));
        mins[h] = _mm256_mul_ps(dmin[h], cvt_u8(p + 64 + 16 * sbg + 16 * g + 8 * h));
      }
      for (int r = 0; r < R; r += 2) {
        const int8_t* q[2] = {x.q8 + (r0 + r) * x.k + k0, x.q8 + (r0 + r + 1) * x.k + k0};
        __m256i sum[2][2];
        if (R - r >= 2) q4k_sums<2>(w, q, sum);
        else q4k_sums<1>(w, q, sum);
        for (int j = 0; j < 2 && r + j < R; ++j) {
          const int64_t b = (r0 + r + j) * kb + k0 / 32;
          const __m256 d8 = _mm256_set1_ps(x.d8[b]), xs = _mm256_set1_ps(x.xs[b]);
          for (int h = 0; h < 2; ++h) {
            const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(sum[j][h], ones)), d8);
            acc[r + j][h] = _mm256_fnmadd_ps(mins[h], xs, _mm256_fmadd_ps(t, scale[h], acc[r + j][h]));
          }
        }
      }
    }
  }
}

// NR rows' exact int32 dot products of one Q6K group of 16 inputs (its 4 steps), their int16
// products summed kSteps at a time (int16_steps) before VPMADDWD widens them.
template <int NR, int kSteps>
inline void q6k_dots(const __m256i (*w)[2], const int8_t* const* q, __m256i (*dot)[2]) {
  for (int j = 0; j < NR; ++j) {
    const __m256i a0 = bcast4(q[j]), a1 = bcast4(q[j] + 4), a2 = bcast4(q[j] + 8), a3 = bcast4(q[j] + 12);
    for (int h = 0; h < 2; ++h)
      dot[j][h] = sum_steps<kSteps>(_mm256_maddubs_epi16(w[0][h], a0), _mm256_maddubs_epi16(w[1][h], a1),
                                    _mm256_maddubs_epi16(w[2][h], a2), _mm256_maddubs_epi16(w[3][h], a3));
  }
}

template <int R>
void panel_q6k(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, __m256 (*acc)[2]) {
  const int64_t nsb = s.k / 256, kb = s.k / 32, k16 = s.k / 16, sb_bytes = s.fi().bytes;
  const int32_t zero = codes_zero(s.fmt);
  const int steps = int16_steps(s.fmt);
  alignas(32) __m256i w[4][2];  // [step][half]
  const PrefetchShare share(sb_bytes, 16);
  for (int64_t sb = 0; sb < nsb; ++sb, p += sb_bytes) {
    const __m256 d[2] = {load_d(s.fmt, p, 0), load_d(s.fmt, p, 1)}, dmin[2] = {cvt_f16(p + 32), cvt_f16(p + 48)};
    for (int g = 0; g < 16; ++g) {
      const int64_t k0 = sb * 256 + g * 16;
      share(p, g);
      __m256 scale[2], mins[2];
      for (int h = 0; h < 2; ++h) {
        __m256i c[4];
        q6k_codes(s.fmt, p, g, h, c);
        for (int st = 0; st < 4; ++st) w[st][h] = c[st];
        q6k_scales(s.fmt, p, g, h, d[h], dmin[h], &scale[h], &mins[h]);
      }
      for (int r = 0; r < R; r += 2) {
        const int8_t* q[2] = {x.q8 + (r0 + r) * x.k + k0, x.q8 + (r0 + r + 1) * x.k + k0};
        __m256i dot[2][2];
        // direct calls, each inlined (through a pointer they were not: 0.75x)
        if (R - r >= 2 && steps == 4) q6k_dots<2, 4>(w, q, dot);
        else if (R - r >= 2 && steps == 2) q6k_dots<2, 2>(w, q, dot);
        else if (R - r >= 2) q6k_dots<2, 1>(w, q, dot);
        else if (steps == 4) q6k_dots<1, 4>(w, q, dot);
        else if (steps == 2) q6k_dots<1, 2>(w, q, dot);
        else q6k_dots<1, 1>(w, q, dot);
        for (int j = 0; j < 2 && r + j < R; ++j) {
          const int64_t row = r0 + r + j;
          const __m256i off = _mm256_set1_epi32(zero * x.s16[row * k16 + k0 / 16]);
          const float d8 = x.d8[row * kb + k0 / 32];
          for (int h = 0; h < 2; ++h) acc[r + j][h] = epilogue(_mm256_sub_epi32(dot[j][h], off), d8, scale[h], acc[r + j][h]);
          if (s.fmt == Q2K)
            for (int h = 0; h < 2; ++h) acc[r + j][h] = _mm256_fnmadd_ps(mins[h], _mm256_set1_ps(q16_xs(x, row, k0)), acc[r + j][h]);
        }
      }
    }
  }
}

// NR rows' exact int32 dot products of one Q8 group: byte codes would saturate VPMADDUBSW, so
// the signed code - 128 multiplies by magnitude (unsigned) against the activation carrying its
// sign; pairs reach 2 * 128 * 127 and are widened at every step.
template <int NR>
inline void q8_dots(const __m256i (*w)[2][2], const int8_t* const* q, __m256i (*dot)[2]) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int j = 0; j < NR; ++j) dot[j][0] = dot[j][1] = _mm256_setzero_si256();
  for (int st = 0; st < 8; ++st)
    for (int j = 0; j < NR; ++j) {
      const __m256i a = bcast4(q[j] + 4 * st);
      for (int h = 0; h < 2; ++h) {
        const __m256i prod = _mm256_maddubs_epi16(w[st][h][1], _mm256_sign_epi8(a, w[st][h][0]));
        dot[j][h] = _mm256_add_epi32(dot[j][h], _mm256_madd_epi16(prod, ones));
        in_register(dot[j][h]);
      }
    }
}

// R rows' int16 sums of N steps from `st0` over one group's register-held unsigned codes (two
// registers a step, 8 channels each): one VPMADDUBSW per step, row and register, added in int16
// (the caller bounds the codes so N steps cannot overflow).
template <int R, int N>
inline void int16_sums(const __m256i (*w)[2], int st0, const int8_t* q, int64_t xk, __m256i (*sum)[2]) {
#pragma GCC unroll 8
  for (int i = 0; i < N; ++i) {
    const int st = st0 + i;
    const __m256i c0 = _mm256_load_si256(&w[st][0]), c1 = _mm256_load_si256(&w[st][1]);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256i a = bcast4(q + r * xk + 4 * st);
      const __m256i p0 = _mm256_maddubs_epi16(c0, a), p1 = _mm256_maddubs_epi16(c1, a);
      sum[r][0] = i ? _mm256_add_epi16(sum[r][0], p0) : p0;
      sum[r][1] = i ? _mm256_add_epi16(sum[r][1], p1) : p1;
      in_register(sum[r][0]);
      in_register(sum[r][1]);
    }
  }
}

// R rows' exact int32 dot products of one byte-code group whose codes ([step][half]) are below 32:
// dot(code, q), 4 steps a int16 sum (4 * 2 * 31 * 127 fits).
template <int R>
inline void q8_dots_small(const __m256i (*codes)[2], const int8_t* q, int64_t xk, __m256i (*dot)[2]) {
#pragma GCC unroll 2
  for (int half = 0; half < 2; ++half) {  // steps 4 * half .. 4 * half + 3
    __m256i sum[R][2];
    int16_sums<R, 4>(codes, 4 * half, q, xk, sum);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) {
        dot[r][h] = half ? _mm256_add_epi32(dot[r][h], widen(sum[r][h])) : widen(sum[r][h]);
        in_register(dot[r][h]);
      }
  }
}

// Step st's byte codes of a byte-code group at cb, half h (8 channels): byte_code (qlinear.h) on
// 32 lanes. 16-bit shifts move the fifth bit within its byte (st <= 4 left by 4 - st, else
// right): the bits crossing from the other byte of the pair miss the mask.
inline __m256i step_bytes(int64_t fmt, const uint8_t* cb, int st, int h) {
  if (fmt == Q8) return load(cb + 64 * st + 32 * h);
  const __m256i v = load(cb + 64 * (st % 4) + 32 * h);
  const __m256i nib = _mm256_and_si256(st < 4 ? v : _mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F));
  if (code_kind(fmt) == Q40) return nib;
  if (code_kind(fmt) == IQ4)
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(code_table(fmt)))),
                               nib);
  const __m256i plane = load(cb + 256 + 32 * h);
  const __m256i bit = st <= 4 ? _mm256_sll_epi16(plane, _mm_cvtsi32_si128(4 - st)) : _mm256_srl_epi16(plane, _mm_cvtsi32_si128(st - 4));
  return _mm256_or_si256(nib, _mm256_and_si256(bit, _mm256_set1_epi8(0x10)));
}

// 8 channels' E8M0 bytes at p as e8m0_half's floats (qlinear.h), the same bits from shifts:
// (e - 1) << 23, or 0x00200000 << e for e < 2.
inline __m256 e8m0_half8(const uint8_t* p) {
  const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i big = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
  const __m256i small = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
  const __m256i low = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
  return _mm256_castsi256_ps(_mm256_blendv_epi8(big, small, low));
}

// A byte-code group's float scales and minimums [half] (qlinear.h: d and dmin, each times its
// code where the format has codes); returns whether the format has minimums.
inline bool byte_scales(const Segment& s, const uint8_t* p, int g, __m256* scale, __m256* mins) {
  for (int h = 0; h < 2; ++h) {
    scale[h] = e8m0_header(s.fmt) ? e8m0_half8(p + 8 * h) : load_d(s.fmt, p, h);
    if (scale_codes(s.fmt)) scale[h] = _mm256_mul_ps(scale[h], cvt_i8(group_scales(s.fmt, p, g) + 8 * h));
    if (!has_minimum(s.fmt)) continue;
    mins[h] = cvt_f16(p + 32 + 16 * h);
    if (k_header(s.fmt)) mins[h] = _mm256_mul_ps(mins[h], cvt_u8(group_mins(s.sbg, p, g) + 8 * h));
  }
  return has_minimum(s.fmt);
}

// kSmall: Q5K, Q50, Q51, Q40 and Q41, whose codes are below 32 by their layout (small_codes), so they go
// into VPMADDUBSW as they are, 4 steps an int16 sum, as in the rows kernel's small groups; other
// byte codes take the sign trick.
template <int R, bool kSmall>
void panel_q8(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, __m256 (*acc)[2]) {
  const FormatInfo fi = s.fi();
  const int groups = fi.superblock / 32;
  const int64_t nsb = s.k / fi.superblock, kb = s.k / 32;
  const int32_t off = static_cast<int32_t>(s.offset);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  alignas(32) __m256i w[8][2][2];  // [step][half][code - 128, its magnitude]
  alignas(32) __m256i codes[8][2];  // [step][half]
  const PrefetchShare share(fi.bytes, groups);
  for (int64_t sb = 0; sb < nsb; ++sb, p += fi.bytes) {
    for (int g = 0; g < groups; ++g) {
      share(p, g);
      const uint8_t* cb = byte_codes(s.fmt, s.sbg, p, g);
      for (int st = 0; st < 8; ++st)
        for (int h = 0; h < 2; ++h) {
          if (kSmall) {
            codes[st][h] = step_bytes(s.fmt, cb, st, h);
          } else {
            w[st][h][0] = _mm256_xor_si256(step_bytes(s.fmt, cb, st, h), flip);
            w[st][h][1] = _mm256_abs_epi8(w[st][h][0]);
          }
        }
      __m256 scale[2], mins[2];
      const bool has_mins = byte_scales(s, p, g, scale, mins);
      const int64_t k0 = sb * fi.superblock + 32 * g;
      // sum(code * q) - offset * sum(q) = sum((code - 128) * q) + (128 - offset) * sum(q)
      const int32_t fix_q = kSmall ? -off : 128 - off;
      for (int r = 0; r < R; r += 2) {
        const int8_t* q[2] = {x.q8 + (r0 + r) * x.k + k0, x.q8 + (r0 + r + 1) * x.k + k0};
        __m256i dot[2][2];
        if (kSmall) {
          if (R - r >= 2) q8_dots_small<2>(codes, q[0], x.k, dot);
          else q8_dots_small<1>(codes, q[0], x.k, dot);
        } else if (R - r >= 2) {
          q8_dots<2>(w, q, dot);
        } else {
          q8_dots<1>(w, q, dot);
        }
        for (int j = 0; j < 2 && r + j < R; ++j) {
          const int64_t b = (r0 + r + j) * kb + k0 / 32;
          const __m256i fix = _mm256_set1_epi32(fix_q * x.s32[b]);
          for (int h = 0; h < 2; ++h) {
            acc[r + j][h] = epilogue(_mm256_add_epi32(dot[j][h], fix), x.d8[b], scale[h], acc[r + j][h]);
            if (has_mins) acc[r + j][h] = _mm256_fnmadd_ps(mins[h], _mm256_set1_ps(x.xs[b]), acc[r + j][h]);
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------- one row
//
// One row (a decode step) has no other rows to share an unpacked group with, so its codes go
// from the load to the multiply in registers: the tile's copy of each group into L1 and back
// would be a third of the instructions, and one row is bound by instructions on AVX2. The
// integer sums are exact in any order and the float epilogue is the tile's, so the bits are too.

void one_q4k(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, __m256* acc) {
  const int64_t sbg = s.sbg, nsb = s.k / (32 * sbg), kb = s.k / 32, sb_bytes = 64 + 288 * sbg;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int8_t* q = x.q8 + r0 * x.k;
  const float* d8 = x.d8 + r0 * kb;
  const float* xs = x.xs + r0 * kb;
  const PrefetchShare share(sb_bytes, sbg);
  for (int64_t sb = 0; sb < nsb; ++sb, p += sb_bytes) {
    const __m256 d[2] = {cvt_f16(p), cvt_f16(p + 16)}, dmin[2] = {cvt_f16(p + 32), cvt_f16(p + 48)};
    for (int g = 0; g < sbg; ++g) {
      const int64_t b = sb * sbg + g;
      const uint8_t* cb = p + 64 + 32 * sbg + 256 * g;
      const int8_t* qb = q + 32 * b;
      // Q4_K's 8-group super-blocks: the next one's share into L1, not 9.5 KB ahead into L2 (this
      // loop streams its weights near the memory's speed, and the near prefetch kept it there more
      // often: docs/log/2026-11-gguf-types.md). The next one-group super-block (Q4_0, Q4_1) is only 352 bytes
      // ahead, and that was not what was measured: those keep the far prefetch.
      if (sbg > 1) share.near(p + sb_bytes, g);
      else share(p, g);
      // Low nibbles are steps 0-3, high nibbles steps 4-7; two int16 sums a half keep the
      // chains short (each at most 4 * 2 * 15 * 127, their total at most 8 * 2 * 15 * 127).
      __m256i lo[2], hi[2];
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const __m256i a = bcast4(qb + 4 * i), a4 = bcast4(qb + 16 + 4 * i);
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m256i v = load(cb + 64 * i + 32 * h);
          const __m256i pl = _mm256_maddubs_epi16(_mm256_and_si256(v, low), a);
          const __m256i ph = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), a4);
          lo[h] = i ? _mm256_add_epi16(lo[h], pl) : pl;
          hi[h] = i ? _mm256_add_epi16(hi[h], ph) : ph;
          in_register(lo[h]);
          in_register(hi[h]);
        }
      }
      const __m256 dd = _mm256_set1_ps(d8[b]), xb = _mm256_set1_ps(xs[b]);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256 scale = _mm256_mul_ps(d[h], cvt_u8(p + 64 + 16 * g + 8 * h));
        const __m256 mins = _mm256_mul_ps(dmin[h], cvt_u8(p + 64 + 16 * sbg + 16 * g + 8 * h));
        const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_add_epi16(lo[h], hi[h]), ones)), dd);
        acc[h] = _mm256_fnmadd_ps(mins, xb, _mm256_fmadd_ps(t, scale, acc[h]));
      }
    }
  }
}

// Codes below 32 (small_codes: Q5K, Q50, Q51, Q40, Q41), so (as in the rows kernel's small groups) they go
// into VPMADDUBSW as they are, no sign trick, and 4 steps share one int16 sum (4 * 2 * 31 * 128);
// the two halves of the steps are widened apart (together they would not fit in int16).
template <int64_t FMT>
void one_small(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, __m256* acc) {
  const FormatInfo fi = s.fi();
  const int groups = fi.superblock / 32;
  const int64_t nsb = s.k / fi.superblock, kb = s.k / 32, sb_bytes = fi.bytes;
  const int32_t off = static_cast<int32_t>(s.offset);
  const int8_t* q = x.q8 + r0 * x.k;
  const PrefetchShare share(sb_bytes, groups);
  for (int64_t sb = 0; sb < nsb; ++sb, p += sb_bytes) {
    for (int g = 0; g < groups; ++g) {
      share(p, g);
      const int64_t b = r0 * kb + sb * groups + g;
      const uint8_t* cb = byte_codes(FMT, s.sbg, p, g);
      const int8_t* qb = q + 32 * (sb * groups + g);
      __m256i dot[2];
#pragma GCC unroll 2
      for (int half = 0; half < 2; ++half) {  // steps 4 * half .. 4 * half + 3
        __m256i sum[2];
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) {
          const int st = 4 * half + i;
          const __m256i a = bcast4(qb + 4 * st);
#pragma GCC unroll 2
          for (int h = 0; h < 2; ++h) {
            const __m256i pr = _mm256_maddubs_epi16(step_bytes(FMT, cb, st, h), a);
            sum[h] = i ? _mm256_add_epi16(sum[h], pr) : pr;
            in_register(sum[h]);
          }
        }
        for (int h = 0; h < 2; ++h) dot[h] = half ? _mm256_add_epi32(dot[h], widen(sum[h])) : widen(sum[h]);
      }
      __m256 scale[2], mins[2];
      byte_scales(s, p, g, scale, mins);
      // sum(code * q) - offset * sum(q); Q5_K's and Q5_1's offset is 0
      if (off != 0)
        for (int h = 0; h < 2; ++h) dot[h] = _mm256_add_epi32(dot[h], _mm256_set1_epi32(-off * x.s32[b]));
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        acc[h] = epilogue(dot[h], x.d8[b], scale[h], acc[h]);
        if constexpr (has_minimum(FMT)) acc[h] = _mm256_fnmadd_ps(mins[h], _mm256_set1_ps(x.xs[b]), acc[h]);
      }
    }
  }
}

// Q8 and IQ4 (any byte codes): the tile's arithmetic (codes - 128 with the sign trick, widened
// every step) with each step's codes multiplied as they are unpacked, never copied to L1.
template <int64_t FMT>
void one_bytes(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, __m256* acc) {
  const FormatInfo fi = s.fi();
  const int groups = fi.superblock / 32;
  const int64_t nsb = s.k / fi.superblock, kb = s.k / 32;
  const int32_t off = static_cast<int32_t>(s.offset);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  const int8_t* q = x.q8 + r0 * x.k;
  const PrefetchShare share(fi.bytes, groups);
  for (int64_t sb = 0; sb < nsb; ++sb, p += fi.bytes) {
    for (int g = 0; g < groups; ++g) {
      share(p, g);
      const int64_t b = r0 * kb + sb * groups + g;
      const uint8_t* cb = byte_codes(FMT, s.sbg, p, g);
      const int8_t* qb = q + 32 * (sb * groups + g);
      __m256i dot[2];
#pragma GCC unroll 8
      for (int st = 0; st < 8; ++st) {
        const __m256i a = bcast4(qb + 4 * st);
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m256i c = _mm256_xor_si256(step_bytes(FMT, cb, st, h), flip);
          const __m256i pr = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(c), _mm256_sign_epi8(a, c)), ones);
          dot[h] = st ? _mm256_add_epi32(dot[h], pr) : pr;
          in_register(dot[h]);
        }
      }
      __m256 scale[2], mins[2];
      const bool has_mins = byte_scales(s, p, g, scale, mins);
      // sum(code * q) - offset * sum(q) = sum((code - 128) * q) + (128 - offset) * sum(q)
      const __m256i fix = _mm256_set1_epi32((128 - off) * x.s32[b]);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        acc[h] = epilogue(_mm256_add_epi32(dot[h], fix), x.d8[b], scale[h], acc[h]);
        if (has_mins) acc[h] = _mm256_fnmadd_ps(mins[h], _mm256_set1_ps(x.xs[b]), acc[h]);
      }
    }
  }
}

// Each format compiled apart, its branches folded away.
template <int64_t FMT>
void one_q6k(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, __m256* acc) {
  constexpr bool kQ2 = FMT == Q2K;
  constexpr int32_t zero = codes_zero(FMT);
  const int64_t nsb = s.k / 256, kb = s.k / 32, k16 = s.k / 16, sb_bytes = s.fi().bytes;
  const int8_t* q = x.q8 + r0 * x.k;
  const PrefetchShare share(sb_bytes, 16);
  for (int64_t sb = 0; sb < nsb; ++sb, p += sb_bytes) {
    const __m256 d[2] = {load_d(FMT, p, 0), load_d(FMT, p, 1)};
    __m256 dmin[2] = {d[0], d[1]};
    if (kQ2) dmin[0] = cvt_f16(p + 32), dmin[1] = cvt_f16(p + 48);
#pragma GCC unroll 2
    for (int g = 0; g < 16; ++g) {
      const int64_t k0 = sb * 256 + g * 16;
      const int8_t* qb = q + k0;
      // Q6K reads the next super-block's share into L1, as one_q4k; Q3K and Q2K measured no
      // better with it and keep the far prefetch (docs/log/2026-11-gguf-types.md).
      if constexpr (FMT == Q6K) share.near(p + sb_bytes, g);
      else share(p, g);
      const __m256i a0 = bcast4(qb), a1 = bcast4(qb + 4), a2 = bcast4(qb + 8), a3 = bcast4(qb + 12);
      const __m256i off = _mm256_set1_epi32(zero * x.s16[r0 * k16 + k0 / 16]);
      const float d8 = x.d8[r0 * kb + k0 / 32];
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        __m256i w[4];  // the codes go straight into the multiply
        q6k_codes(FMT, p, g, h, w);
        __m256i dot = sum_steps<int16_steps(FMT)>(_mm256_maddubs_epi16(w[0], a0), _mm256_maddubs_epi16(w[1], a1),
                                                  _mm256_maddubs_epi16(w[2], a2), _mm256_maddubs_epi16(w[3], a3));
        if (zero != 0) dot = _mm256_sub_epi32(dot, off);
        __m256 scale, mins;
        q6k_scales(FMT, p, g, h, d[h], dmin[h], &scale, &mins);
        acc[h] = epilogue(dot, d8, scale, acc[h]);
        if (kQ2) acc[h] = _mm256_fnmadd_ps(mins, _mm256_set1_ps(q16_xs(x, r0, k0)), acc[h]);
      }
    }
  }
}

template <int R>
void tile(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, const TileOut& out) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  if constexpr (R == 1) {
    if (s.fmt == Q4K) one_q4k(s, p, x, r0, acc[0]);
    else if (s.fmt == Q5K) one_small<Q5K>(s, p, x, r0, acc[0]);
    else if (s.fmt == Q50) one_small<Q50>(s, p, x, r0, acc[0]);
    else if (s.fmt == Q40) one_small<Q40>(s, p, x, r0, acc[0]);
    else if (s.fmt == Q41) one_small<Q41>(s, p, x, r0, acc[0]);
    else if (s.fmt == Q51) one_small<Q51>(s, p, x, r0, acc[0]);
    else if (s.fmt == Q8) one_bytes<Q8>(s, p, x, r0, acc[0]);
    else if (s.fmt == IQ4) one_bytes<IQ4>(s, p, x, r0, acc[0]);
    else if (s.fmt == IQ3S) one_bytes<IQ3S>(s, p, x, r0, acc[0]);
    else if (s.fmt == IQ3XXS) one_bytes<IQ3XXS>(s, p, x, r0, acc[0]);
    else if (s.fmt == IQ2XXS) one_bytes<IQ2XXS>(s, p, x, r0, acc[0]);
    else if (s.fmt == IQ1S) one_bytes<IQ1S>(s, p, x, r0, acc[0]);
    else if (s.fmt == IQ4NL) one_bytes<IQ4NL>(s, p, x, r0, acc[0]);
    else if (s.fmt == MXFP4) one_bytes<MXFP4>(s, p, x, r0, acc[0]);
    else if (s.fmt == Q6K) one_q6k<Q6K>(s, p, x, r0, acc[0]);
    else if (s.fmt == Q3K) one_q6k<Q3K>(s, p, x, r0, acc[0]);
    else if (s.fmt == Q2K) one_q6k<Q2K>(s, p, x, r0, acc[0]);
    else if (s.fmt == IQ2XS) one_q6k<IQ2XS>(s, p, x, r0, acc[0]);
    else if (s.fmt == IQ1M) one_q6k<IQ1M>(s, p, x, r0, acc[0]);
    else panel_q8<1, false>(s, p, x, r0, acc);
  } else {
    switch (s.fmt) {
      case Q4K: panel_q4k<R>(s, p, x, r0, acc); break;
      case Q6K:
      case Q3K:
      case Q2K:
      case IQ2XS:
      case IQ1M: panel_q6k<R>(s, p, x, r0, acc); break;
      default:
        if (small_codes(s.fmt)) panel_q8<R, true>(s, p, x, r0, acc);
        else panel_q8<R, false>(s, p, x, r0, acc);
        break;
    }
  }
  for (int h = 0; h < 2; ++h) {
    const __m256 b = out.bias ? _mm256_loadu_ps(out.bias + 8 * h) : _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) {
      __m256 y = _mm256_add_ps(acc[r][h], b);
      if (out.residual) y = _mm256_add_ps(_mm256_loadu_ps(out.residual + (r0 + r) * out.ldo + 8 * h), y);
      _mm256_storeu_ps(out.y + (r0 + r) * out.ldo + 8 * h, y);
    }
  }
}

// ---------------------------------------------------------------- many rows
//
// One panel times any number of rows (up to kRowBlock): each weight group is unpacked once into
// an L1 buffer and applied to every row, the rows taken a few at a time so that each step of
// codes loaded from the buffer serves all the rows of a tile; the rows' float accumulators live
// in `acc` (L1) between groups. A group's 16 unpacked registers do not fit beside any rows in
// 16 ymm, so the tile above keeps them in L1 too but decodes the panel again for every tile.
// Per row and group the work is the int8 products plus the reference epilogue; the weight
// decoding is paid once per group however many rows there are.

// Rows of a tile: 2 int16 sums a row beside 2 registers of codes and an activation (Q4K, Q6K, and
// byte codes below 32, measured faster at 4 rows than at 3);
// other byte codes' magnitudes and signs take 4 registers a step, so their tiles have 3 rows.
constexpr int kRowTile = 4;
constexpr int kQ8RowTile = 3;

// Tiles of at most T rows, as even as possible (9 rows, T = 4: 3 + 3 + 3; 10 rows: 3 + 3 + 4):
// calls f(row, rows). One division a call, not one a tile: the rows kernels call this for every
// weight group.
template <int T, class F>
inline void for_tiles(int n, F&& f) {
  const int tiles = (n + T - 1) / T, base = n / tiles, first_larger = tiles - (n - base * tiles);
  for (int t = 0, r = 0; t < tiles; ++t) {
    const int rows = base + (t >= first_larger);
    f(r, rows);
    r += rows;
  }
}

// Rows [r0, r0 + n) of a panel's sums (acc: 16 floats a row) + bias (+ residual) into out.
inline void store_rows(const float* acc, int64_t r0, int n, const TileOut& out) {
  for (int h = 0; h < 2; ++h) {
    const __m256 b = out.bias ? _mm256_loadu_ps(out.bias + 8 * h) : _mm256_setzero_ps();
    for (int r = 0; r < n; ++r) {
      __m256 y = _mm256_add_ps(_mm256_load_ps(acc + 16 * r + 8 * h), b);
      if (out.residual) y = _mm256_add_ps(_mm256_loadu_ps(out.residual + (r0 + r) * out.ldo + 8 * h), y);
      _mm256_storeu_ps(out.y + (r0 + r) * out.ldo + 8 * h, y);
    }
  }
}

// A Q4K group's unpacked codes [step][half], its float scales and mins [half].
struct alignas(32) Q4Group {
  __m256i w[8][2];
  __m256 scale[2], mins[2];
};

inline void unpack_q4k_group(const uint8_t* p, int64_t sbg, int g, const __m256* d, const __m256* dmin, Q4Group& o) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const uint8_t* cb = p + 64 + 32 * sbg + 256 * g;
  for (int i = 0; i < 4; ++i)
    for (int h = 0; h < 2; ++h) {
      const __m256i v = load(cb + 64 * i + 32 * h);
      _mm256_store_si256(&o.w[i][h], _mm256_and_si256(v, low));
      _mm256_store_si256(&o.w[i + 4][h], _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
    }
  for (int h = 0; h < 2; ++h) {
    o.scale[h] = _mm256_mul_ps(d[h], cvt_u8(p + 64 + 16 * g + 8 * h));
    o.mins[h] = _mm256_mul_ps(dmin[h], cvt_u8(p + 64 + 16 * sbg + 16 * g + 8 * h));
  }
}

// R rows of one Q4K group: q, d8, xs at the tile's first row (row strides xk, kb).
template <int R>
inline void q4k_tile_rows(const Q4Group& g, const int8_t* q, int64_t xk, const float* d8, const float* xs, int64_t kb,
                          float* acc) {
  __m256i sum[R][2];
  int16_sums<R, 8>(g.w, 0, q, xk, sum);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m256 dd = _mm256_set1_ps(d8[r * kb]), x = _mm256_set1_ps(xs[r * kb]);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(widen(sum[r][h])), dd);
      const __m256 a = _mm256_fmadd_ps(t, g.scale[h], _mm256_load_ps(acc + 16 * r + 8 * h));
      _mm256_store_ps(acc + 16 * r + 8 * h, _mm256_fnmadd_ps(g.mins[h], x, a));
    }
  }
}

void rows_q4k(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int n, float* acc) {
  const int64_t sbg = s.sbg, nsb = s.k / (32 * sbg), sb_bytes = 64 + 288 * sbg, kb = x.k / 32;
  constexpr int64_t xk = 32;  // the group-major rows' stride
  Q4Group grp;
  for (int64_t sb = 0; sb < nsb; ++sb, p += sb_bytes) {
    const __m256 d[2] = {cvt_f16(p), cvt_f16(p + 16)}, dmin[2] = {cvt_f16(p + 32), cvt_f16(p + 48)};
    prefetch(p, sb_bytes);
    for (int g = 0; g < sbg; ++g) {
      const int64_t k0 = (sb * sbg + g) * 32;
      unpack_q4k_group(p, sbg, g, d, dmin, grp);
      const int8_t* q = group_rows(x, r0, k0);
      const float* d8 = x.d8 + r0 * kb + k0 / 32;
      const float* xs = x.xs + r0 * kb + k0 / 32;
      for_tiles<kRowTile>(n, [&](int r, int rows) {
        switch (rows) {
          case 1: q4k_tile_rows<1>(grp, q + r * xk, xk, d8 + r * kb, xs + r * kb, kb, acc + 16 * r); break;
          case 2: q4k_tile_rows<2>(grp, q + r * xk, xk, d8 + r * kb, xs + r * kb, kb, acc + 16 * r); break;
          case 3: q4k_tile_rows<3>(grp, q + r * xk, xk, d8 + r * kb, xs + r * kb, kb, acc + 16 * r); break;
          default: q4k_tile_rows<kRowTile>(grp, q + r * xk, xk, d8 + r * kb, xs + r * kb, kb, acc + 16 * r); break;
        }
      });
    }
  }
}

// A Q6K group of 16 inputs: codes [step][half] (6 bits, unsigned), float scales and (Q2K)
// minimums [half], the zero point.
struct alignas(32) Q6Group {
  __m256i w[4][2];
  __m256 scale[2], mins[2];
  int32_t zero;
};

inline void unpack_q6k_group(int64_t fmt, const uint8_t* p, int g, const __m256* d, const __m256* dmin, Q6Group& o) {
  for (int h = 0; h < 2; ++h) {
    __m256i c[4];
    q6k_codes(fmt, p, g, h, c);
    for (int st = 0; st < 4; ++st) _mm256_store_si256(&o.w[st][h], c[st]);
    q6k_scales(fmt, p, g, h, d[h], dmin[h], &o.scale[h], &o.mins[h]);
  }
  o.zero = codes_zero(fmt);
}

// R rows of one group of format FMT: Q6K's pairs of steps share an int16 sum (2 * 2 * 63 * 127
// fits), widened to int32 before the next pair; Q3K's, Q2K's and IQ1M's smaller codes keep all 4
// steps in one, IQ2XS's larger ones widen each step (int16_steps).
template <int R, int64_t FMT>
inline void q6k_tile_rows(const Q6Group& g, const int8_t* q, int64_t xk, const int32_t* s16, int64_t k16,
                          const float* d8, int64_t kb, float* acc) {
  constexpr bool kQ2 = FMT == Q2K, kOne = int16_steps(FMT) == 4, kEach = int16_steps(FMT) == 1;
  __m256i dot[R][2], sum[R][2];
#pragma GCC unroll 2
  for (int pr = 0; pr < 2; ++pr) {
    const __m256i c00 = _mm256_load_si256(&g.w[2 * pr][0]), c01 = _mm256_load_si256(&g.w[2 * pr][1]);
    const __m256i c10 = _mm256_load_si256(&g.w[2 * pr + 1][0]), c11 = _mm256_load_si256(&g.w[2 * pr + 1][1]);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256i a0 = bcast4(q + r * xk + 8 * pr), a1 = bcast4(q + r * xk + 8 * pr + 4);
      const __m256i p00 = _mm256_maddubs_epi16(c00, a0), p10 = _mm256_maddubs_epi16(c10, a1);
      const __m256i p01 = _mm256_maddubs_epi16(c01, a0), p11 = _mm256_maddubs_epi16(c11, a1);
      if (kEach) {
        const __m256i e0 = _mm256_add_epi32(widen(p00), widen(p10)), e1 = _mm256_add_epi32(widen(p01), widen(p11));
        dot[r][0] = pr ? _mm256_add_epi32(dot[r][0], e0) : e0;
        dot[r][1] = pr ? _mm256_add_epi32(dot[r][1], e1) : e1;
        continue;
      }
      __m256i s0 = _mm256_add_epi16(p00, p10), s1 = _mm256_add_epi16(p01, p11);
      in_register(s0);
      in_register(s1);
      if (kOne) {
        sum[r][0] = pr ? _mm256_add_epi16(sum[r][0], s0) : s0;
        sum[r][1] = pr ? _mm256_add_epi16(sum[r][1], s1) : s1;
        continue;
      }
      dot[r][0] = pr ? _mm256_add_epi32(dot[r][0], widen(s0)) : widen(s0);
      dot[r][1] = pr ? _mm256_add_epi32(dot[r][1], widen(s1)) : widen(s1);
      in_register(dot[r][0]);
      in_register(dot[r][1]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    if (!kQ2) {
      if (kOne) dot[r][0] = widen(sum[r][0]), dot[r][1] = widen(sum[r][1]);
      epilogue_row(acc + 16 * r, dot[r], _mm256_set1_epi32(-g.zero * s16[r * k16]), d8[r * kb], g.scale);
      continue;
    }
    // no zero point; then the minimum term with q16_xs, d8 x the group's code sum
    const __m256 xs = _mm256_set1_ps(d8[r * kb] * static_cast<float>(s16[r * k16]));
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256 a = epilogue(widen(sum[r][h]), d8[r * kb], g.scale[h], _mm256_load_ps(acc + 16 * r + 8 * h));
      _mm256_store_ps(acc + 16 * r + 8 * h, _mm256_fnmadd_ps(g.mins[h], xs, a));
    }
  }
}

void rows_q6k(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int n, float* acc) {
  const int64_t nsb = s.k / 256, kb = x.k / 32, k16 = x.k / 16, sb_bytes = s.fi().bytes, gb = sb_bytes / 16;
  constexpr int64_t xk = 32;  // the group-major rows' stride
  Q6Group grp;
  for (int64_t sb = 0; sb < nsb; ++sb, p += sb_bytes) {
    const __m256 d[2] = {load_d(s.fmt, p, 0), load_d(s.fmt, p, 1)}, dmin[2] = {cvt_f16(p + 32), cvt_f16(p + 48)};
    for (int g = 0; g < 16; ++g) {
      const int64_t k0 = sb * 256 + g * 16;
      if (g % 4 == 0) prefetch(p + gb * g, 4 * gb);
      unpack_q6k_group(s.fmt, p, g, d, dmin, grp);
      const int8_t* q = group_rows(x, r0, k0);
      const int32_t* s16 = x.s16 + r0 * k16 + k0 / 16;
      const float* d8 = x.d8 + r0 * kb + k0 / 32;
      auto tiles = [&](auto fmt) {  // each format compiled apart
        constexpr int64_t F = decltype(fmt)::value;
        for_tiles<kRowTile>(n, [&](int r, int rows) {
          const int64_t o = r * kb, o16 = r * k16;
          switch (rows) {
            case 1: q6k_tile_rows<1, F>(grp, q + r * xk, xk, s16 + o16, k16, d8 + o, kb, acc + 16 * r); break;
            case 2: q6k_tile_rows<2, F>(grp, q + r * xk, xk, s16 + o16, k16, d8 + o, kb, acc + 16 * r); break;
            case 3: q6k_tile_rows<3, F>(grp, q + r * xk, xk, s16 + o16, k16, d8 + o, kb, acc + 16 * r); break;
            default: q6k_tile_rows<kRowTile, F>(grp, q + r * xk, xk, s16 + o16, k16, d8 + o, kb, acc + 16 * r); break;
          }
        });
      };
      if (s.fmt == Q2K) tiles(std::integral_constant<int64_t, Q2K>{});
      else if (s.fmt == Q3K) tiles(std::integral_constant<int64_t, Q3K>{});
      else if (s.fmt == IQ2XS) tiles(std::integral_constant<int64_t, IQ2XS>{});
      else if (s.fmt == IQ1M) tiles(std::integral_constant<int64_t, IQ1M>{});
      else tiles(std::integral_constant<int64_t, Q6K>{});
    }
  }
}

// A byte-code group [step][half]: codes - 128 (signed, for their sign) and their magnitudes, as
// the tile's; `small` when every code is below 32 (Q5_0's and Q5_K's grids), whose products
// then keep 4 steps in one int16 sum (2 * 31 * 127 per pair) and the codes serve as they are (in
// `mag`). Float scales and (Q4K's header) minimums [half].
struct alignas(32) Q8Group {
  __m256i sgn[8][2], mag[8][2];
  __m256 scale[2], mins[2];
  bool small, has_mins;
};

inline void unpack_q8_group(const Segment& s, const uint8_t* p, int g, Q8Group& o) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const uint8_t* cb = byte_codes(s.fmt, s.sbg, p, g);
  __m256i any = _mm256_setzero_si256();
  for (int st = 0; st < 8; ++st)
    for (int h = 0; h < 2; ++h) {
      const __m256i v = step_bytes(s.fmt, cb, st, h);
      _mm256_store_si256(&o.mag[st][h], v);
      any = _mm256_or_si256(any, v);
    }
  o.small = _mm256_testz_si256(any, _mm256_set1_epi8(static_cast<char>(0xE0))) != 0;
  if (!o.small)
    for (int st = 0; st < 8; ++st)
      for (int h = 0; h < 2; ++h) {
        const __m256i c = _mm256_xor_si256(_mm256_load_si256(&o.mag[st][h]), flip);
        _mm256_store_si256(&o.sgn[st][h], c);
        _mm256_store_si256(&o.mag[st][h], _mm256_abs_epi8(c));
      }
  o.has_mins = byte_scales(s, p, g, o.scale, o.mins);
}

// R rows' exact int32 dot products of one Q8 group (any byte codes): dot(code - 128, q), the
// magnitude against q carrying the code's sign, widened at every step (pairs reach 2 * 128 * 127).
template <int R>
inline void q8_dots_any(const Q8Group& g, const int8_t* q, int64_t xk, __m256i (*dot)[2]) {
  const __m256i ones = _mm256_set1_epi16(1);
#pragma GCC unroll 8
  for (int st = 0; st < 8; ++st) {
    const __m256i s0 = _mm256_load_si256(&g.sgn[st][0]), s1 = _mm256_load_si256(&g.sgn[st][1]);
    const __m256i m0 = _mm256_load_si256(&g.mag[st][0]), m1 = _mm256_load_si256(&g.mag[st][1]);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256i a = bcast4(q + r * xk + 4 * st);
      const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(m0, _mm256_sign_epi8(a, s0)), ones);
      const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(m1, _mm256_sign_epi8(a, s1)), ones);
      dot[r][0] = st ? _mm256_add_epi32(dot[r][0], p0) : p0;
      dot[r][1] = st ? _mm256_add_epi32(dot[r][1], p1) : p1;
      in_register(dot[r][0]);
      in_register(dot[r][1]);
    }
  }
}

// R rows' epilogues of one byte-code group, each accumulator loaded and stored once: the dot
// products plus the integer correction fix * s32 (kFix), the reference epilogue, and the minimum
// term (kMins). The same operations in the same order as epilogue_row and a second pass for the
// minimums, so the same bits; a correction of zero added nothing.
template <int R, bool kFix, bool kMins>
inline void q8_epilogue_rows(const __m256i (*dot)[2], int32_t fix, const int32_t* s32, const float* d8,
                             const float* xs, int64_t kb, const Q8Group& g, float* acc) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m256i c = _mm256_set1_epi32(kFix ? fix * s32[r * kb] : 0);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      __m256 a = epilogue(kFix ? _mm256_add_epi32(dot[r][h], c) : dot[r][h], d8[r * kb], g.scale[h],
                          _mm256_load_ps(acc + 16 * r + 8 * h));
      if (kMins) a = _mm256_fnmadd_ps(g.mins[h], _mm256_set1_ps(xs[r * kb]), a);
      _mm256_store_ps(acc + 16 * r + 8 * h, a);
    }
  }
}

// R rows of one byte-code group: q, s32, d8, xs at the tile's first row (row strides xk, kb).
template <int R>
inline void q8_tile_rows(const Q8Group& g, int32_t off, const int8_t* q, int64_t xk, const int32_t* s32,
                         const float* d8, const float* xs, int64_t kb, float* acc) {
  __m256i dot[R][2];
  // sum(code * q) - offset * sum(q) = sum((code - 128) * q) + (128 - offset) * sum(q)
  const int32_t fix = g.small ? -off : 128 - off;
  if (g.small) q8_dots_small<R>(g.mag, q, xk, dot);
  else q8_dots_any<R>(g, q, xk, dot);
  if (fix == 0) {  // Q5K, and codes offset by 128 (Q8_0, IQ4): no correction to add
    if (g.has_mins) q8_epilogue_rows<R, false, true>(dot, 0, s32, d8, xs, kb, g, acc);
    else q8_epilogue_rows<R, false, false>(dot, 0, s32, d8, xs, kb, g, acc);
  } else {
    if (g.has_mins) q8_epilogue_rows<R, true, true>(dot, fix, s32, d8, xs, kb, g, acc);
    else q8_epilogue_rows<R, true, false>(dot, fix, s32, d8, xs, kb, g, acc);
  }
}

void rows_q8(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int n, float* acc) {
  const FormatInfo fi = s.fi();
  const int groups = fi.superblock / 32;
  const int64_t nsb = s.k / fi.superblock, kb = x.k / 32;
  constexpr int64_t xk = 32;  // the group-major rows' stride
  const int32_t off = static_cast<int32_t>(s.offset);
  Q8Group grp;
  for (int64_t sb = 0; sb < nsb; ++sb, p += fi.bytes) {
    prefetch(p, fi.bytes);
    for (int g = 0; g < groups; ++g) {
      unpack_q8_group(s, p, g, grp);
      const int64_t b0 = r0 * kb + sb * groups + g;
      const int8_t* q = group_rows(x, r0, 32 * (sb * groups + g));
      const int32_t* s32 = x.s32 + b0;
      const float *d8 = x.d8 + b0, *xs = x.xs + b0;
      if (grp.small) {  // codes below 32: no sign trick, room for a 4th row
        for_tiles<kRowTile>(n, [&](int r, int rows) {
          const int64_t o = r * kb;
          switch (rows) {
            case 1: q8_tile_rows<1>(grp, off, q + r * xk, xk, s32 + o, d8 + o, xs + o, kb, acc + 16 * r); break;
            case 2: q8_tile_rows<2>(grp, off, q + r * xk, xk, s32 + o, d8 + o, xs + o, kb, acc + 16 * r); break;
            case 3: q8_tile_rows<3>(grp, off, q + r * xk, xk, s32 + o, d8 + o, xs + o, kb, acc + 16 * r); break;
            default: q8_tile_rows<kRowTile>(grp, off, q + r * xk, xk, s32 + o, d8 + o, xs + o, kb, acc + 16 * r); break;
          }
        });
        continue;
      }
      for_tiles<kQ8RowTile>(n, [&](int r, int rows) {
        const int64_t o = r * kb;
        switch (rows) {
          case 1: q8_tile_rows<1>(grp, off, q + r * xk, xk, s32 + o, d8 + o, xs + o, kb, acc + 16 * r); break;
          case 2: q8_tile_rows<2>(grp, off, q + r * xk, xk, s32 + o, d8 + o, xs + o, kb, acc + 16 * r); break;
          default: q8_tile_rows<kQ8RowTile>(grp, off, q + r * xk, xk, s32 + o, d8 + o, xs + o, kb, acc + 16 * r); break;
        }
      });
    }
  }
}

// ---------------------------------------------------------------- float weights
//
// F16 and BF16 (qlinear.h): lanes are channels, so each fma is one step of 8 channels' chains and
// no sum ever crosses lanes. One row converts each weight as it streams it into its four chains
// (even and odd inputs, two halves); more rows convert a block of inputs once into an L1 buffer
// and run tiles of rows over it, each weight load serving every row of the tile.

// 8 channels of one input as float32 (exact): F16C, or BF16's bits moved to the top of a float.
template <int64_t FMT>
inline __m256 float_w(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (FMT == F16) return _mm256_cvtph_ps(v);
  else return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

template <int64_t FMT>
void one_float(const Segment& s, const uint8_t* p, const float* x, float* sum) {  // float_sums' V::one
  __m256 e[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, o[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t i = 0; i < s.k; i += 2, p += 64) {
    if (i % 8 == 0) prefetch(p, 256);
    const __m256 a = _mm256_broadcast_ss(x + i), b = _mm256_broadcast_ss(x + i + 1);
    e[0] = _mm256_fmadd_ps(float_w<FMT>(p), a, e[0]);
    e[1] = _mm256_fmadd_ps(float_w<FMT>(p + 16), a, e[1]);
    o[0] = _mm256_fmadd_ps(float_w<FMT>(p + 32), b, o[0]);
    o[1] = _mm256_fmadd_ps(float_w<FMT>(p + 48), b, o[1]);
  }
  for (int h = 0; h < 2; ++h) _mm256_store_ps(sum + 8 * h, _mm256_add_ps(e[h], o[h]));
}

// One row over two adjacent panels at once: each panel's chains and order exactly as one_float's
// (the same bits), but two weight streams in flight per core. One stream, even with software
// prefetches ahead of it, reads below the core's share of the memory bandwidth; the hardware
// prefetchers run two streams side by side, and a software prefetch beside them only competes
// for the same miss buffers, so this loop asks for none.
template <int64_t FMT>
void pair_float(const Segment& s, const uint8_t* p, const float* x, float* sum_a, float* sum_b) {
  const uint8_t* q = p + s.panel_bytes();
  __m256 e[2][2], o[2][2];  // [panel][half]
  for (int j = 0; j < 2; ++j)
    for (int h = 0; h < 2; ++h) e[j][h] = o[j][h] = _mm256_setzero_ps();
  for (int64_t i = 0; i < s.k; i += 2, p += 64, q += 64) {
    const __m256 a = _mm256_broadcast_ss(x + i), b = _mm256_broadcast_ss(x + i + 1);
    e[0][0] = _mm256_fmadd_ps(float_w<FMT>(p), a, e[0][0]);
    e[0][1] = _mm256_fmadd_ps(float_w<FMT>(p + 16), a, e[0][1]);
    o[0][0] = _mm256_fmadd_ps(float_w<FMT>(p + 32), b, o[0][0]);
    o[0][1] = _mm256_fmadd_ps(float_w<FMT>(p + 48), b, o[0][1]);
    e[1][0] = _mm256_fmadd_ps(float_w<FMT>(q), a, e[1][0]);
    e[1][1] = _mm256_fmadd_ps(float_w<FMT>(q + 16), a, e[1][1]);
    o[1][0] = _mm256_fmadd_ps(float_w<FMT>(q + 32), b, o[1][0]);
    o[1][1] = _mm256_fmadd_ps(float_w<FMT>(q + 48), b, o[1][1]);
  }
  for (int h = 0; h < 2; ++h) {
    _mm256_store_ps(sum_a + 8 * h, _mm256_add_ps(e[0][h], o[0][h]));
    _mm256_store_ps(sum_b + 8 * h, _mm256_add_ps(e[1][h], o[1][h]));
  }
}

// R rows of one converted block (w: [len][16] floats): part[r] holds row r's even and odd chains.
template <int R>
inline void float_tile_rows(const float* w, int len, const float* x, int64_t xk, float (*part)[2][16]) {
  __m256 c[R][2][2];  // [row][even, odd][half]
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 2; ++j)
      for (int h = 0; h < 2; ++h) c[r][j][h] = _mm256_load_ps(part[r][j] + 8 * h);
  for (int i = 0; i < len; i += 2) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
      for (int j = 0; j < 2; ++j) {
        const __m256 a = _mm256_broadcast_ss(x + r * xk + i + j);
        c[r][j][0] = _mm256_fmadd_ps(_mm256_load_ps(w + 16 * (i + j)), a, c[r][j][0]);
        c[r][j][1] = _mm256_fmadd_ps(_mm256_load_ps(w + 16 * (i + j) + 8), a, c[r][j][1]);
      }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 2; ++j)
      for (int h = 0; h < 2; ++h) _mm256_store_ps(part[r][j] + 8 * h, c[r][j][h]);
}

// float_sums' pieces (qlinear.h) for format FMT.
template <int64_t FMT>
struct FloatAvx2 {
  static void one(const Segment& s, const uint8_t* p, const float* x, float* sum) { one_float<FMT>(s, p, x, sum); }
  static void convert(const uint8_t* p, int len, float* w) {
    for (int i = 0; i < len; ++i, p += 32) {
      _mm256_store_ps(w + 16 * i, float_w<FMT>(p));
      _mm256_store_ps(w + 16 * i + 8, float_w<FMT>(p + 16));
    }
  }
  static void tiles(const float* w, int len, const float* x, int64_t xk, float (*part)[2][16], int n) {
    for_tiles<3>(n, [&](int r, int rows) {
      switch (rows) {
        case 1: float_tile_rows<1>(w, len, x + r * xk, xk, part + r); break;
        case 2: float_tile_rows<2>(w, len, x + r * xk, xk, part + r); break;
        default: float_tile_rows<3>(w, len, x + r * xk, xk, part + r); break;
      }
    });
  }
};

// A full panel of a float format times rows [r0, r0 + n), n <= kRowBlock, written to out.
void float_panel(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int n, const TileOut& out) {
  alignas(32) float sum[kRowBlock * 16];
  (s.fmt == BF16 ? float_sums<FloatAvx2<BF16>> : float_sums<FloatAvx2<F16>>)(s, p, x, r0, n, sum);
  store_rows(sum, r0, n, out);
}

const auto kTiles = count_table<kTile>([](auto R) { return &tile<R>; });  // kTiles[rows - 1]

}  // namespace

int tile_rows_avx2() { return kTile; }

// Full panels only (the driver runs a partial one portable).
void tile_avx2(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int rows, const TileOut& out) {
  if (float_format(s.fmt)) return float_panel(s, p, x, r0, rows, out);
  kTiles[rows - 1](s, p, x, r0, out);
}

void float_pair_avx2(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, const TileOut& a,
                     const TileOut& b) {
  alignas(32) float sum_a[16], sum_b[16];
  (s.fmt == BF16 ? pair_float<BF16> : pair_float<F16>)(s, p, x.xf + r0 * x.k, sum_a, sum_b);
  store_rows(sum_a, r0, 1, a);
  store_rows(sum_b, r0, 1, b);
}

// Up to 8 rows one tile decodes each group once and keeps the accumulators in registers (in the
// model it beat the rows kernel at 4 rows); from 9 tiles would decode every group twice.
int rows_from_avx2() { return 9; }

// Full panels only, n <= kRowBlock rows; acc: kRowBlock * 16 floats, 32-byte aligned.
void rows_avx2(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int n, const TileOut& out, float* acc) {
  if (float_format(s.fmt)) return float_panel(s, p, x, r0, n, out);
  for (int r = 0; r < 2 * n; ++r) _mm256_store_ps(acc + 8 * r, _mm256_setzero_ps());
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

void quantize_row_avx2(const float* x, int64_t k, int8_t* q, float* d8, int32_t* s16, int32_t* s32, float* xs) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  // packs_epi32 then packs_epi16 interleave 128-bit lanes; this puts the 4-byte groups back in order
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < k / kActBlock; ++b) {
    const float* xb = x + b * kActBlock;
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xb + 8 * i);
    const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
                                   _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
    const float d = hmax8(m) / 127.f;
    const float id = d != 0.f ? 1.f / d : 0.f;
    __m256i c[4];
    for (int i = 0; i < 4; ++i) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kActBlock), _mm256_permutevar8x32_epi32(bytes, order));
    const int32_t a = hsum8_epi32(_mm256_add_epi32(c[0], c[1])), e = hsum8_epi32(_mm256_add_epi32(c[2], c[3]));
    d8[b] = d;
    s16[2 * b] = a;
    s16[2 * b + 1] = e;
    s32[b] = a + e;
    xs[b] = d * static_cast<float>(a + e);
  }
}

// pre_op_row_portable with the same arithmetic: RMSNorm's 16 partial sums in two registers.
void pre_op_row_avx2(const float* x, int64_t k, const PreOp& op, float* out) {
  if (op.silu_mul) {
    const __m256 one = _mm256_set1_ps(1.f);
    for (int64_t i = 0; i < k; i += 8) {
      const __m256 g = _mm256_loadu_ps(x + i);
      const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), g));
      _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(x + k + i)));
    }
    return;
  }
  __m256 sq0 = _mm256_setzero_ps(), sq1 = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; i += 16) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
    sq0 = _mm256_fmadd_ps(a, a, sq0);
    sq1 = _mm256_fmadd_ps(b, b, sq1);
  }
  alignas(32) float lanes[16];
  _mm256_store_ps(lanes, sq0);
  _mm256_store_ps(lanes + 8, sq1);
  float total = 0.f;
  for (float v : lanes) total += v;
  const __m256 inv = _mm256_set1_ps(1.f / std::sqrt(total / static_cast<float>(k) + op.eps));
  for (int64_t i = 0; i < k; i += 8)
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), inv), _mm256_loadu_ps(op.norm + i)));
}

}  // namespace spx

SPX_END

#endif  // __x86_64__
