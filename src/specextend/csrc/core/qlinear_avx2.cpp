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

#include <array>
#include <cmath>
#include <cstring>
#include <utility>

#include "qlinear.h"
#include "target.h"

SPX_BEGIN_AVX2
#include "simd_avx2.h"

namespace spx {

namespace {

constexpr int kTile = 8;  // rows that share one unpacked weight group

// Keeps an accumulator in its register at this point: without it GCC reassociates a chain of
// integer adds into a tree, computes every product first and spills them to the stack.
inline void in_register(__m256i& v) { __asm__("" : "+x"(v)); }

// Weights stream from memory once per call; while a group's rows are computed the hardware
// prefetcher falls behind, so each group also asks for the bytes kPrefetch ahead into L2.
constexpr int64_t kPrefetch = 9472;

inline void prefetch(const uint8_t* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch + off), _MM_HINT_T1);
}

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

// acc = fma(float(dot) * d8, scale, acc): the reference epilogue of one group, 8 channels.
inline __m256 epilogue(__m256i dot, float d8, __m256 scale, __m256 acc) {
  return _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d8)), scale, acc);
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
  for (int64_t sb = 0; sb < nsb; ++sb, p += sb_bytes) {
    const __m256 d[2] = {cvt_f16(p), cvt_f16(p + 16)}, dmin[2] = {cvt_f16(p + 32), cvt_f16(p + 48)};
    for (int g = 0; g < sbg; ++g) {
      const int64_t k0 = (sb * sbg + g) * 32;
      const uint8_t* cb = p + 64 + 32 * sbg + 256 * g;
      prefetch(p + (sb_bytes / sbg) * g, sb_bytes / sbg);
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

// NR rows' exact int32 dot products of one Q6K group of 16 inputs (its 4 steps): 6-bit codes
// make pairs of up to 2 * 63 * 127, so two steps share an int16 sum before VPMADDWD widens it.
template <int NR>
inline void q6k_dots(const __m256i (*w)[2], const int8_t* const* q, __m256i (*dot)[2]) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int j = 0; j < NR; ++j) {
    const __m256i a0 = bcast4(q[j]), a1 = bcast4(q[j] + 4), a2 = bcast4(q[j] + 8), a3 = bcast4(q[j] + 12);
    for (int h = 0; h < 2; ++h) {
      __m256i s01 = _mm256_add_epi16(_mm256_maddubs_epi16(w[0][h], a0), _mm256_maddubs_epi16(w[1][h], a1));
      __m256i s23 = _mm256_add_epi16(_mm256_maddubs_epi16(w[2][h], a2), _mm256_maddubs_epi16(w[3][h], a3));
      in_register(s01);
      in_register(s23);
      dot[j][h] = _mm256_add_epi32(_mm256_madd_epi16(s01, ones), _mm256_madd_epi16(s23, ones));
    }
  }
}

template <int R>
void panel_q6k(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, __m256 (*acc)[2]) {
  const int64_t nsb = s.k / 256, kb = s.k / 32, k16 = s.k / 16;
  const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
  alignas(32) __m256i w[4][2];  // [step][half]
  for (int64_t sb = 0; sb < nsb; ++sb, p += 3360) {
    const __m256 d[2] = {cvt_f16(p), cvt_f16(p + 16)};
    for (int g = 0; g < 16; ++g) {
      const int64_t k0 = sb * 256 + g * 16;
      const uint8_t* cb = p + 288 + 192 * g;
      prefetch(p + 210 * g, 210);
      for (int h = 0; h < 2; ++h) {
        // Step s's high bits sit at bits 2s..2s+1 of hb; shifted to bits 4..5 they join the nibble.
        const __m256i a = load(cb + 32 * h), b = load(cb + 64 + 32 * h), hb = load(cb + 128 + 32 * h);
        w[0][h] = _mm256_or_si256(_mm256_and_si256(a, low), _mm256_and_si256(_mm256_slli_epi16(hb, 4), top));
        w[1][h] = _mm256_or_si256(_mm256_and_si256(b, low), _mm256_and_si256(_mm256_slli_epi16(hb, 2), top));
        w[2][h] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), low), _mm256_and_si256(hb, top));
        w[3][h] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), low),
                                  _mm256_and_si256(_mm256_srli_epi16(hb, 2), top));
      }
      const __m256 scale[2] = {_mm256_mul_ps(d[0], cvt_i8(p + 32 + 16 * g)), _mm256_mul_ps(d[1], cvt_i8(p + 40 + 16 * g))};
      for (int r = 0; r < R; r += 2) {
        const int8_t* q[2] = {x.q8 + (r0 + r) * x.k + k0, x.q8 + (r0 + r + 1) * x.k + k0};
        __m256i dot[2][2];
        if (R - r >= 2) q6k_dots<2>(w, q, dot);
        else q6k_dots<1>(w, q, dot);
        for (int j = 0; j < 2 && r + j < R; ++j) {
          const int64_t row = r0 + r + j;
          const __m256i off = _mm256_set1_epi32(32 * x.s16[row * k16 + k0 / 16]);
          const float d8 = x.d8[row * kb + k0 / 32];
          for (int h = 0; h < 2; ++h) acc[r + j][h] = epilogue(_mm256_sub_epi32(dot[j][h], off), d8, scale[h], acc[r + j][h]);
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

template <int R>
void panel_q8(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, __m256 (*acc)[2]) {
  const int64_t nsb = s.k / 32, kb = s.k / 32;
  const int32_t off = static_cast<int32_t>(s.offset);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  alignas(32) __m256i w[8][2][2];  // [step][half][code - 128, its magnitude]
  for (int64_t sb = 0; sb < nsb; ++sb, p += 544) {
    prefetch(p, 544);
    for (int st = 0; st < 8; ++st)
      for (int h = 0; h < 2; ++h) {
        w[st][h][0] = _mm256_xor_si256(load(p + 32 + 64 * st + 32 * h), flip);
        w[st][h][1] = _mm256_abs_epi8(w[st][h][0]);
      }
    const __m256 scale[2] = {cvt_f16(p), cvt_f16(p + 16)};
    for (int r = 0; r < R; r += 2) {
      const int8_t* q[2] = {x.q8 + (r0 + r) * x.k + sb * 32, x.q8 + (r0 + r + 1) * x.k + sb * 32};
      __m256i dot[2][2];
      if (R - r >= 2) q8_dots<2>(w, q, dot);
      else q8_dots<1>(w, q, dot);
      for (int j = 0; j < 2 && r + j < R; ++j) {
        const int64_t b = (r0 + r + j) * kb + sb;
        // sum(code * q) - offset * sum(q) = sum((code - 128) * q) + (128 - offset) * sum(q)
        const __m256i fix = _mm256_set1_epi32((128 - off) * x.s32[b]);
        for (int h = 0; h < 2; ++h)
          acc[r + j][h] = epilogue(_mm256_add_epi32(dot[j][h], fix), x.d8[b], scale[h], acc[r + j][h]);
      }
    }
  }
}

template <int R>
void tile(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, const TileOut& out) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  switch (s.fmt) {
    case Q4K: panel_q4k<R>(s, p, x, r0, acc); break;
    case Q6K: panel_q6k<R>(s, p, x, r0, acc); break;
    default: panel_q8<R>(s, p, x, r0, acc); break;
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

using Fn = void (*)(const Segment&, const uint8_t*, const Rows&, int64_t, const TileOut&);

template <int... Rs>
constexpr std::array<Fn, sizeof...(Rs)> make_tiles(std::integer_sequence<int, Rs...>) {
  return {&tile<Rs + 1>...};
}
const auto kTiles = make_tiles(std::make_integer_sequence<int, kTile>{});

}  // namespace

int tile_rows_avx2() { return kTile; }

// Full panels only (the driver runs a partial one portable).
void tile_avx2(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int rows, const TileOut& out) {
  kTiles[rows - 1](s, p, x, r0, out);
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
