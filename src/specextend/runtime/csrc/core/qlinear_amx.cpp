// The amx path's many-row product (qlinear.h): a panel of 16 channels times 16 or more rows on
// Intel AMX tiles, with the reference arithmetic (qlinear_portable.cpp) to the bit.
//
// Per weight group (32 inputs; Q6K's 16) the group's codes are unpacked once a call into B-tile
// rows (the blob's steps of 4 inputs x 16 channels are already TDPBSUD's B layout; Q8's codes are
// read straight from the blob). Then each 16-row tile of activations runs through every group:
// one TDPBSUD (signed int8 activations x unsigned codes into int32, exact) into a C tile zeroed
// for that group, C through memory to the float epilogue, which applies the group's correction,
// activation scale, channel scale (and Q4K's minimum) to the tile's 16 accumulator registers in
// the reference order; groups stay in input order for every row. C, A and B tiles alternate with
// the group's parity, so one group's tile work can run while the previous group's epilogue does.
// Rows are independent: a row's sums never meet another row's, and the tile a row lands in
// changes nothing. Q4K per 256 (SPECEXTEND_K256) has a kernel of its own below, which adds a whole
// super-block in C. Measured on a 2-core Xeon: docs/log/2026-12-amx.md.
//
// The code is one template over a tile backend (amx_tiles.h) and a vector backend for the
// epilogue and unpacking: native tiles with AVX-512 (the amx path; every CPU with AMX has it), and
// emulated tiles with AVX-512 or scalar C++ (the amx-emulated test path, cpu.h).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "half.h"
#include "qlinear.h"
#include "target.h"

#if defined(__x86_64__)
#include "x86.h"
#endif

namespace spx {

namespace {

// One weight group as the epilogue needs it: float channel scales (and the minimums of Q4K and Q4K's header).
struct alignas(64) GroupScales {
  float scale[kPanel];
  float mins[kPanel];
};

// A group's per-row inputs, from the activation block of the group's inputs: the row's scale d8,
// xs (Q4K's minimum term) and the int32 correction offset x sums (Q6K: 32 x the sum of the
// group's 16 codes; the byte-code formats: the format's offset x the block's sum; Q4K none).
struct GroupRows {
  const float* d8;
  const float* xs;
  const int32_t* sums;
  int64_t kb, sum_stride;
  int32_t offset;
  bool has_mins;  // Q4K, Q5K, IQ4, Q2K
  bool mins16;    // Q2K: the minimum term's xs is d8 x the group's 16-code sum (q16_xs), not xs

  float row_xs(int i) const {
    return mins16 ? d8[i * kb] * static_cast<float>(sums[i * sum_stride]) : xs[i * kb];
  }
};

// --------------------------------------------------------------- vector backends

// Plain C++: the reference's operations one lane at a time (the build keeps FMA contraction off).
struct ScalarVec {
  static void unpack_q4k(const uint8_t* cb, uint8_t* w) {
    for (int i = 0; i < 4; ++i)
      for (int b = 0; b < 64; ++b) {
        w[64 * i + b] = cb[64 * i + b] & 15;
        w[64 * (i + 4) + b] = cb[64 * i + b] >> 4;
      }
  }

  static void unpack_q6(int64_t fmt, const uint8_t* sb, int g, uint8_t* w) {
    for (int st = 0; st < 4; ++st)
      for (int b = 0; b < 64; ++b) w[64 * st + b] = static_cast<uint8_t>(q6_code(fmt, sb, g, st, b));
  }

  static void unpack_bytes(int64_t fmt, const uint8_t* cb, uint8_t* w) {
    for (int st = 0; st < 8; ++st)
      for (int b = 0; b < 64; ++b) w[64 * st + b] = static_cast<uint8_t>(byte_code(fmt, cb, st, b));
  }

  // scale[c] = f16 d[c] x q[c] (q: u8, or i8 when `is_signed`); into out[16].
  static void scales(const uint8_t* d, const uint8_t* q, bool is_signed, float* out) {
    const uint16_t* dh = reinterpret_cast<const uint16_t*>(d);
    for (int c = 0; c < kPanel; ++c) {
      const float v = is_signed ? static_cast<float>(static_cast<int8_t>(q[c])) : static_cast<float>(q[c]);
      out[c] = half_to_float(dh[c]) * v;
    }
  }

  static void halves(const uint8_t* d, float* out) {
    const uint16_t* dh = reinterpret_cast<const uint16_t*>(d);
    for (int c = 0; c < kPanel; ++c) out[c] = half_to_float(dh[c]);
  }

  // d as float32 (f32_header) times the signed codes at q.
  static void float_scales(const uint8_t* d, const uint8_t* q, float* out) {
    for (int c = 0; c < kPanel; ++c) {
      float dc;
      std::memcpy(&dc, d + 4 * c, 4);
      out[c] = dc * static_cast<float>(static_cast<int8_t>(q[c]));
    }
  }

  static void exponents(const uint8_t* e, float* out) {
    for (int c = 0; c < kPanel; ++c) out[c] = e8m0_half(e[c]);
  }

  // Q2K's group g: scales d x (byte & 15), minimums dmin x (byte >> 4).
  static void q2k_scales(const uint8_t* sb, int g, GroupScales& gs) {
    const uint16_t* dh = reinterpret_cast<const uint16_t*>(sb);
    for (int c = 0; c < kPanel; ++c) {
      const uint8_t sm = sb[64 + 16 * g + c];
      gs.scale[c] = half_to_float(dh[c]) * static_cast<float>(sm & 15);
      gs.mins[c] = half_to_float(dh[16 + c]) * static_cast<float>(sm >> 4);
    }
  }

  // rows x 16 int32 sums (row stride 16) into the rows' accumulators (row stride 16).
  static void epilogue(const int32_t* sums, int rows, const GroupRows& g, const GroupScales& gs, float* acc) {
    for (int i = 0; i < rows; ++i) {
      const uint32_t corr = static_cast<uint32_t>(g.offset) * static_cast<uint32_t>(g.sums[i * g.sum_stride]);
      const float d8 = g.d8[i * g.kb];
      for (int c = 0; c < kPanel; ++c) {
        const int32_t dot = static_cast<int32_t>(static_cast<uint32_t>(sums[16 * i + c]) - corr);
        const float t = static_cast<float>(dot) * d8;
        float a = std::fma(t, gs.scale[c], acc[16 * i + c]);
        if (g.has_mins) a = std::fma(-gs.mins[c], g.row_xs(i), a);
        acc[16 * i + c] = a;
      }
    }
  }

  // A full 16-row tile's accumulators; plain memory here (the AVX-512 backend keeps them in registers).
  struct Acc {
    float v[kTileMaxRows * 16];
  };
  static void zero(Acc& a) { std::memset(a.v, 0, sizeof(a.v)); }
  template <bool Corr, bool Mins>
  static void epilogue16(const int32_t* sums, const GroupRows& g, const GroupScales& gs, Acc& a) {
    epilogue(sums, kTileMaxRows, g, gs, a.v);
  }
  static void store(const Acc& a, float* acc) { std::memcpy(acc, a.v, sizeof(a.v)); }

  static void finish(const float* acc, int64_t r0, int n, const TileOut& out) {
    for (int r = 0; r < n; ++r)
      for (int c = 0; c < kPanel; ++c) {
        float v = acc[16 * r + c] + (out.bias ? out.bias[c] : 0.f);
        if (out.residual) v = out.residual[(r0 + r) * out.ldo + c] + v;
        out.y[(r0 + r) * out.ldo + c] = v;
      }
  }
};

}  // namespace
}  // namespace spx

#if defined(__x86_64__)
SPX_BEGIN_AVX512
#include "unpack_avx512.h"
namespace spx {
namespace {

// AVX-512: the avx512 path's operations (qlinear_avx512.cpp), 16 channels a register.
struct Avx512Vec {
  static void unpack_q4k(const uint8_t* cb, uint8_t* w) {
    __m512i v[8];
    spx::unpack_q4k(cb, v);
    for (int st = 0; st < 8; ++st) _mm512_storeu_si512(w + 64 * st, v[st]);
  }

  static void unpack_q6(int64_t fmt, const uint8_t* sb, int g, uint8_t* w) {
    __m512i v[4];
    spx::unpack_q6(fmt, sb, g, v);
    for (int st = 0; st < 4; ++st) _mm512_storeu_si512(w + 64 * st, v[st]);
  }

  static void unpack_bytes(int64_t fmt, const uint8_t* cb, uint8_t* w) {
    for (int st = 0; st < 8; ++st) _mm512_storeu_si512(w + 64 * st, step_bytes(fmt, cb, st));
  }

  static __m512 cvt_f16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }

  static void scales(const uint8_t* d, const uint8_t* q, bool is_signed, float* out) {
    const __m128i v = _mm_loadu_si128((const __m128i*)q);
    const __m512i w = is_signed ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v);
    _mm512_store_ps(out, _mm512_mul_ps(cvt_f16(d), _mm512_cvtepi32_ps(w)));
  }

  static void halves(const uint8_t* d, float* out) { _mm512_store_ps(out, cvt_f16(d)); }

  static void float_scales(const uint8_t* d, const uint8_t* q, float* out) {
    const __m512i w = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)q));
    _mm512_store_ps(out, _mm512_mul_ps(_mm512_loadu_ps(d), _mm512_cvtepi32_ps(w)));
  }

  static void exponents(const uint8_t* e, float* out) { _mm512_store_ps(out, e8m0_half16(e)); }

  static void q2k_scales(const uint8_t* sb, int g, GroupScales& gs) {
    __m512 scale, mins;
    q6_scales(Q2K, sb, g, cvt_f16(sb), cvt_f16(sb + 32), &scale, &mins);
    _mm512_store_ps(gs.scale, scale);
    _mm512_store_ps(gs.mins, mins);
  }

  static void epilogue(const int32_t* sums, int rows, const GroupRows& g, const GroupScales& gs, float* acc) {
    const __m512 scale = _mm512_load_ps(gs.scale), mins = _mm512_load_ps(gs.mins);
    for (int i = 0; i < rows; ++i) {
      const int32_t corr = static_cast<int32_t>(static_cast<uint32_t>(g.offset) *
                                                static_cast<uint32_t>(g.sums[i * g.sum_stride]));
      const __m512i c = _mm512_sub_epi32(_mm512_load_si512(sums + 16 * i), _mm512_set1_epi32(corr));
      const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(c), _mm512_set1_ps(g.d8[i * g.kb]));
      __m512 a = _mm512_fmadd_ps(t, scale, _mm512_load_ps(acc + 16 * i));
      if (g.has_mins) a = _mm512_fnmadd_ps(mins, _mm512_set1_ps(g.row_xs(i)), a);
      _mm512_store_ps(acc + 16 * i, a);
    }
  }

  // A full tile's 16 rows x 16 channels in 16 registers across all of a row tile's groups: the
  // epilogue then reads only the C tile's sums and the rows' scalars, never the accumulators.
  struct Acc {
    __m512 v[kTileMaxRows];
  };
  static void zero(Acc& a) {
#pragma GCC unroll 16
    for (int i = 0; i < kTileMaxRows; ++i) a.v[i] = _mm512_setzero_ps();
  }
  // epilogue() for 16 rows, the same operations in the same order per lane; the correction and the
  // minimum term only where the format has them (a zero correction subtracts nothing).
  template <bool Corr, bool Mins>
  static inline void epilogue16(const int32_t* sums, const GroupRows& g, const GroupScales& gs, Acc& a) {
    const __m512 scale = _mm512_load_ps(gs.scale), mins = _mm512_load_ps(gs.mins);
    const uint32_t offset = static_cast<uint32_t>(g.offset);
#pragma GCC unroll 16
    for (int i = 0; i < kTileMaxRows; ++i) {
      __m512i c = _mm512_load_si512(sums + 16 * i);
      if (Corr) {
        const uint32_t corr = offset * static_cast<uint32_t>(g.sums[i * g.sum_stride]);
        c = _mm512_sub_epi32(c, _mm512_set1_epi32(static_cast<int32_t>(corr)));
      }
      const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(c), _mm512_set1_ps(g.d8[i * g.kb]));
      a.v[i] = _mm512_fmadd_ps(t, scale, a.v[i]);
      if (Mins) a.v[i] = _mm512_fnmadd_ps(mins, _mm512_set1_ps(g.row_xs(i)), a.v[i]);
    }
  }
  static void store(const Acc& a, float* acc) {
#pragma GCC unroll 16
    for (int i = 0; i < kTileMaxRows; ++i) _mm512_store_ps(acc + 16 * i, a.v[i]);
  }

  static void finish(const float* acc, int64_t r0, int n, const TileOut& out) { store_rows(acc, r0, n, out); }
};

}  // namespace
}  // namespace spx
SPX_END
#endif  // __x86_64__

namespace spx {

namespace {

// --------------------------------------------------------------- the tile kernel

// Tile registers: C tiles 0 and 1 and A tiles 2 and 3 alternate between consecutive items, B tiles
// 4 and 5 between consecutive groups; 6 (C) and 7 (A) take the last row tile when the row count
// is above 16 and not a multiple of it (fewer rows: a configuration of its own).
constexpr int kC0 = 0, kA0 = 2, kB0 = 4, kCTail = 6, kATail = 7;

TileConfig config_for(int group, int n) {
  TileConfig cfg;
  const int full = std::min(n, kTileMaxRows), tail = n > kTileMaxRows ? n % kTileMaxRows : 0;
  for (int j = 0; j < 2; ++j) {
    cfg.rows[kC0 + j] = static_cast<uint8_t>(full);
    cfg.colsb[kC0 + j] = 64;
    cfg.rows[kA0 + j] = static_cast<uint8_t>(full);
    cfg.colsb[kA0 + j] = static_cast<uint16_t>(group);
    cfg.rows[kB0 + j] = static_cast<uint8_t>(group / 4);
    cfg.colsb[kB0 + j] = 64;
  }
  if (tail > 0) {
    cfg.rows[kCTail] = static_cast<uint8_t>(tail);
    cfg.colsb[kCTail] = 64;
    cfg.rows[kATail] = static_cast<uint8_t>(tail);
    cfg.colsb[kATail] = static_cast<uint16_t>(group);
  }
  return cfg;
}

// One item's tile work: a row tile's activations times the group's B tile into C, then C to memory.
template <class T, int C, int A, int B>
void tile_item(const int8_t* a, int64_t lda, int32_t* c) {
  T::template load<A>(a, lda);
  T::template zero<C>();
  T::template dpbsud<C, A, B>();
  T::template store<C>(c, 64);
}

// A group of the panel: where its codes are (B rows of 64 bytes) and its scales.
template <class V>
const uint8_t* prepare_group(const Segment& s, const uint8_t* p, int64_t gi, uint8_t* buf, GroupScales& gs) {
  if (s.fmt == Q4K) {
    const int64_t sbg = s.sbg, g = gi % sbg;
    const uint8_t* sb = p + (gi / sbg) * (64 + 288 * sbg);
    V::scales(sb, sb + 64 + 16 * g, false, gs.scale);
    V::scales(sb + 32, sb + 64 + 16 * sbg + 16 * g, false, gs.mins);
    V::unpack_q4k(sb + 64 + 32 * sbg + 256 * g, buf);
    return buf;
  }
  if (six_bit(s.fmt)) {
    const int64_t g = gi % 16;
    const uint8_t* sb = p + (gi / 16) * s.fi().bytes;
    if (s.fmt == Q2K) V::q2k_scales(sb, static_cast<int>(g), gs);
    else if (f32_d(s.fmt)) V::float_scales(sb, sb + q6_scales_at(s.fmt) + 16 * g, gs.scale);
    else V::scales(sb, sb + q6_scales_at(s.fmt) + 16 * g, true, gs.scale);
    V::unpack_q6(s.fmt, sb, static_cast<int>(g), buf);
    return buf;
  }
  // The byte-code formats: d and dmin, each times its code where the format has codes (qlinear.h).
  const FormatInfo fi = s.fi();
  const int64_t groups = fi.superblock / 32;
  const int g = static_cast<int>(gi % groups);
  const uint8_t* sb = p + (gi / groups) * fi.bytes;
  if (f32_header(s.fmt)) V::float_scales(sb, group_scales(s.fmt, sb, g), gs.scale);
  else if (scale_codes(s.fmt)) V::scales(sb, group_scales(s.fmt, sb, g), true, gs.scale);
  else if (e8m0_header(s.fmt)) V::exponents(sb, gs.scale);
  else V::halves(sb, gs.scale);
  if (k_header(s.fmt)) V::scales(sb + 32, group_mins(s.sbg, sb, g), false, gs.mins);
  else if (min_header(s.fmt)) V::halves(sb + 32, gs.mins);
  const uint8_t* cb = byte_codes(s.fmt, s.sbg, sb, g);
  if (s.fmt == Q8) return cb;  // Q8's codes are B's layout already
  V::unpack_bytes(s.fmt, cb, buf);
  return buf;
}

// A group's per-row inputs for the rows from `row`, the group starting at input k0.
inline GroupRows epilogue_rows(const Segment& s, const Rows& x, int64_t row, int64_t k0) {
  const int64_t kb = x.k / 32, k16 = x.k / 16;
  const int64_t b = row * kb + k0 / 32;
  GroupRows g{x.d8 + b, x.xs + b, x.s32 + b, kb, kb, 0, s.fmt == Q4K || has_minimum(s.fmt), false};  // Q4K: no correction
  if (six_bit(s.fmt)) {
    g.sums = x.s16 + row * k16 + k0 / 16;
    g.sum_stride = k16;
    g.offset = q6_zero(s.fmt);
    g.has_mins = g.mins16 = s.fmt == Q2K;
  }
  if (byte_format(s.fmt)) g.offset = static_cast<int32_t>(s.offset);
  return g;
}

// The panel's groups, prepared once a call for all its row tiles: where each group's B rows are
// and its scales (per thread, grown to the widest product seen).
struct PanelGroups {
  std::vector<uint8_t> codes;
  std::vector<GroupScales> scales;
  std::vector<const uint8_t*> b;

  template <class V>
  void prepare(const Segment& s, const uint8_t* p, int64_t groups) {
    if (static_cast<int64_t>(b.size()) < groups) {
      codes.resize(512 * groups);
      scales.resize(groups);
      b.resize(groups);
    }
    for (int64_t gi = 0; gi < groups; ++gi) b[gi] = prepare_group<V>(s, p, gi, codes.data() + 512 * gi, scales[gi]);
  }
};

// One item of a full 16-row tile: the group's B tile, the row tile's activations, C to `sums`.
// C, A and B tiles alternate with the group's parity, so one group's multiply can run while the
// previous group's epilogue does.
template <class T, int P>
inline void full_item(const uint8_t* b, const int8_t* a, int64_t lda, int32_t* sums) {
  T::template load<kB0 + P>(b, 64);
  tile_item<T, kC0 + P, kA0 + P, kB0 + P>(a, lda, sums);
}

// A full tile of 16 rows from `row` times every group of the panel, its accumulators kept by the
// vector backend (in registers on AVX-512) from the first group to the last; into acc [16][16].
template <class T, class V, bool Corr, bool Mins>
void full_tile(const Segment& s, const Rows& x, int64_t row, const PanelGroups& pg, int64_t groups, int group,
               float* acc) {
  typename V::Acc a;
  V::zero(a);
  alignas(64) int32_t sums[2][kTileMaxRows * 16];
  const int8_t* rows = x.q8 + row * x.k;
  for (int64_t gi = 0; gi < groups; ++gi) {
    if (gi & 1) full_item<T, 1>(pg.b[gi], rows + gi * group, x.k, sums[1]);
    else full_item<T, 0>(pg.b[gi], rows + gi * group, x.k, sums[0]);
    if (gi > 0)
      V::template epilogue16<Corr, Mins>(sums[(gi - 1) & 1], epilogue_rows(s, x, row, (gi - 1) * group),
                                         pg.scales[gi - 1], a);
  }
  V::template epilogue16<Corr, Mins>(sums[(groups - 1) & 1], epilogue_rows(s, x, row, (groups - 1) * group),
                                     pg.scales[groups - 1], a);
  V::store(a, acc);
}

// A tile of fewer than 16 rows (a call of fewer rows, or the last of a count not a multiple of
// 16): its own C and A tiles, accumulators in memory.
template <class T, class V, int C, int A>
void part_tile(const Segment& s, const Rows& x, int64_t row, int rows, const PanelGroups& pg, int64_t groups,
               int group, float* acc) {
  alignas(64) int32_t sums[kTileMaxRows * 16];
  std::memset(acc, 0, sizeof(float) * 16 * rows);
  const int8_t* a = x.q8 + row * x.k;
  for (int64_t gi = 0; gi < groups; ++gi) {
    T::template load<kB0>(pg.b[gi], 64);
    tile_item<T, C, A, kB0>(a + gi * group, x.k, sums);
    V::epilogue(sums, rows, epilogue_rows(s, x, row, gi * group), pg.scales[gi], acc);
  }
}

// Panel `p` times rows [r0, r0 + n), any n >= 1, in blocks of at most kRowBlock (acc: kRowBlock x 16
// floats, 64-byte aligned). The groups are unpacked once for all the rows, then each row tile runs
// through all of them: every row's accumulators see the groups in input order, as in the reference.
template <class T, class V>
void rows_tiles(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int n, const TileOut& out,
                float* acc) {
  const FormatInfo fi = s.fi();
  const int64_t groups = s.k / fi.group;
  thread_local PanelGroups pg;
  pg.prepare<V>(s, p, groups);
  const GroupRows g = epilogue_rows(s, x, r0, 0);
  const auto tiles = g.offset == 0 ? (g.has_mins ? full_tile<T, V, false, true> : full_tile<T, V, false, false>)
                                   : (g.has_mins ? full_tile<T, V, true, true> : full_tile<T, V, true, false>);
  const int64_t blocks = (n + kRowBlock - 1) / kRowBlock;  // balanced: 65 rows are 32 + 33, not 64 + 1
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t rb = r0 + b * n / blocks;
    const int nb = static_cast<int>(r0 + (b + 1) * n / blocks - rb);
    // Each block loads its own configuration on its own thread (whichever worker runs it) and
    // releases the tiles after, so no thread ever runs a tile instruction unconfigured.
    T::config(config_for(fi.group, nb));
    const int full = nb / kTileMaxRows, tail = nb % kTileMaxRows;
    for (int t = 0; t < full; ++t) tiles(s, x, rb + int64_t{t} * kTileMaxRows, pg, groups, fi.group, acc + 256 * t);
    if (tail > 0) {
      float* at = acc + 256 * full;
      if (full == 0) part_tile<T, V, kC0, kA0>(s, x, rb, tail, pg, groups, fi.group, at);
      else part_tile<T, V, kCTail, kATail>(s, x, rb + int64_t{full} * kTileMaxRows, tail, pg, groups, fi.group, at);
    }
    T::release();
    V::finish(acc, rb, nb, out);
  }
}

}  // namespace

// --------------------------------------------------------------- Q4K per 256 on the tiles
//
// With one activation scale per 256 values (SPECEXTEND_K256, qlinear.h) a Q4K super-block's
// isum = sum over its 8 groups of scale code x dot product is an integer, so the tiles can add
// all 8 groups in C with no epilogue between them: the scale code (6 bits) is split as lo + 8 hi
// (3 bits each) and folded into two B operands, code x lo and code x hi (at most 15 x 7, a byte),
// two groups to a K = 64 tile; isum = C_lo + 8 C_hi is the reference's integer to the bit, and one
// epilogue a super-block (the minimum term's VPDPWSSD and two float steps, avx512's k256_panel's
// operations in its order) closes it, instead of a float epilogue every 32 inputs.
#if defined(__x86_64__)
SPX_BEGIN_AVX512
namespace {

// C tiles lo and hi of two row tiles, their A tiles, and one super-block pair's B tiles: each B
// tile loaded serves both row tiles (the tile loads, not the multiplies, bound these kernels).
constexpr int kKC = 0, kKA = 4, kKBlo = 6, kKBhi = 7;  // C: lo0, hi0, lo1, hi1

struct alignas(64) SuperScales {
  float d[16], dmin[16];
  int32_t mn[4][16];  // minimum codes of groups 2j, 2j + 1 as int16 pairs
};

// A panel's super-blocks as the tiles take them: [sb][pair][lo, hi][16 B rows of 64 bytes].
struct K256Panel {
  std::vector<uint8_t> b;
  std::vector<SuperScales> sc;

  void prepare(const uint8_t* p, int64_t nsb, int64_t sb_bytes) {
    if (static_cast<int64_t>(sc.size()) < nsb) {
      b.resize(8192 * nsb);
      sc.resize(nsb);
    }
    const __m512i seven = _mm512_set1_epi32(7);
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* q = p + sb * sb_bytes;
      SuperScales& ss = sc[sb];
      _mm512_store_ps(ss.d, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q))));
      _mm512_store_ps(ss.dmin, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32))));
      __m512i mn[4];
      k256_min_pairs<Q4K>(q, mn);
      for (int j = 0; j < 4; ++j) _mm512_store_si512(ss.mn[j], mn[j]);
      for (int g = 0; g < 8; ++g) {
        const __m512i sc32 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 64 + 16 * g)));
        const __m512i lo = _mm512_and_si512(sc32, seven), hi = _mm512_srli_epi32(sc32, 3);
        // Each channel's factor in both int16 halves of its lane: VPMULLW then multiplies each
        // byte code by it with no carry between the bytes (code x factor <= 105).
        const __m512i mlo = _mm512_or_si512(lo, _mm512_slli_epi32(lo, 16));
        const __m512i mhi = _mm512_or_si512(hi, _mm512_slli_epi32(hi, 16));
        const uint8_t* cb = q + 64 + 32 * 8 + 256 * g;
        uint8_t* dst = b.data() + 8192 * sb + 2048 * (g / 2) + 512 * (g % 2);
        __m512i w[8];
        unpack_q4k(cb, w);
        for (int st = 0; st < 8; ++st) {
          _mm512_storeu_si512(dst + 64 * st, _mm512_mullo_epi16(w[st], mlo));
          _mm512_storeu_si512(dst + 1024 + 64 * st, _mm512_mullo_epi16(w[st], mhi));
        }
      }
    }
  }
};

TileConfig k256_config(int rows) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(t >= kKBlo ? 16 : rows);
    cfg.colsb[t] = 64;
  }
  return cfg;
}

// Row i's close of a super-block: k256_panel's float steps over isum = lo + 8 hi and imin.
inline __m512 k256_close(__m512 a, const int32_t* lo, const int32_t* hi, const SuperScales& ss, float dk,
                         const int16_t* sums) {
  const __m512i isum = _mm512_add_epi32(_mm512_load_si512(lo), _mm512_slli_epi32(_mm512_load_si512(hi), 3));
  const __m512 vdk = _mm512_set1_ps(dk);
  a = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(isum), vdk), _mm512_load_ps(ss.d), a);
  __m512i imin = _mm512_setzero_si512();
  const int32_t* pairs = reinterpret_cast<const int32_t*>(sums);
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) imin = _mm512_dpwssd_epi32(imin, _mm512_load_si512(ss.mn[j]), _mm512_set1_epi32(pairs[j]));
  return _mm512_fnmadd_ps(_mm512_load_ps(ss.dmin), _mm512_mul_ps(_mm512_cvtepi32_ps(imin), vdk), a);
}

// One (Two: two) row tiles of `rows` rows each from `row` through every super-block, into acc
// [rows (x 2)][16], zeroed here. The tiles of super-block sb run while the previous one closes.
template <class T, bool Two>
void k256_tiles(const Rows& x, int64_t row, int rows, const K256Panel& pp, int64_t nsb, float* acc) {
  constexpr int kTiles = Two ? 2 : 1;
  std::memset(acc, 0, sizeof(float) * 16 * rows * kTiles);
  alignas(64) int32_t sums[2][4][kTileMaxRows * 16];
  const int64_t kd = x.k / 256, k32 = x.k / 32;
  const auto close = [&](int64_t sb) {
    for (int t = 0; t < kTiles; ++t)
      for (int i = 0; i < rows; ++i) {
        const int64_t r = row + t * kTileMaxRows + i;
        float* at = acc + 16 * (t * rows + i);
        _mm512_store_ps(at, k256_close(_mm512_load_ps(at), sums[sb & 1][2 * t] + 16 * i,
                                       sums[sb & 1][2 * t + 1] + 16 * i, pp.sc[sb], x.kd[r * kd + sb],
                                       x.ks32 + r * k32 + sb * 8));
      }
  };
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const int8_t* act = x.kq8 + row * x.k + sb * 256;
    const int8_t* act1 = act + kTileMaxRows * x.k;
    const uint8_t* b = pp.b.data() + 8192 * sb;
    T::template zero<kKC>();
    T::template zero<kKC + 1>();
    if (Two) {
      T::template zero<kKC + 2>();
      T::template zero<kKC + 3>();
    }
    for (int j = 0; j < 4; ++j, b += 2048) {
      T::template load<kKBlo>(b, 64);
      T::template load<kKBhi>(b + 1024, 64);
      T::template load<kKA>(act + 64 * j, x.k);
      T::template dpbsud<kKC, kKA, kKBlo>();
      T::template dpbsud<kKC + 1, kKA, kKBhi>();
      if (Two) {
        T::template load<kKA + 1>(act1 + 64 * j, x.k);
        T::template dpbsud<kKC + 2, kKA + 1, kKBlo>();
        T::template dpbsud<kKC + 3, kKA + 1, kKBhi>();
      }
    }
    T::template store<kKC>(sums[sb & 1][0], 64);
    T::template store<kKC + 1>(sums[sb & 1][1], 64);
    if (Two) {
      T::template store<kKC + 2>(sums[sb & 1][2], 64);
      T::template store<kKC + 3>(sums[sb & 1][3], 64);
    }
    if (sb > 0) close(sb - 1);
  }
  close(nsb - 1);
}

// A Q4K panel with per-256 activations, rows [r0, r0 + n), into out (acc: n x 16 floats scratch).
template <class T>
void k256_rows_tiles(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int n, const TileOut& out,
                     float* acc) {
  const int64_t nsb = s.k / 256;
  thread_local K256Panel pp;
  pp.prepare(p, nsb, s.fi().bytes);
  const int64_t blocks = (n + kRowBlock - 1) / kRowBlock;  // balanced: 65 rows are 32 + 33, not 64 + 1
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t rb = r0 + b * n / blocks;
    const int nb = static_cast<int>(r0 + (b + 1) * n / blocks - rb);
    const int full = nb / kTileMaxRows, tail = nb % kTileMaxRows;
    if (full > 0) {
      T::config(k256_config(kTileMaxRows));
      int t = 0;
      for (; t + 1 < full; t += 2)
        k256_tiles<T, true>(x, rb + int64_t{t} * kTileMaxRows, kTileMaxRows, pp, nsb, acc + 256 * t);
      if (t < full) k256_tiles<T, false>(x, rb + int64_t{t} * kTileMaxRows, kTileMaxRows, pp, nsb, acc + 256 * t);
    }
    if (tail > 0) {
      T::config(k256_config(tail));  // a configuration's rows for the last tile (loading one zeroes the tiles)
      k256_tiles<T, false>(x, rb + int64_t{full} * kTileMaxRows, tail, pp, nsb, acc + 256 * full);
    }
    T::release();
    store_rows(acc, rb, nb, out);
  }
}

}  // namespace
SPX_END
#endif  // __x86_64__

bool amx_k256_tiles(Path path, int64_t fmt) {
  return fmt == Q4K && (path == Path::AMX || (path == Path::AMXEmulated && vector_path(path) == Path::AVX512));
}

#if defined(__x86_64__) && !defined(SPECEXTEND_EMULATE_AVX512)
SPX_BEGIN_AVX512
// Flattened under AVX-512's target, so the tile loop, its epilogue and the accumulators of a full
// tile compile as one AVX-512 function and the 16 accumulators stay in registers.
__attribute__((flatten)) void rows_amx(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int n,
                                       const TileOut& out, float* acc) {
  if (uses_k256(s, x) && s.fmt == Q4K) return k256_rows_tiles<NativeTiles>(s, p, x, r0, n, out, acc);
  rows_tiles<NativeTiles, Avx512Vec>(s, p, x, r0, n, out, acc);
}
SPX_END
#endif

void rows_amx_emulated(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int n, const TileOut& out,
                       float* acc) {
#if defined(__x86_64__)
  // The vector half that would run beside the tiles where this CPU has it (the exactness program's
  // AVX-512 emulation included), so the emulation checks the amx path's own epilogue too.
  if (cpu_supports(Path::AVX512)) {
    if (uses_k256(s, x) && s.fmt == Q4K) return k256_rows_tiles<EmuTiles>(s, p, x, r0, n, out, acc);
    return rows_tiles<EmuTiles, Avx512Vec>(s, p, x, r0, n, out, acc);
  }
#endif
  rows_tiles<EmuTiles, ScalarVec>(s, p, x, r0, n, out, acc);
}

}  // namespace spx
