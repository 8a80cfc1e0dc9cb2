// The driver of the quantized linear layers (qlinear.h): formats, the per-path dispatch, tiling.
#include "qlinear.h"

#include "amx_tiles.h"
#include "family.h"
#include "half.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace spx {

bool format_info(int64_t fmt, int64_t sbg, FormatInfo* out) {
  switch (fmt) {
    case Q4K:
      if (sbg < 1 || sbg > 8) return false;
      *out = {32, static_cast<int>(32 * sbg), 64 + 288 * sbg};
      return true;
    case Q6K:
    case Q3K:
    case Q2K:
    case IQ2XS:
    case IQ1M: *out = {16, 256, q6_header(fmt) + 16 * group16_bytes(fmt)}; return true;
    case Q8:
    case Q40:
    case Q50:
    case IQ4NL:
    case MXFP4:
    case Q41:
    case Q51: *out = {32, 32, byte_header(fmt, 1) + code_bytes(fmt)}; return true;
    case Q5K:
    case IQ4:
    case IQ3S:
    case IQ3XXS:
    case IQ2XXS:
    case IQ1S:
      if (sbg < 1 || sbg > 8) return false;
      *out = {32, static_cast<int>(32 * sbg), byte_header(fmt, sbg) + code_bytes(fmt) * sbg};
      return true;
    case F16:
    case BF16:
    case BF16D: *out = {32, 32, 32 * 32}; return true;
    default: return false;
  }
}

namespace {
int64_t g_k256 = 0;
}  // namespace

int64_t k256_formats() { return g_k256; }
void set_k256(int64_t formats) { g_k256 = formats; }

namespace {

using TileFn = void (*)(const Segment&, const uint8_t*, const Rows&, int64_t, int, const TileOut&);
using RowsFn = void (*)(const Segment&, const uint8_t*, const Rows&, int64_t, int, const TileOut&, float*);
using QuantFn = void (*)(const float*, int64_t, int8_t*, float*, int32_t*, int32_t*, float*);
using Quant256Fn = void (*)(const float*, int64_t, int8_t*, float*, int16_t*, int16_t*);
using PreFn = void (*)(const float*, int64_t, const PreOp&, float*);
using PairFn = void (*)(const Segment&, const uint8_t*, const Rows&, int64_t, const TileOut&, const TileOut&);
using Bf16RowsFn = void (*)(const Segment&, const uint8_t*, const Rows&, int64_t, int, int, const TileOut*);
using Bf16OneFn = void (*)(const Segment&, const uint8_t*, const Rows&, int64_t, int, const TileOut*);

struct Kernels {
  TileFn tile;
  int tile_rows;
  RowsFn rows;    // null: tiles at every row count
  int rows_from;  // from this many rows `rows` beats tiles (below it, tiles keep the accumulators in registers)
  QuantFn quantize;
  PreFn pre_op;
  bool group_rows = false;  // `rows` reads the group-major codes (Rows::q8g)
  PairFn float_pair = nullptr;  // one row over two adjacent full float panels (null: one at a time)
  Quant256Fn quantize256 = quantize_row256_portable;
  // Whether tile and rows compute the K-quants' per-256 arithmetic (Rows::kq8); a path without it
  // runs those segments on the portable tiles (the same bits, slowly).
  bool k256 = false;
  // Whether `rows` takes any number of rows at once (the amx kernels: each panel prepared once for
  // all of them, in blocks of kRowBlock inside), so a unit may hold kAmxRowBlock rows.
  bool rows_span = false;
  // BF16D's kernels (null: the portable tiles): n <= kRowBlock rows of one or two adjacent full
  // panels, and one row over up to kBf16OnePanels.
  Bf16RowsFn bf16d_rows = nullptr;
  Bf16OneFn bf16d_one = nullptr;
};
constexpr int kBf16OnePanels = 4;  // a one-row chain a channel: four panels' chains in flight at once

Kernels kernels_for(Path path) {
  if (path == Path::AMX || path == Path::AMXEmulated) {
    // From 16 rows the tiles (a tile's rows; fewer would leave rows of every tile idle and keep
    // the accumulators in memory: a 9-row verification took 1.7x avx512's); below, the vector path.
    Kernels k = kernels_for(vector_path(path));
#if defined(__x86_64__) && !defined(SPECEXTEND_EMULATE_AVX512)
    k.rows = path == Path::AMX ? rows_amx : rows_amx_emulated;
#else
    k.rows = rows_amx_emulated;
#endif
    k.rows_from = kTileMaxRows;
    k.group_rows = false;
    k.rows_span = true;
    return k;
  }
  switch (path) {
#if defined(__x86_64__)
    case Path::AVX2:
      return {tile_avx2, tile_rows_avx2(), rows_avx2, rows_from_avx2(), quantize_row_avx2, pre_op_row_avx2, true,
              float_pair_avx2};
    case Path::AVX512: {
      Kernels k{tile_avx512, tile_rows_avx512(), rows_avx512, rows_from_avx512(), quantize_row_avx512,
                pre_op_row_avx512};
      k.quantize256 = quantize_row256_avx512;
      k.k256 = true;
      if (cpu_has_avx512_bf16()) {
        k.bf16d_rows = bf16d_rows_avx512;
        k.bf16d_one = bf16d_one_avx512;
      }
      return k;
    }
#endif
#if defined(__aarch64__)
    case Path::NEON: return {tile_neon, tile_rows_neon(), rows_neon, rows_from_neon(), quantize_row_neon, pre_op_row_neon};
#endif
    default: return {tile_portable, 4, nullptr, 0, quantize_row_portable, pre_op_row_portable};
  }
}

// Rows [r0, r1) of one panel in balanced tiles of at most tile_rows (16 rows in tiles of 10: 8 + 8, not
// 10 + 6); which tile a row lands in never changes its bits.
void balanced_tiles(TileFn tile, int tile_rows, const Segment& s, const uint8_t* pb, const Rows& x, int64_t r0,
                    int64_t r1, const TileOut& out) {
  const int64_t tiles = (r1 - r0 + tile_rows - 1) / tile_rows;
  for (int64_t ti = 0, r = r0; ti < tiles; ++ti) {
    const int rows = static_cast<int>((r1 - r) / (tiles - ti));
    tile(s, pb, x, r, rows, out);
    r += rows;
  }
}

// A partial panel (the last of a segment whose width is not a multiple of 16) for rows [r0, r1) through the
// path's vector tile: the blob holds it as a whole panel (zeros past the width) and each lane is its own
// channel, so the tile gives the valid channels the bits it gives a full panel's (every path's tile gives the
// portable tile's), into a full panel's scratch rows with the bias and residual padded the same way; the
// valid columns are copied out. (The portable tile, which can write part of a panel, ran 7-10x slower: a
// router of 40 experts' three parts, 120 rows, took 110 us a row against 15 for 128 rows.) The scratch is the
// thread's, kept between calls: a decode step meets the same partial panels every layer.
void partial_panel(TileFn tile, int tile_rows, const Segment& s, const uint8_t* pb, const Rows& x, int64_t r0,
                   int64_t r1, const TileOut& out) {
  thread_local std::vector<float> y, res, bias;
  const int v = out.valid;
  const size_t need = static_cast<size_t>(r1) * kPanel;  // rows are addressed by their index in the call
  if (y.size() < need) y.resize(need);
  TileOut pad{y.data(), kPanel, nullptr, nullptr, kPanel};
  if (out.bias != nullptr) {
    bias.assign(kPanel, 0.f);
    std::copy(out.bias, out.bias + v, bias.begin());
    pad.bias = bias.data();
  }
  if (out.residual != nullptr) {
    if (res.size() < need) res.resize(need);
    for (int64_t r = r0; r < r1; ++r)  // lanes past the width keep whatever they held: they are never read back
      std::copy(out.residual + r * out.ldo, out.residual + r * out.ldo + v, res.begin() + r * kPanel);
    pad.residual = res.data();
  }
  balanced_tiles(tile, tile_rows, s, pb, x, r0, r1, pad);
  for (int64_t r = r0; r < r1; ++r) std::copy(y.begin() + r * kPanel, y.begin() + r * kPanel + v, out.y + r * out.ldo);
}

// BF16D's panels from p (the segment's panel index; `left` of them in this call) for rows [r0, r1):
// its kernels where the path has them, else the portable tiles. Returns the panels done.
template <class OutAt>
int64_t bf16d_block(const Kernels& kn, const Segment& s, const uint8_t* pb, const Rows& x, int64_t r0, int64_t r1,
                    int64_t left, const OutAt& out_at, int64_t p) {
  TileOut outs[kBf16OnePanels] = {out_at(p)};
  const bool one = r1 - r0 == 1;
  int panels = 0;  // adjacent full panels the kernel takes at once: up to four for one row, two for more
  if (outs[0].valid == kPanel && (one ? kn.bf16d_one != nullptr : kn.bf16d_rows != nullptr))
    for (panels = 1; panels < (one ? kBf16OnePanels : 2) && panels < left; ++panels)
      if ((outs[panels] = out_at(p + panels)).valid != kPanel) break;
  if (panels > 0 && one) {
    kn.bf16d_one(s, pb, x, r0, panels, outs);
    return panels;
  }
  for (int64_t r = r0; r < r1; r += kRowBlock) {
    const int n = static_cast<int>(std::min<int64_t>(kRowBlock, r1 - r));
    if (panels > 0)
      kn.bf16d_rows(s, pb, x, r, n, panels, outs);
    else
      for (int t = 0; t < n; t += kMaxTile) tile_portable(s, pb, x, r + t, std::min(kMaxTile, n - t), outs[0]);
  }
  return std::max(panels, 1);
}

}  // namespace

bool wants_group_rows(Path path, int64_t m) {
  const Kernels kn = kernels_for(path);
  return kn.group_rows && m >= kn.rows_from;
}

void quantize_rows(Path path, const float* x, int64_t ldx, const PreOp& op, const Rows& a, int64_t r0, int64_t r1,
                   float* scratch) {
  const Kernels kn = kernels_for(path);
  const int64_t k = a.k, kb = k / kActBlock;
  const bool pre = op.norm != nullptr || op.silu_mul;
  for (int64_t r = r0; r < r1; ++r) {
    const float* src = x + r * ldx;
    if (pre) {
      if (op.center) {  // one scalar pass, the same on every path: the vector paths then norm the centred row
        center_row(src, k, scratch);
        src = scratch;
      }
      kn.pre_op(src, k, op, scratch);
      src = scratch;
    }
    kn.quantize(src, k, a.q8 + r * k, a.d8 + r * kb, a.s16 + r * (k / 16), a.s32 + r * kb, a.xs + r * kb);
    if (a.kq8 != nullptr) kn.quantize256(src, k, a.kq8 + r * k, a.kd + r * (k / kKBlock), a.ks16 + r * (k / 16),
                                         a.ks32 + r * kb);
    if (a.q8g != nullptr)
      for (int64_t b = 0; b < kb; ++b) std::memcpy(a.q8g + (b * a.gm + r) * 32, a.q8 + r * k + 32 * b, 32);
    if (a.xf != nullptr) std::memcpy(a.xf + r * k, src, sizeof(float) * k);
    if (a.xb != nullptr) {
      for (int64_t j = 0; j < k / 2; ++j)
        a.xb[j * a.xbm + r] = bf16_round(src[2 * j]) | static_cast<uint32_t>(bf16_round(src[2 * j + 1])) << 16;
    }
  }
}

void linear_block(Path path, const Linear& op, int64_t p0, int64_t p1, int64_t r0, int64_t r1, float* scratch) {
  // The float formats have no tile-unit code, and of the K-quants per 256 only Q4K has one: on the
  // amx paths the others run their vector path's kernels.
  const Kernels kq = kernels_for(path), kf = kernels_for(vector_path(path));
  const bool vector = vector_path(path) != Path::Portable;
  const int64_t m = r1 - r0;
  int64_t si = 0, col0 = 0;
  for (int64_t gp = p0; gp < p1; ++gp) {
    while (gp >= op.first_panel[si + 1]) col0 += op.segs[si++].n;
    const Segment& s = op.segs[si];
    const bool k256 = uses_k256(s, op.x);
    const Kernels& kn = float_format(s.fmt) || (k256 && !amx_k256_tiles(path, s.fmt)) ? kf : kq;
    const bool by_rows = kn.rows != nullptr && m >= kn.rows_from && (!kn.group_rows || op.x.q8g != nullptr);
    const int64_t p = gp - op.first_panel[si];
    const uint8_t* pb = s.blob + p * s.panel_bytes();
    const auto out_at = [&](int64_t panel) {
      const int64_t c = col0 + panel * kPanel;
      return TileOut{op.y + c, op.ldy, op.bias ? op.bias + c : nullptr, op.residual ? op.residual + c : nullptr,
                     static_cast<int>(std::min<int64_t>(kPanel, s.n - panel * kPanel))};
    };
    const TileOut out = out_at(p);
    if (bf16_dot_format(s.fmt)) {
      gp += bf16d_block(kf, s, pb, op.x, r0, r1, std::min(p1, op.first_panel[si + 1]) - gp, out_at, p) - 1;
      continue;
    }
    // One row takes a float segment's full panels two at a time where the path has a kernel for it.
    if (m == 1 && vector && kn.float_pair != nullptr && float_format(s.fmt) &&
        gp + 1 < std::min(p1, op.first_panel[si + 1])) {
      const TileOut next = out_at(p + 1);
      if (next.valid == kPanel) {
        kn.float_pair(s, pb, op.x, r0, out, next);
        ++gp;
        continue;
      }
    }
    if (k256 && !kn.k256) {  // a path without the per-256 kernels: the reference tiles
      for (int64_t r = r0; r < r1; r += kMaxTile)
        tile_portable(s, pb, op.x, r, static_cast<int>(std::min<int64_t>(kMaxTile, r1 - r)), out);
      continue;
    }
    if (by_rows && out.valid == kPanel && kn.rows_span) {
      kn.rows(s, pb, op.x, r0, static_cast<int>(m), out, scratch);  // any count: blocks of kRowBlock inside
      continue;
    }
    if (by_rows && out.valid == kPanel) {
      for (int64_t r = r0; r < r1; r += kRowBlock)
        kn.rows(s, pb, op.x, r, static_cast<int>(std::min<int64_t>(kRowBlock, r1 - r)), out, scratch);
      continue;
    }
    (vector && out.valid < kPanel ? partial_panel : balanced_tiles)(kn.tile, kn.tile_rows, s, pb, op.x, r0, r1, out);
  }
}

void linear_panels(Path path, const Linear& op, int64_t p0, int64_t p1) {
  std::vector<float> scratch(kRowBlock * kPanel + 16);
  float* acc = scratch.data() + ((16 - (reinterpret_cast<uintptr_t>(scratch.data()) / 4) % 16) % 16);
  linear_block(path, op, p0, p1, 0, op.m, acc);
}

LinearWork plan_linear(Path path, const Linear& op, int64_t panels, int threads) {
  LinearWork w{};
  w.m = op.m;
  w.panels = panels;
  const int64_t block = kernels_for(path).rows_span ? kAmxRowBlock : kRowBlock;
  w.row_blocks = (op.m + block - 1) / block;
  if (w.row_blocks == 0 || panels == 0) return w;  // no rows (a prefill chunk asks no logits): no units
  w.row_block = (op.m + w.row_blocks - 1) / w.row_blocks;
  // At least 8 units a thread (a thread slowed by another process hands its share over), and
  // chunks of at least 4 panels so a chunk streams a few contiguous KB of weights.
  const int64_t want = std::max<int64_t>(1, 8 * threads / w.row_blocks);
  w.chunk = std::max<int64_t>(std::min<int64_t>(4, panels), (panels + want - 1) / want);
  w.chunks = (panels + w.chunk - 1) / w.chunk;
  return w;
}

void linear_unit(Path path, const Linear& op, const LinearWork& w, int64_t unit, float* scratch) {
  const int64_t rb = unit / w.chunks, ch = unit % w.chunks;
  const int64_t r0 = rb * w.m / w.row_blocks, r1 = (rb + 1) * w.m / w.row_blocks;
  const int64_t p0 = ch * w.chunk, p1 = std::min(w.panels, p0 + w.chunk);
  linear_block(path, op, p0, p1, r0, r1, scratch);
}

}  // namespace spx
