// The avx512 path of the quantized linear layers: AVX-512 VNNI (VPDPBUSD: 64 int8 products a
// instruction), 16 channels a register, tiles of up to 10 rows sharing each weight group.
#if defined(__x86_64__)

#include "x86.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>

#include "qlinear.h"
#include "target.h"

SPX_BEGIN_AVX512
#include "simd_avx512.h"
#include "unpack_avx512.h"
#include "tiles.h"

namespace spx {

namespace {

constexpr int kTile = 10;  // rows that share one pass over the weights (registers: 2 per row)

// Weights stream from memory once per call; with several rows a group takes long enough that the
// hardware prefetcher falls behind, so each group also asks for the bytes ~9 KB ahead into L2.
constexpr int64_t kPrefetch = 9472;

inline void prefetch_group(const uint8_t* p, int bytes) {
  for (int off = 0; off < bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch + off), _MM_HINT_T1);
}

// acc + VPDPBUSD(w, the 4 activation codes at q in every lane), the codes read by the
// instruction's own broadcast ({1to16}): a separate broadcast load costs an operation a product
// on the vector ports the products need, and the compiler does not fold it.
inline __m512i dp4(__m512i acc, __m512i w, const int8_t* q) {
#if defined(SPECEXTEND_EMULATE_AVX512)
  int32_t v;
  std::memcpy(&v, q, 4);
  return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(v));
#else
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(q)));
  return acc;
#endif
}

// An int32 from memory in every lane, read by a broadcast load: an integer first loaded into a
// general register would cross into the vector unit on a port the dot products need.
inline __m512i bcast_i32(const int32_t* p) { return _mm512_broadcastd_epi32(_mm_loadu_si32(p)); }

inline __m512 cvt_u8(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p))); }
inline __m512 cvt_i8(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))); }
inline __m512 cvt_f16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
// A super-block's d[16]: its f16 halves as floats, or its float32 (f32_d).
inline __m512 load_d(int64_t fmt, const uint8_t* sb) { return f32_d(fmt) ? _mm512_loadu_ps(sb) : cvt_f16(sb); }

// Rows are interleaved step by step (one accumulator per row), so a tile's R dot products are
// R independent VPDPBUSD chains the core can overlap; integer sums are exact in any order. A
// single row splits its chain in two for the same reason.
template <int R, int STEPS>
inline void dots(const __m512i* w, const int8_t* const* q, __m512i* dot) {
  constexpr int kSplit = R == 1 ? 2 : 1;
  __m512i part[R * kSplit];
#pragma GCC unroll 16
  for (int r = 0; r < R * kSplit; ++r) part[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
  for (int st = 0; st < STEPS; ++st) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const int c = R == 1 ? st % kSplit : r;
      part[c] = dp4(part[c], w[st], q[r] + 4 * st);
    }
  }
  if constexpr (R == 1) {
    dot[0] = _mm512_add_epi32(part[0], part[1]);
  } else {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) dot[r] = part[r];
  }
}

template <int R>
void panel_q4k(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, __m512* acc) {
  const int64_t sbg = s.sbg, nsb = s.k / (32 * sbg), kb = s.k / 32, sb_bytes = 64 + 288 * sbg;
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t sb = 0; sb < nsb; ++sb, p += sb_bytes) {
    const __m512 d = cvt_f16(p), dmin = cvt_f16(p + 32);
    for (int g = 0; g < sbg; ++g) {
      const int64_t k0 = (sb * sbg + g) * 32;
      const __m512 scale = _mm512_mul_ps(d, cvt_u8(p + 64 + 16 * g));
      const __m512 mins = _mm512_mul_ps(dmin, cvt_u8(p + 64 + 16 * sbg + 16 * g));
      const uint8_t* cb = p + 64 + 32 * sbg + 256 * g;
      prefetch_group(p + (sb_bytes / sbg) * g, static_cast<int>(sb_bytes / sbg));
      __m512i w[8];
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const __m512i v = _mm512_loadu_si512(cb + 64 * i);
        w[i] = _mm512_and_si512(v, low);
        w[i + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
      const int8_t* q[R];
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) q[r] = x.q8 + (r0 + r) * x.k + k0;
      __m512i dot[R];
      dots<R, 8>(w, q, dot);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const int64_t b = (r0 + r) * kb + k0 / 32;
        const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_set1_ps(x.d8[b]));
        acc[r] = _mm512_fmadd_ps(t, scale, acc[r]);
        acc[r] = _mm512_fnmadd_ps(mins, _mm512_set1_ps(x.xs[b]), acc[r]);
      }
    }
  }
}

// A 6-bit group's correction -zero * (sum of its 16 activation codes) in every lane (codes_zero:
// the zero point of the codes unpack_q6<FMT, true> gives), where its chains start, so nothing is
// subtracted after (int32 sums: exact in any order); 0 for Q2K, which has none.
template <int64_t FMT>
inline __m512i q6k_start(const int32_t* s16) {
  constexpr int32_t zero = codes_zero(FMT);
  if constexpr (zero == 0) return _mm512_setzero_si512();
  else return _mm512_set1_epi32(-zero * *s16);
}

// A 6-bit super-block's bytes a group asks to have prefetched (its share of the panel's blob).
template <int64_t FMT>
constexpr int q6_group_bytes() {
  return (q6_header(FMT) + 16 * group16_bytes(FMT)) / 16;
}

template <int R, int64_t FMT>
void panel_q6k(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, __m512* acc) {
  constexpr int gb = q6_group_bytes<FMT>();
  const int64_t nsb = s.k / 256, kb = s.k / 32, k16 = s.k / 16, sb_bytes = s.fi().bytes;
  for (int64_t sb = 0; sb < nsb; ++sb, p += sb_bytes) {
    const __m512 d = load_d(FMT, p), dmin = cvt_f16(p + 32);
#pragma GCC unroll 1  // a loop, not 16 copies (Q2K's one row measured faster so)
    for (int g = 0; g < 16; ++g) {
      const int64_t k0 = sb * 256 + g * 16;
      __m512 scale, mins;
      q6_scales(FMT, p, g, d, dmin, &scale, &mins);
      prefetch_group(p + gb * g, gb);
      __m512i w[4];
      unpack_q6<FMT, true>(p, g, w);
      const int8_t* q[R];
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) q[r] = x.q8 + (r0 + r) * x.k + k0;
      __m512i dot[R];
      dots<R, 4>(w, q, dot);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const int64_t row = r0 + r;
        // the zero point's correction after the chains (started from it, one row read 0.9x cold)
        if constexpr (codes_zero(FMT) != 0)
          dot[r] = _mm512_sub_epi32(dot[r], _mm512_set1_epi32(codes_zero(FMT) * x.s16[row * k16 + k0 / 16]));
        const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_set1_ps(x.d8[row * kb + k0 / 32]));
        acc[r] = _mm512_fmadd_ps(t, scale, acc[r]);
        if constexpr (FMT == Q2K) acc[r] = _mm512_fnmadd_ps(mins, _mm512_set1_ps(q16_xs(x, row, k0)), acc[r]);
      }
    }
  }
}

// A byte-code segment's super-blocks, derived once a call: their bytes, their groups of 32 inputs,
// and the bytes each group asks to have prefetched (its share of the super-block).
struct ByteBlocks {
  int64_t bytes;
  int groups, share;
  explicit ByteBlocks(const Segment& s) {
    const FormatInfo fi = s.fi();
    bytes = fi.bytes;
    groups = fi.superblock / 32;
    share = static_cast<int>(bytes / groups);
  }
};

// One byte-code group of a panel (qlinear.h: a one-group super-block, or group g of Q5K or IQ4)
// into registers: its byte codes, its channels' scales and minimums (zero where it has none). Each
// group asks for its share of the super-block ahead (share: the super-block's bytes over its groups).
template <int64_t FMT>
inline void load_q8_group(const uint8_t* p, int64_t sbg, int g, int share, __m512i* w, __m512* scale, __m512* mins) {
  const uint8_t* cb = byte_codes(FMT, sbg, p, g);
  prefetch_group(p + share * g, share);
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) w[i] = step_bytes(FMT, cb, i);
  *scale = e8m0_header(FMT) ? e8m0_half16(p) : load_d(FMT, p);
  if constexpr (scale_codes(FMT)) *scale = _mm512_mul_ps(*scale, cvt_i8(group_scales(FMT, p, g)));
  *mins = has_minimum(FMT) ? cvt_f16(p + 32) : _mm512_setzero_ps();
  if constexpr (k_header(FMT)) *mins = _mm512_mul_ps(*mins, cvt_u8(group_mins(sbg, p, g)));
}

// One row's group into acc: the reference epilogue of the byte-code formats (Q8's header has no
// minimum). kFix: false where the offset is 0 (Q5_K, Q5_1), whose correction is 0.
template <int64_t FMT, bool kFix = true>
inline __m512 q8_epilogue(__m512i dot, int32_t correction, float d8, float xs, __m512 scale, __m512 mins, __m512 acc) {
  const __m512i c = kFix ? _mm512_sub_epi32(dot, _mm512_set1_epi32(correction)) : dot;
  acc = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(c), _mm512_set1_ps(d8)), scale, acc);
  if constexpr (has_minimum(FMT)) acc = _mm512_fnmadd_ps(mins, _mm512_set1_ps(xs), acc);
  return acc;
}

// The groups are walked here rather than through for_q8_groups: the tiles measured 0.80-0.88x
// through its lambda (kernel_ab, 1-4 rows).
template <int R, int64_t FMT>
void panel_q8(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, __m512* acc) {
  const int64_t kb = s.k / 32, sbg = s.sbg;
  const int32_t off = static_cast<int32_t>(s.offset);
  const ByteBlocks L(s);
  for (int64_t sb = 0; sb < kb / L.groups; ++sb, p += L.bytes) {
    for (int g = 0; g < L.groups; ++g) {
      const int64_t blk = sb * L.groups + g;
      __m512i w[8];
      __m512 scale, mins;
      load_q8_group<FMT>(p, sbg, g, L.share, w, &scale, &mins);
      const int8_t* q[R];
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) q[r] = x.q8 + (r0 + r) * x.k + blk * 32;
      __m512i dot[R];
      dots<R, 8>(w, q, dot);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const int64_t b = (r0 + r) * kb + blk;
        acc[r] = q8_epilogue<FMT>(dot[r], off * x.s32[b], x.d8[b], x.xs[b], scale, mins, acc[r]);
      }
    }
  }
}

template <int R>
void tile(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, const TileOut& out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  switch (s.fmt) {  // each format compiled apart, its branches folded away
    case Q4K: panel_q4k<R>(s, p, x, r0, acc); break;
    case Q6K: panel_q6k<R, Q6K>(s, p, x, r0, acc); break;
    case Q3K: panel_q6k<R, Q3K>(s, p, x, r0, acc); break;
    case Q2K: panel_q6k<R, Q2K>(s, p, x, r0, acc); break;
    case IQ2XS: panel_q6k<R, IQ2XS>(s, p, x, r0, acc); break;
    case IQ1M: panel_q6k<R, IQ1M>(s, p, x, r0, acc); break;
    case Q5K: panel_q8<R, Q5K>(s, p, x, r0, acc); break;
    case IQ4: panel_q8<R, IQ4>(s, p, x, r0, acc); break;
    case IQ3S: panel_q8<R, IQ3S>(s, p, x, r0, acc); break;
    case IQ3XXS: panel_q8<R, IQ3XXS>(s, p, x, r0, acc); break;
    case IQ2XXS: panel_q8<R, IQ2XXS>(s, p, x, r0, acc); break;
    case IQ1S: panel_q8<R, IQ1S>(s, p, x, r0, acc); break;
    case Q40: panel_q8<R, Q40>(s, p, x, r0, acc); break;
    case Q50: panel_q8<R, Q50>(s, p, x, r0, acc); break;
    case IQ4NL: panel_q8<R, IQ4NL>(s, p, x, r0, acc); break;
    case MXFP4: panel_q8<R, MXFP4>(s, p, x, r0, acc); break;
    case Q41: panel_q8<R, Q41>(s, p, x, r0, acc); break;
    case Q51: panel_q8<R, Q51>(s, p, x, r0, acc); break;
    default: panel_q8<R, Q8>(s, p, x, r0, acc); break;
  }
  const __m512 b = out.bias ? _mm512_loadu_ps(out.bias) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) {
    __m512 y = _mm512_add_ps(acc[r], b);
    if (out.residual) y = _mm512_add_ps(_mm512_loadu_ps(out.residual + (r0 + r) * out.ldo), y);
    _mm512_storeu_ps(out.y + (r0 + r) * out.ldo, y);
  }
}

// ---------------------------------------------------------------- many rows
//
// One panel times any number of rows: each weight group is unpacked into registers once and
// applied to every row in turn, the rows' accumulators living in a small buffer (L1) instead of
// registers. Per row and group the work is the group's VPDPBUSDs plus the reference epilogue, so
// the weight decoding is paid once per group however many rows there are; a tile (above) would
// decode it again for every 10 rows and keep too many registers live.

// One row's exact int32 dot products of a group over STEPS steps of 4 inputs, in two chains.
template <int STEPS>
inline __m512i row_dot(const __m512i* w, const int8_t* q) {
  __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
#pragma GCC unroll 8
  for (int st = 0; st < STEPS; st += 2) {
    a = dp4(a, w[st], q + 4 * st);
    b = dp4(b, w[st + 1], q + 4 * st + 4);
  }
  return _mm512_add_epi32(a, b);
}

// Two groups a pass over the rows (an odd super-block size ends with one): each row's
// accumulator is loaded and stored once for both, and its updates keep the reference order.
template <int G>
inline void rows_q4k_groups(const uint8_t* p, int64_t sbg, int g, const __m512& d, const __m512& dmin, const Rows& x,
                            int64_t k0, int64_t r0, int n, float* acc) {
  const int64_t kb = x.k / 32, xk = x.k;
  __m512 scale[G], mins[G];
  __m512i w[G][8];
#pragma GCC unroll 2
  for (int j = 0; j < G; ++j) {
    scale[j] = _mm512_mul_ps(d, cvt_u8(p + 64 + 16 * (g + j)));
    mins[j] = _mm512_mul_ps(dmin, cvt_u8(p + 64 + 16 * sbg + 16 * (g + j)));
    unpack_q4k(p + 64 + 32 * sbg + 256 * (g + j), w[j]);
  }
  const int8_t* q = x.q8 + r0 * xk + k0;
  const float* d8 = x.d8 + r0 * kb + k0 / 32;
  const float* xs = x.xs + r0 * kb + k0 / 32;
#pragma GCC unroll 2
  for (int r = 0; r < n; ++r) {
    __m512 a = _mm512_load_ps(acc + 16 * r);
#pragma GCC unroll 2
    for (int j = 0; j < G; ++j) {
      const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(row_dot<8>(w[j], q + r * xk + 32 * j)), _mm512_set1_ps(d8[r * kb + j]));
      a = _mm512_fnmadd_ps(mins[j], _mm512_set1_ps(xs[r * kb + j]), _mm512_fmadd_ps(t, scale[j], a));
    }
    _mm512_store_ps(acc + 16 * r, a);
  }
}

void rows_q4k(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int n, float* acc) {
  const int64_t sbg = s.sbg, nsb = s.k / (32 * sbg), sb_bytes = 64 + 288 * sbg;
  for (int64_t sb = 0; sb < nsb; ++sb, p += sb_bytes) {
    const __m512 d = cvt_f16(p), dmin = cvt_f16(p + 32);
    prefetch_group(p, static_cast<int>(sb_bytes));
    int g = 0;
    for (; g + 1 < sbg; g += 2) rows_q4k_groups<2>(p, sbg, g, d, dmin, x, (sb * sbg + g) * 32, r0, n, acc);
    if (g < sbg) rows_q4k_groups<1>(p, sbg, g, d, dmin, x, (sb * sbg + g) * 32, r0, n, acc);
  }
}

// Q6K's groups of 16 go in pairs: both halves of one activation block share its scale, and
// each row's accumulator is loaded and stored once for the two groups (same order of operations).
// A pair's activations, sums and scales of 64 rows sit on as many pages (rows are k bytes apart),
// more than the L1 TLB holds for wide inputs; slices of 32 rows keep one pass within it (the
// second slice rereads the panel's weights from cache and unpacks them again).
constexpr int kQ6Slice = 32;

template <int64_t FMT>
void rows_q6k_slice(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int n, float* acc) {
  constexpr int gb = q6_group_bytes<FMT>();
  const int64_t nsb = s.k / 256, kb = s.k / 32, k16 = s.k / 16, xk = x.k, sb_bytes = s.fi().bytes;
  for (int64_t sb = 0; sb < nsb; ++sb, p += sb_bytes) {
    const __m512 d = load_d(FMT, p), dmin = cvt_f16(p + 32);
    for (int g = 0; g < 16; g += 2) {
      const int64_t k0 = sb * 256 + g * 16;
      __m512 scale0, scale1, mins0, mins1;
      q6_scales(FMT, p, g, d, dmin, &scale0, &mins0);
      q6_scales(FMT, p, g + 1, d, dmin, &scale1, &mins1);
      prefetch_group(p + gb * g, 2 * gb);
      __m512i w0[4], w1[4];
      unpack_q6<FMT, true>(p, g, w0);
      unpack_q6<FMT, true>(p, g + 1, w1);
      const int8_t* q = x.q8 + r0 * xk + k0;
      const int32_t* s16 = x.s16 + r0 * k16 + k0 / 16;
      const float* d8 = x.d8 + r0 * kb + k0 / 32;
      for (int r = 0; r < n; ++r) {
        const int8_t* qr = q + r * xk;
        // The row's codes two pairs on: its lines are far apart, which the hardware prefetcher
        // does not follow.
        _mm_prefetch(reinterpret_cast<const char*>(qr + 64), _MM_HINT_T0);
        __m512i c0 = q6k_start<FMT>(s16 + r * k16), c1 = q6k_start<FMT>(s16 + r * k16 + 1);
#pragma GCC unroll 4
        for (int st = 0; st < 4; ++st) {
          c0 = dp4(c0, w0[st], qr + 4 * st);
          c1 = dp4(c1, w1[st], qr + 16 + 4 * st);
        }
        const __m512 dd = _mm512_set1_ps(d8[r * kb]);
        __m512 a = _mm512_load_ps(acc + 16 * r);
        a = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(c0), dd), scale0, a);
        if constexpr (FMT == Q2K) a = _mm512_fnmadd_ps(mins0, _mm512_set1_ps(d8[r * kb] * static_cast<float>(s16[r * k16])), a);
        a = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(c1), dd), scale1, a);
        if constexpr (FMT == Q2K) a = _mm512_fnmadd_ps(mins1, _mm512_set1_ps(d8[r * kb] * static_cast<float>(s16[r * k16 + 1])), a);
        _mm512_store_ps(acc + 16 * r, a);
      }
    }
  }
}

template <int64_t FMT>
void rows_q6k(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int n, float* acc) {
  for (int h = 0; h < n; h += kQ6Slice)
    rows_q6k_slice<FMT>(s, p, x, r0 + h, std::min(kQ6Slice, n - h), acc + 16 * h);
}

// G byte-code groups (activation blocks blk..blk + G - 1) a pass over the rows, as rows_q4k's
// pairs: each row's accumulator is loaded and stored once for both, its updates in input order.
template <int64_t FMT, int G, bool kFix>
void rows_q8_groups(const Segment& s, const ByteBlocks& L, const uint8_t* p, const Rows& x, int64_t blk, int64_t r0,
                    int n, float* acc) {
  const int64_t kb = s.k / 32, xk = x.k;
  const int32_t off = static_cast<int32_t>(s.offset);
  __m512i w[G][8];
  __m512 scale[G], mins[G];
#pragma GCC unroll 2
  for (int j = 0; j < G; ++j) {
    const int64_t b = blk + j;
    load_q8_group<FMT>(p + (b / L.groups) * L.bytes, s.sbg, static_cast<int>(b % L.groups), L.share, w[j], &scale[j],
                       &mins[j]);
  }
  const int8_t* q = x.q8 + r0 * xk + blk * 32;
  const int64_t b0 = r0 * kb + blk;
#pragma GCC unroll 2
  for (int r = 0; r < n; ++r) {
    const int64_t b = b0 + r * kb;
    __m512 a = _mm512_load_ps(acc + 16 * r);
#pragma GCC unroll 2
    for (int j = 0; j < G; ++j)
      a = q8_epilogue<FMT, kFix>(row_dot<8>(w[j], q + r * xk + 32 * j), kFix ? off * x.s32[b + j] : 0, x.d8[b + j],
                                 x.xs[b + j], scale[j], mins[j], a);
    _mm512_store_ps(acc + 16 * r, a);
  }
}

template <int64_t FMT, bool kFix>
void rows_q8_pairs(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int n, float* acc) {
  const ByteBlocks L(s);
  const int64_t kb = s.k / 32;
  int64_t blk = 0;
  for (; blk + 1 < kb; blk += 2) rows_q8_groups<FMT, 2, kFix>(s, L, p, x, blk, r0, n, acc);
  if (blk < kb) rows_q8_groups<FMT, 1, kFix>(s, L, p, x, blk, r0, n, acc);
}

template <int64_t FMT>
void rows_q8(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int n, float* acc) {
  if (s.offset == 0) rows_q8_pairs<FMT, false>(s, p, x, r0, n, acc);
  else rows_q8_pairs<FMT, true>(s, p, x, r0, n, acc);
}

// ---------------------------------------------------------------- K-quants, one activation scale per 256
//
// The per-256 arithmetic (qlinear.h, qlinear_portable.cpp: superblock_row): per row and super-block
// the exact int32 sums isum = sum_g scale code x (dot_g - zero x sum_g) and imin = sum_g minimum code
// x sum_g, then two float steps. Each pass over the rows takes 64 inputs (two groups of 32 or four
// of 16) unpacked once into registers; a row's dot products start from their zero point's
// correction, are multiplied by their scale codes (VPMULLD) and added into the row's isum (in L1).
// The minimums' sums come at the super-block's end from int16 pairs (VPDPWSSD: codes x sums of 32,
// or of 16 for Q2K). No float operation runs per group: only two multiplies and two FMAs a
// super-block and row.

// A group's codes as VPDPBUSD operands (STEPS of 4 inputs), its int32 scale codes and the zero
// point its dot products subtract, for super-block p's group g.
template <int64_t FMT>
struct KGroup {
  static constexpr int kSize = six_bit(FMT) ? 16 : 32;
  static constexpr int kSteps = kSize / 4;
  static void load(const uint8_t* p, int g, __m512i* w, __m512i* sc) {
    if constexpr (FMT == Q4K) {
      unpack_q4k(p + 64 + 32 * 8 + 256 * g, w);
      *sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 64 + 16 * g)));
    } else if constexpr (six_bit(FMT)) {
      unpack_q6<FMT, true>(p, g, w);
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + (FMT == Q2K ? 64 : 32) + 16 * g));
      *sc = FMT == Q2K ? _mm512_and_si512(_mm512_cvtepu8_epi32(v), _mm512_set1_epi32(15)) : _mm512_cvtepi8_epi32(v);
    } else {  // Q5K, IQ4
      const uint8_t* cb = byte_codes(FMT, 8, p, g);
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) w[i] = step_bytes(FMT, cb, i);
      *sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group_scales(FMT, p, g))));
    }
  }
};

// Where two int32 dot products fit int16 (Q4K: the halves of a group of 32, at most 15 x 127 x 16;
// Q3K, Q2K: two groups of 16, at most 4 x 127 x 16 with the zero point subtracted), they are
// merged into int16 pairs and one VPDPWSSD multiplies both by their scale codes and adds them
// into the row's sum: one product a 32 inputs instead of VPMULLD's two slots a group.
template <int64_t FMT>
constexpr bool kPairs = FMT == Q4K || FMT == Q3K || FMT == Q2K;

// a in the low int16 of each lane, b in the high (both within int16).
inline __m512i pair16(__m512i a, __m512i b) { return _mm512_mask_blend_epi16(0xAAAAAAAA, a, _mm512_slli_epi32(b, 16)); }

template <int64_t FMT>
void k256_pairs(const __m512i (*w)[KGroup<FMT>::kSteps], const __m512i* sc, const int8_t* q, int64_t xk,
                const int16_t* sums, int64_t sstride, int32_t zero, int n, int32_t* isum) {
  if constexpr (FMT == Q4K) {
    const __m512i sp0 = pair16(sc[0], sc[0]), sp1 = pair16(sc[1], sc[1]);
    for (int r = 0; r < n; ++r) {
      const int8_t* qr = q + r * xk;
      __m512i h[4];
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) h[i] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int st = 0; st < 4; ++st)
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) h[i] = dp4(h[i], w[i / 2][st + 4 * (i % 2)], qr + 32 * (i / 2) + 4 * (st + 4 * (i % 2)));
      __m512i c = _mm512_load_si512(isum + 16 * r);
      c = _mm512_dpwssd_epi32(c, pair16(h[0], h[1]), sp0);
      c = _mm512_dpwssd_epi32(c, pair16(h[2], h[3]), sp1);
      _mm512_store_si512(isum + 16 * r, c);
    }
  } else {  // four groups of 16: pairs (0, 1) and (2, 3)
    const __m512i sp0 = pair16(sc[0], sc[1]), sp1 = pair16(sc[2], sc[3]);
    for (int r = 0; r < n; ++r) {
      const int8_t* qr = q + r * xk;
      __m512i h[4];
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) h[j] = _mm512_set1_epi32(-zero * static_cast<int32_t>(sums[r * sstride + j]));
#pragma GCC unroll 4
      for (int st = 0; st < 4; ++st)
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) h[j] = dp4(h[j], w[j][st], qr + 16 * j + 4 * st);
      __m512i c = _mm512_load_si512(isum + 16 * r);
      c = _mm512_dpwssd_epi32(c, pair16(h[0], h[1]), sp0);
      c = _mm512_dpwssd_epi32(c, pair16(h[2], h[3]), sp1);
      _mm512_store_si512(isum + 16 * r, c);
    }
  }
}

// Rows [r0, r0 + n) of one super-block's isum (isum: [n][16] int32, zeroed by the caller).
// zero: the codes' zero point (codes_zero for the 6-bit formats, the segment's offset for the byte codes).
template <int64_t FMT>
void k256_isums(const uint8_t* p, const Rows& x, int64_t k0, int64_t r0, int n, int32_t zero, int32_t* isum) {
  using KG = KGroup<FMT>;
  constexpr int G = 64 / KG::kSize;  // groups a pass
  const int64_t xk = x.k, k16 = x.k / 16, k32 = x.k / 32;
  for (int g0 = 0; g0 < 256 / KG::kSize; g0 += G) {
    __m512i w[G][KG::kSteps], sc[G];
#pragma GCC unroll 4
    for (int j = 0; j < G; ++j) KG::load(p, g0 + j, w[j], &sc[j]);
    const int8_t* q = x.kq8 + r0 * xk + k0 + KG::kSize * g0;
    const int16_t* sums = KG::kSize == 16 ? x.ks16 + r0 * k16 + k0 / 16 + g0 : x.ks32 + r0 * k32 + k0 / 32 + g0;
    const int64_t sstride = KG::kSize == 16 ? k16 : k32;
    if constexpr (kPairs<FMT>) {
      k256_pairs<FMT>(w, sc, q, xk, sums, sstride, zero, n, isum);
      continue;
    }
    for (int r = 0; r < n; ++r) {
      const int8_t* qr = q + r * xk;
      __m512i c = _mm512_load_si512(isum + 16 * r);
#pragma GCC unroll 4
      for (int j = 0; j < G; ++j) {
        __m512i a = _mm512_set1_epi32(-zero * static_cast<int32_t>(sums[r * sstride + j]));
        __m512i b = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int st = 0; st < KG::kSteps; st += 2) {
          a = dp4(a, w[j][st], qr + KG::kSize * j + 4 * st);
          b = dp4(b, w[j][st + 1], qr + KG::kSize * j + 4 * st + 4);
        }
        c = _mm512_add_epi32(c, _mm512_mullo_epi32(_mm512_add_epi32(a, b), sc[j]));
      }
      _mm512_store_si512(isum + 16 * r, c);
    }
  }
}

// Rows [r0, r0 + n) of a panel with the per-256 activations, added into acc ([n][16] floats,
// 64-byte aligned) in the reference's order.
template <int64_t FMT>
void k256_panel(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int n, float* acc) {
  constexpr bool kMin = FMT == Q4K || FMT == Q5K || FMT == Q2K;
  alignas(64) int32_t isum[kRowBlock * 16];
  const int64_t nsb = s.k / 256, sb_bytes = s.fi().bytes, kd = x.k / 256, k16 = x.k / 16, k32 = x.k / 32;
  const int32_t zero = six_bit(FMT) ? codes_zero(FMT) : byte_format(FMT) ? static_cast<int32_t>(s.offset) : 0;
  for (int64_t sb = 0; sb < nsb; ++sb, p += sb_bytes) {
    prefetch_group(p, static_cast<int>(sb_bytes));
    std::memset(isum, 0, sizeof(int32_t) * 16 * n);
    k256_isums<FMT>(p, x, sb * 256, r0, n, zero, isum);
    const __m512 d = cvt_f16(p), dmin = kMin ? cvt_f16(p + 32) : _mm512_setzero_ps();
    __m512i mn[8];
    if constexpr (kMin) k256_min_pairs<FMT>(p, mn);
    for (int r = 0; r < n; ++r) {
      const int64_t row = r0 + r;
      const __m512 dk = _mm512_set1_ps(x.kd[row * kd + sb]);
      __m512 a = _mm512_load_ps(acc + 16 * r);
      a = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(isum + 16 * r)), dk), d, a);
      if constexpr (kMin) {
        __m512i imin = _mm512_setzero_si512();
        const int16_t* sums = FMT == Q2K ? x.ks16 + row * k16 + sb * 16 : x.ks32 + row * k32 + sb * 8;
#pragma GCC unroll 8
        for (int j = 0; j < (FMT == Q2K ? 8 : 4); ++j)
          imin = _mm512_dpwssd_epi32(imin, mn[j], bcast_i32(reinterpret_cast<const int32_t*>(sums + 2 * j)));
        a = _mm512_fnmadd_ps(dmin, _mm512_mul_ps(_mm512_cvtepi32_ps(imin), dk), a);
      }
      _mm512_store_ps(acc + 16 * r, a);
    }
  }
}

// The per-256 K-quant segments' rows (n <= kRowBlock) into acc (zeroed by the caller).
void k256_rows(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int n, float* acc) {
  switch (s.fmt) {
    case Q4K: k256_panel<Q4K>(s, p, x, r0, n, acc); break;
    case Q5K: k256_panel<Q5K>(s, p, x, r0, n, acc); break;
    case IQ4: k256_panel<IQ4>(s, p, x, r0, n, acc); break;
    case Q6K: k256_panel<Q6K>(s, p, x, r0, n, acc); break;
    case Q3K: k256_panel<Q3K>(s, p, x, r0, n, acc); break;
    default: k256_panel<Q2K>(s, p, x, r0, n, acc); break;
  }
}

// ---------------------------------------------------------------- float weights
//
// F16 and BF16 (qlinear.h), 16 channels a register: the avx2 path's scheme (one row converts as
// it streams into its even and odd chains; more rows share a block converted once into L1).

// 16 channels of one input as float32 (exact): VCVTPH2PS, or BF16's bits moved to the top of a float.
template <int64_t FMT>
inline __m512 float_w(const uint8_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (FMT == F16) return _mm512_cvtph_ps(v);
  else return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// BF16's one row: a 64-byte load holds inputs i and i + 1 of the 16 channels, and interleaving
// it with zeros (VPUNPCKLWD/HWD, within 128-bit lanes) puts each value at the top of a float
// lane: the low half holds channels 0-3 and 8-11, the high half 4-7 and 12-15, of input i in
// lanes 0-7 and of input i + 1 in lanes 8-15, so lanes 0-7 are even-input chains and 8-15 odd
// ones, each the reference's FMAs in input order (one load and two interleaves where the
// widening takes two loads, two widenings and two shifts).
void one_bf16(const Segment& s, const uint8_t* p, const float* x, float* sum) {
  __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t i = 0; i < s.k; i += 2, p += 64) {
    if (i % 8 == 0) prefetch_group(p, 256);
    const __m512i v = _mm512_loadu_si512(p);
    const __m512 xx = _mm512_mask_broadcastss_ps(_mm512_set1_ps(x[i]), 0xFF00, _mm_load_ss(x + i + 1));
    lo = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, v)), xx, lo);
    hi = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, v)), xx, hi);
  }
  alignas(64) float l[16], h[16];
  _mm512_store_ps(l, lo);
  _mm512_store_ps(h, hi);
  for (int j = 0; j < 4; ++j) {
    sum[j] = l[j] + l[8 + j];
    sum[4 + j] = h[j] + h[8 + j];
    sum[8 + j] = l[4 + j] + l[12 + j];
    sum[12 + j] = h[4 + j] + h[12 + j];
  }
}

template <int64_t FMT>
void one_float(const Segment& s, const uint8_t* p, const float* x, float* sum) {
  if constexpr (FMT == BF16) return one_bf16(s, p, x, sum);
  __m512 e = _mm512_setzero_ps(), o = _mm512_setzero_ps();
  for (int64_t i = 0; i < s.k; i += 2, p += 64) {
    if (i % 32 == 0) prefetch_group(p, 1024);
    e = _mm512_fmadd_ps(float_w<FMT>(p), _mm512_set1_ps(x[i]), e);
    o = _mm512_fmadd_ps(float_w<FMT>(p + 32), _mm512_set1_ps(x[i + 1]), o);
  }
  _mm512_store_ps(sum, _mm512_add_ps(e, o));
}

// R rows of one converted block (w: [len][16] floats): part[r] holds row r's even and odd chains.
template <int R>
inline void float_tile_rows(const float* w, int len, const float* x, int64_t xk, float (*part)[2][16]) {
  __m512 c[R][2];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 2; ++j) c[r][j] = _mm512_load_ps(part[r][j]);
  for (int i = 0; i < len; i += 2) {
    const __m512 w0 = _mm512_load_ps(w + 16 * i), w1 = _mm512_load_ps(w + 16 * i + 16);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      c[r][0] = _mm512_fmadd_ps(w0, _mm512_set1_ps(x[r * xk + i]), c[r][0]);
      c[r][1] = _mm512_fmadd_ps(w1, _mm512_set1_ps(x[r * xk + i + 1]), c[r][1]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 2; ++j) _mm512_store_ps(part[r][j], c[r][j]);
}

// float_sums' pieces (qlinear.h) for format FMT.
template <int64_t FMT>
struct FloatAvx512 {
  static void one(const Segment& s, const uint8_t* p, const float* x, float* sum) { one_float<FMT>(s, p, x, sum); }
  static void convert(const uint8_t* p, int len, float* w) {
    for (int i = 0; i < len; ++i, p += 32) _mm512_store_ps(w + 16 * i, float_w<FMT>(p));
  }
  static void tiles(const float* w, int len, const float* x, int64_t xk, float (*part)[2][16], int n) {
    int r = 0;
    for (; r + 8 <= n; r += 8) float_tile_rows<8>(w, len, x + r * xk, xk, part + r);
    for (; r + 2 <= n; r += 2) float_tile_rows<2>(w, len, x + r * xk, xk, part + r);
    if (r < n) float_tile_rows<1>(w, len, x + r * xk, xk, part + r);
  }
};

// A full panel of a float format times rows [r0, r0 + n), n <= kRowBlock, written to out.
void float_panel(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int n, const TileOut& out) {
  alignas(64) float sum[kRowBlock * 16];
  (s.fmt == BF16 ? float_sums<FloatAvx512<BF16>> : float_sums<FloatAvx512<F16>>)(s, p, x, r0, n, sum);
  store_rows(sum, r0, n, out);
}

const auto kTiles = count_table<kTile>([](auto R) { return &tile<R>; });  // kTiles[rows - 1]

}  // namespace

int tile_rows_avx512() { return kTile; }

// Up to 11 rows, tiles of at most 10 keep every accumulator in registers and beat the rows
// kernel's loads and stores; from 12 the rows kernel's single pass over the weights wins.
int rows_from_avx512() { return 12; }

// Full panels only (the driver runs a partial one portable).
void tile_avx512(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int rows, const TileOut& out) {
  if (float_format(s.fmt)) return float_panel(s, p, x, r0, rows, out);
  if (uses_k256(s, x)) {
    alignas(64) float acc[kMaxTile * 16] = {0.f};
    k256_rows(s, p, x, r0, rows, acc);
    return store_rows(acc, r0, rows, out);
  }
  kTiles[rows - 1](s, p, x, r0, out);
}

// Full panels only, n <= kRowBlock rows; acc: kRowBlock * 16 floats, 64-byte aligned.
void rows_avx512(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int n, const TileOut& out, float* acc) {
  if (float_format(s.fmt)) return float_panel(s, p, x, r0, n, out);
  for (int r = 0; r < n; ++r) _mm512_store_ps(acc + 16 * r, _mm512_setzero_ps());
  if (uses_k256(s, x)) {
    k256_rows(s, p, x, r0, n, acc);
    return store_rows(acc, r0, n, out);
  }
  switch (s.fmt) {
    case Q4K: rows_q4k(s, p, x, r0, n, acc); break;
    case Q6K: rows_q6k<Q6K>(s, p, x, r0, n, acc); break;
    case Q3K: rows_q6k<Q3K>(s, p, x, r0, n, acc); break;
    case Q2K: rows_q6k<Q2K>(s, p, x, r0, n, acc); break;
    case IQ2XS: rows_q6k<IQ2XS>(s, p, x, r0, n, acc); break;
    case IQ1M: rows_q6k<IQ1M>(s, p, x, r0, n, acc); break;
    case Q5K: rows_q8<Q5K>(s, p, x, r0, n, acc); break;
    case IQ4: rows_q8<IQ4>(s, p, x, r0, n, acc); break;
    case IQ3S: rows_q8<IQ3S>(s, p, x, r0, n, acc); break;
    case IQ3XXS: rows_q8<IQ3XXS>(s, p, x, r0, n, acc); break;
    case IQ2XXS: rows_q8<IQ2XXS>(s, p, x, r0, n, acc); break;
    case IQ1S: rows_q8<IQ1S>(s, p, x, r0, n, acc); break;
    case Q40: rows_q8<Q40>(s, p, x, r0, n, acc); break;
    case Q50: rows_q8<Q50>(s, p, x, r0, n, acc); break;
    case IQ4NL: rows_q8<IQ4NL>(s, p, x, r0, n, acc); break;
    case MXFP4: rows_q8<MXFP4>(s, p, x, r0, n, acc); break;
    case Q41: rows_q8<Q41>(s, p, x, r0, n, acc); break;
    case Q51: rows_q8<Q51>(s, p, x, r0, n, acc); break;
    default: rows_q8<Q8>(s, p, x, r0, n, acc); break;
  }
  store_rows(acc, r0, n, out);
}

void quantize_row_avx512(const float* x, int64_t k, int8_t* q, float* d8, int32_t* s16, int32_t* s32, float* xs) {
  for (int64_t b = 0; b < k / kActBlock; ++b) {
    const float* xb = x + b * kActBlock;
    const __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float d = amax / 127.f;
    const float id = d != 0.f ? 1.f / d : 0.f;
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(id)));
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(id)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kActBlock), _mm512_cvtsepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kActBlock + 16), _mm512_cvtsepi32_epi8(qhi));
    const int32_t a = _mm512_reduce_add_epi32(qlo), c = _mm512_reduce_add_epi32(qhi);
    d8[b] = d;
    s16[2 * b] = a;
    s16[2 * b + 1] = c;
    s32[b] = a + c;
    xs[b] = d * static_cast<float>(a + c);
  }
}

// quantize_row256_portable's bits: 16 registers a block; the maximum and the integer sums are
// exact in any order.
void quantize_row256_avx512(const float* x, int64_t k, int8_t* q, float* d, int16_t* s16, int16_t* s32) {
  for (int64_t b = 0; b < k / kKBlock; ++b) {
    const float* xb = x + b * kKBlock;
    __m512 m = _mm512_setzero_ps();
    for (int i = 0; i < 16; ++i) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(xb + 16 * i)));
    const float amax = _mm512_reduce_max_ps(m);
    const float db = amax / 127.f;
    const __m512 id = _mm512_set1_ps(db != 0.f ? 1.f / db : 0.f);
    int32_t sums[16];
    for (int i = 0; i < 16; ++i) {
      const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + 16 * i), id));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kKBlock + 16 * i), _mm512_cvtsepi32_epi8(v));
      sums[i] = _mm512_reduce_add_epi32(v);
    }
    d[b] = db;
    for (int i = 0; i < 16; ++i) s16[16 * b + i] = static_cast<int16_t>(sums[i]);
    for (int i = 0; i < 8; ++i) s32[8 * b + i] = static_cast<int16_t>(sums[2 * i] + sums[2 * i + 1]);
  }
}

// pre_op_row_portable with the same arithmetic, 16 lanes at a time (k is a multiple of 32).
void pre_op_row_avx512(const float* x, int64_t k, const PreOp& op, float* out) {
  if (op.silu_mul) {
    const __m512 one = _mm512_set1_ps(1.f);
    for (int64_t i = 0; i < k; i += 16) {
      const __m512 g = _mm512_loadu_ps(x + i);
      const __m512 e = exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), g));
      _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)), _mm512_loadu_ps(x + k + i)));
    }
    return;
  }
  __m512 sq = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    sq = _mm512_fmadd_ps(v, v, sq);
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, sq);
  float total = 0.f;
  for (float v : lanes) total += v;
  const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(total / static_cast<float>(k) + op.eps));
  for (int64_t i = 0; i < k; i += 16)
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), inv), _mm512_loadu_ps(op.norm + i)));
}

}  // namespace spx

SPX_END

#endif  // __x86_64__
