// The code unpacking shared by the avx512 and amx paths (the 6-bit and byte-code formats) and
// their output epilogue; include inside an SPX_BEGIN_AVX512 region after qlinear.h.
#pragma once

#include "x86.h"

#include "qlinear.h"

namespace spx {

// Step st's 64 byte codes (16 channels x 4 inputs) of a byte-code group at cb: byte_code
// (qlinear.h) on 64 lanes. 16-bit shifts move the fifth bit within its byte (st <= 4 left by
// 4 - st, else right): the bits crossing from the other byte of the pair miss the mask.
inline __m512i step_bytes(int64_t fmt, const uint8_t* cb, int st) {
  if (fmt == Q8) return _mm512_loadu_si512(cb + 64 * st);
  const __m512i v = _mm512_loadu_si512(cb + 64 * (st % 4));
  const __m512i nib = _mm512_and_si512(st < 4 ? v : _mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
  if (code_kind(fmt) == Q40) return nib;
  if (code_kind(fmt) == IQ4)
    return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(code_table(fmt)))),
                               nib);
  const __m512i plane = _mm512_loadu_si512(cb + 256);
  const __m512i bit = st <= 4 ? _mm512_sll_epi16(plane, _mm_cvtsi32_si128(4 - st)) : _mm512_srl_epi16(plane, _mm_cvtsi32_si128(st - 4));
  return _mm512_or_si512(nib, _mm512_and_si512(bit, _mm512_set1_epi8(0x10)));
}

// The 16 channels' E8M0 bytes at p as e8m0_half's floats (qlinear.h), the same bits from shifts:
// (e - 1) << 23, or 0x00200000 << e for e < 2.
inline __m512 e8m0_half16(const uint8_t* p) {
  const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i big = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
  const __m512i small = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
  // e <= 1 rather than e < 2: SIMDe, which runs this code under emulation on AVX2 CPUs in the tests,
  // has no cmplt_epu32_mask.
  const __mmask16 low = _mm512_cmple_epu32_mask(e, _mm512_set1_epi32(1));
  return _mm512_castsi512_ps(_mm512_mask_blend_epi32(low, big, small));
}

// Group g's four steps of 6-bit codes of the Q6K, Q3K, Q2K or table (q3_table) super-block at
// sb: q6_code (qlinear.h) on 64 lanes, each format compiled apart. Q6K: step s's high bits sit at
// bits 2s..2s+1 of h; shifted to bits 4..5 they join the nibble. Q3K, Q2K: 16-bit shifts bring a
// field to the bottom of its byte, where bits from the other byte of the pair miss the mask; Q3K's
// high bit goes straight to bit 2 (one shift, one mask); the table formats' 3-bit codes, so
// unpacked, index their table (one byte shuffle). kRaw: Q3K's codes as their 3 bits (zero point
// codes_zero), not moved into q6_zero's grid.
template <int64_t FMT, bool kRaw = false>
inline void unpack_q6(const uint8_t* sb, int g, __m512i* w) {
  if constexpr (FMT == Q2K) {
    const __m512i v = _mm512_loadu_si512(sb + 320 + 64 * g);
#pragma GCC unroll 4
    for (int st = 0; st < 4; ++st) w[st] = _mm512_and_si512(_mm512_srli_epi16(v, 2 * st), _mm512_set1_epi8(3));
  } else if constexpr (FMT == Q3K || q3_table(FMT)) {
    const uint8_t* pair = sb + q6_header(FMT) + 192 * (g / 2);
    const __m512i lo = _mm512_loadu_si512(pair + 64 * (g % 2)), hi = _mm512_loadu_si512(pair + 128);
#pragma GCC unroll 4
    for (int st = 0; st < 4; ++st) {
      const __m512i l = _mm512_and_si512(_mm512_srl_epi16(lo, _mm_cvtsi32_si128(2 * st)), _mm512_set1_epi8(3));
      const int hb = 4 * (g % 2) + st;
      const __m512i t = hb >= 2 ? _mm512_srl_epi16(hi, _mm_cvtsi32_si128(hb - 2)) : _mm512_sll_epi16(hi, _mm_cvtsi32_si128(2 - hb));
      w[st] = _mm512_or_si512(l, _mm512_and_si512(t, _mm512_set1_epi8(4)));
      if constexpr (q3_table(FMT)) {
        const __m128i table = _mm_load_si128(reinterpret_cast<const __m128i*>(q3_table_bytes(FMT)));
        w[st] = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(table), w[st]);
      } else if constexpr (!kRaw) {
        w[st] = _mm512_add_epi8(w[st], _mm512_set1_epi8(static_cast<char>(q6_zero(Q3K) - codes_zero(Q3K))));
      }
    }
  } else {
    const uint8_t* cb = sb + 288 + 192 * g;
    const __m512i low = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
    const __m512i a = _mm512_loadu_si512(cb), b = _mm512_loadu_si512(cb + 64), h = _mm512_loadu_si512(cb + 128);
    w[0] = _mm512_or_si512(_mm512_and_si512(a, low), _mm512_and_si512(_mm512_slli_epi16(h, 4), top));
    w[1] = _mm512_or_si512(_mm512_and_si512(b, low), _mm512_and_si512(_mm512_slli_epi16(h, 2), top));
    w[2] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(a, 4), low), _mm512_and_si512(h, top));
    w[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(b, 4), low), _mm512_and_si512(_mm512_srli_epi16(h, 2), top));
  }
}

// The same in q6_zero's grid for a format known only at run time (the amx path's unpacking).
inline void unpack_q6(int64_t fmt, const uint8_t* sb, int g, __m512i* w) {
  if (fmt == Q2K) unpack_q6<Q2K>(sb, g, w);
  else if (fmt == Q3K) unpack_q6<Q3K>(sb, g, w);
  else if (fmt == IQ2XS) unpack_q6<IQ2XS>(sb, g, w);
  else if (fmt == IQ1M) unpack_q6<IQ1M>(sb, g, w);
  else unpack_q6<Q6K>(sb, g, w);
}

// Group g's float scales and (Q2K: a 4-bit scale and minimum a byte) minimums of the 6-bit
// super-block at sb; d, dmin: the super-block's d (q6_d) and Q2K's dmin as floats.
inline void q6_scales(int64_t fmt, const uint8_t* sb, int g, __m512 d, __m512 dmin, __m512* scale, __m512* mins) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + q6_scales_at(fmt) + 16 * g));
  if (fmt != Q2K) {
    *scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)));
    return;
  }
  const __m512i sm = _mm512_cvtepu8_epi32(v);
  *scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(sm, _mm512_set1_epi32(15))));
  *mins = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_srli_epi32(sm, 4)));
}

// Rows [r0, r0 + n) of a panel's sums (acc: 16 floats a row, 64-byte aligned) + bias (+ residual)
// into out.
inline void store_rows(const float* acc, int64_t r0, int n, const TileOut& out) {
  const __m512 b = out.bias ? _mm512_loadu_ps(out.bias) : _mm512_setzero_ps();
  for (int r = 0; r < n; ++r) {
    __m512 y = _mm512_add_ps(_mm512_load_ps(acc + 16 * r), b);
    if (out.residual) y = _mm512_add_ps(_mm512_loadu_ps(out.residual + (r0 + r) * out.ldo), y);
    _mm512_storeu_ps(out.y + (r0 + r) * out.ldo, y);
  }
}

// Q4K group codes at cb as TDPBSUD / VPDPBUSD operands: steps 0-3 the low nibbles, 4-7 the high.
inline void unpack_q4k(const uint8_t* cb, __m512i* w) {
  const __m512i low = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    const __m512i v = _mm512_loadu_si512(cb + 64 * i);
    w[i] = _mm512_and_si512(v, low);
    w[i + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
  }
}

// The minimum codes of super-block p as int16 pairs (groups 2j, 2j + 1 of lane c in lane c of
// mn[j]); Q4K, Q5K: 4 pairs of groups of 32, Q2K: 8 pairs of groups of 16.
template <int64_t FMT>
inline void k256_min_pairs(const uint8_t* p, __m512i* mn) {
  constexpr int pairs = FMT == Q2K ? 8 : 4;
  const uint8_t* base = FMT == Q2K ? p + 64 : FMT == Q4K ? p + 64 + 16 * 8 : group_mins(8, p, 0);
#pragma GCC unroll 8
  for (int j = 0; j < pairs; ++j) {
    __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(base + 32 * j)));
    __m512i hi = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(base + 32 * j + 16)));
    if constexpr (FMT == Q2K) {
      lo = _mm512_srli_epi32(lo, 4);
      hi = _mm512_srli_epi32(hi, 4);
    }
    mn[j] = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
  }
}

}  // namespace spx
