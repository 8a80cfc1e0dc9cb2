// BF16D (qlinear.h) on VDPBF16PS: a BF16 file's weights times bfloat16 activations, llama.cpp's
// arithmetic for them. The blob holds each pair of inputs' 16 channels as the instruction's operand
// (64 bytes), so a step is one load of weights and one VDPBF16PS a row with the row's pair of
// activations broadcast from memory: no widening, no shuffles. A lane's step is the reference's
// (odd product, then even; DAZ in, FTZ out), so every row count and path gives the same bits.
#if defined(__x86_64__)

#include "x86.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "qlinear.h"
#include "target.h"

SPX_BEGIN_AVX512BF16

namespace spx {

namespace {

// Adds bias (then the residual) as store_rows does, so the bits match the portable tiles'.
inline void store_panel(__m512 acc, int64_t row, const TileOut& out) {
  __m512 y = _mm512_add_ps(acc, out.bias ? _mm512_loadu_ps(out.bias) : _mm512_setzero_ps());
  if (out.residual) y = _mm512_add_ps(_mm512_loadu_ps(out.residual + row * out.ldo), y);
  _mm512_storeu_ps(out.y + row * out.ldo, y);
}

// R rows of P adjacent panels (`bytes` apart) over pairs [j0, j1): P * R chains in flight, each
// panel's weights loaded once for the R rows and each row's pair broadcast once for the P panels,
// the rows' words of a pair side by side (x: the first row's word of pair 0, xbm words a pair); the
// chains' sums carried in part ([panel][kRowBlock][16] floats) from block to block of inputs.
template <int P, int R>
void rows_of(const uint8_t* p, int64_t bytes, const uint32_t* x, int64_t xbm, int64_t j0, int64_t j1, float* part) {
  __m512 acc[P][R];
#pragma GCC unroll 16
  for (int i = 0; i < P; ++i)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[i][r] = _mm512_load_ps(part + (i * kRowBlock + r) * 16);
  p += 64 * j0;
  x += j0 * xbm;
  for (int64_t j = j0; j < j1; ++j, p += 64, x += xbm) {
    __m512bh w[P];
#pragma GCC unroll 4
    for (int i = 0; i < P; ++i) w[i] = (__m512bh)_mm512_loadu_si512(p + i * bytes);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r]));
#pragma GCC unroll 4
      for (int i = 0; i < P; ++i) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], w[i], xr);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < P; ++i)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) _mm512_store_ps(part + (i * kRowBlock + r) * 16, acc[i][r]);
}

// Inputs a block: the panels' weights (16 KB) stay in L1 while every group of rows passes over them.
constexpr int64_t kBlockBytes = 16384;

// n rows of P panels in groups of R (most P * R chains in registers), then smaller groups.
template <int P, int R>
void panel_rows(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int n, float* part) {
  const int64_t pairs = s.k / 2, block = kBlockBytes / 64 / P, bytes = s.panel_bytes();
  for (int64_t j0 = 0; j0 < pairs; j0 += block) {
    const int64_t j1 = std::min(pairs, j0 + block);
    int r = 0;
    const auto group = [&](auto rows) {
      constexpr int G = decltype(rows)::value;
      rows_of<P, G>(p, bytes, x.xb + r0 + r, x.xbm, j0, j1, part + 16 * r);
      r += G;
    };
    while (r + R <= n) group(std::integral_constant<int, R>{});
    if (r + 8 <= n) group(std::integral_constant<int, 8>{});
    if (r + 4 <= n) group(std::integral_constant<int, 4>{});
    if (r + 2 <= n) group(std::integral_constant<int, 2>{});
    if (r < n) group(std::integral_constant<int, 1>{});
  }
}

// One row over P adjacent panels (one chain a panel's channel: P chains hide the instruction's latency).
template <int P>
void one_of(const Segment& s, const uint8_t* p, const uint32_t* x, int64_t xbm, int64_t row, const TileOut* outs) {
  const int64_t bytes = s.panel_bytes();
  __m512 acc[P];
#pragma GCC unroll 4
  for (int i = 0; i < P; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < s.k / 2; ++j, p += 64, x += xbm) {
    const __m512bh xj = (__m512bh)_mm512_set1_epi32(static_cast<int>(*x));
#pragma GCC unroll 4
    for (int i = 0; i < P; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512(p + i * bytes), xj);
  }
#pragma GCC unroll 4
  for (int i = 0; i < P; ++i) store_panel(acc[i], row, outs[i]);
}

}  // namespace

void bf16d_rows_avx512(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int n, int panels,
                       const TileOut* outs) {
  alignas(64) float part[2 * kRowBlock * 16];
  for (int i = 0; i < panels; ++i)
    for (int r = 0; r < n; ++r) _mm512_store_ps(part + (i * kRowBlock + r) * 16, _mm512_setzero_ps());
  if (panels == 2)
    panel_rows<2, 12>(s, p, x, r0, n, part);
  else
    panel_rows<1, 16>(s, p, x, r0, n, part);
  for (int i = 0; i < panels; ++i)
    for (int r = 0; r < n; ++r) store_panel(_mm512_load_ps(part + (i * kRowBlock + r) * 16), r0 + r, outs[i]);
}

void bf16d_one_avx512(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int panels, const TileOut* outs) {
  const uint32_t* xr = x.xb + r0;
  switch (panels) {
    case 4: return one_of<4>(s, p, xr, x.xbm, r0, outs);
    case 3: return one_of<3>(s, p, xr, x.xbm, r0, outs);
    case 2: return one_of<2>(s, p, xr, x.xbm, r0, outs);
    default: return one_of<1>(s, p, xr, x.xbm, r0, outs);
  }
}

}  // namespace spx

SPX_END

#endif
