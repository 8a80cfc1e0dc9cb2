// The byte-code unpacking shared by the avx512 and amx paths; include inside an SPX_BEGIN_AVX512
// region after qlinear.h.
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
  if (fmt == IQ4)
    return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kIq4Bytes))), nib);
  const __m512i plane = _mm512_loadu_si512(cb + 256);
  const __m512i bit = st <= 4 ? _mm512_sll_epi16(plane, _mm_cvtsi32_si128(4 - st)) : _mm512_srl_epi16(plane, _mm_cvtsi32_si128(st - 4));
  return _mm512_or_si512(nib, _mm512_and_si512(bit, _mm512_set1_epi8(0x10)));
}

}  // namespace spx
