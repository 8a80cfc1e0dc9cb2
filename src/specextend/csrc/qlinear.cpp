// Quantized linear layers on the CPU: y = x W^T (+ b) with W in a block-quantized format and x
// quantized on the fly to int8, one scale per block of 32 values of each row.
//
// Why this shape: a decode step streams every weight once, so its speed is the weight bytes
// (4-6 bits each instead of 32); a verification of a draft tree multiplies the same weights by a
// few more rows, so the kernel reads each weight block once and applies it to every row while
// it is in registers, with int8 x int8 -> int32 dot products (AVX512-VNNI).
//
// Row independence: each row's activation scales are its own and every row's sum runs in the
// same order whatever the other rows are, so a token gets bit-identical outputs decoded alone
// or inside a tree. Threads split output channels, never the reduction. The portable path below
// computes the same arithmetic in the same order (integer sums are exact; the float steps are
// the same multiplies and fused multiply-adds), so it gives the same bits as the AVX-512 path.
//
// Weight layout ("blob"): output channels in panels of 16; within a panel, super-blocks along
// the input dimension, each self-contained (scales next to their codes, one sequential stream):
//   Q4K (asymmetric 4-bit, groups of 32, G = 1..8 groups per super-block; with G = 8 the GGUF
//       Q4_K grid kept exactly; smaller G serves input widths that are not multiples of 256):
//       d[16] f16, dmin[16] f16, sc[G][16] u8, mn[G][16] u8, codes[G][4][64] (nibbles)
//       w = d*sc[g] * q - dmin*mn[g]
//   Q6K (symmetric 6-bit codes, groups of 16, super-block 256; the Q6_K grid):
//       d[16] f16, sc[16][16] i8, then per group: low nibbles of steps 0|2 and 1|3 (2 x 64 bytes),
//       high 2 bits of steps 0..3 at bits 0,2,4,6 (64 bytes)       w = d*sc[g] * (q - 32)
//   Q8 (codes in bytes, groups of 32 = super-block, one f16 scale per group; Q8_0, Q5_0, int8):
//       d[16] f16, codes[8][64] u8                              w = d * (q - offset)
// Codes of one group are stored in steps of 4 inputs: byte 4*c + j of a 64-byte step holds
// input 4*s + j of channel c, which is the operand layout of one VPDPBUSD. Q4K packs two steps
// per 64 bytes: step i in the low nibbles, step i + 4 in the high ones.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "fastexp.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

enum Format : int64_t { Q4K = 0, Q6K = 1, Q8 = 2 };

constexpr int kPanel = 16;
constexpr int kActBlock = 32;  // activation quantization block
constexpr int kMaxTile = 10;   // rows that share one pass over the weights (registers: 2 per row)

struct FormatInfo {
  int group;        // inputs per scale
  int superblock;   // inputs per self-contained block of the blob
  int64_t bytes;    // blob bytes per (panel, super-block)
};

// sbg: groups per super-block (Q4K only; the others have a fixed layout).
FormatInfo info(int64_t fmt, int64_t sbg) {
  switch (fmt) {
    case Q4K: return {32, static_cast<int>(32 * sbg), 64 + 288 * sbg};
    case Q6K: return {16, 256, 32 + 256 + 16 * 192};
    case Q8: return {32, 32, 32 + 512};
  }
  TORCH_CHECK(false, "unknown weight format ", fmt);
}

inline float half_to_float(uint16_t h) {
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// ------------------------------------------------------------------ activations

// x [M, K] float -> q8 [M, K] int8, d8 [M, K/32] (scale per block), s16 [M, K/16] (sums of 16
// codes), s32 [M, K/32] (sums of 32 codes), xs [M, K/32] = d8 * s32 (the block's quantized sum).
struct Activations {
  at::Tensor q8, d8, s16, s32, xs;
};

void quantize_row_portable(const float* x, int64_t k, int8_t* q, float* d8, int32_t* s16, int32_t* s32, float* xs) {
  for (int64_t b = 0; b < k / kActBlock; ++b) {
    const float* xb = x + b * kActBlock;
    float amax = 0.f;
    for (int i = 0; i < kActBlock; ++i) amax = std::fmax(amax, std::fabs(xb[i]));
    const float d = amax / 127.f;
    const float id = d != 0.f ? 1.f / d : 0.f;
    int32_t sums[2] = {0, 0};
    for (int i = 0; i < kActBlock; ++i) {
      const int v = static_cast<int>(std::nearbyint(xb[i] * id));
      q[b * kActBlock + i] = static_cast<int8_t>(v);
      sums[i / 16] += v;
    }
    d8[b] = d;
    s16[2 * b] = sums[0];
    s16[2 * b + 1] = sums[1];
    s32[b] = sums[0] + sums[1];
    xs[b] = d * static_cast<float>(s32[b]);
  }
}

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma")

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

#pragma GCC pop_options
#endif

bool has_avx512_vnni() {
#if defined(__x86_64__)
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                         __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c") &&
                         __builtin_cpu_supports("fma");
  return ok;
#else
  return false;
#endif
}

// What is applied to each input row before it is quantized (fused into the same pass).
struct PreOp {
  const float* norm = nullptr;  // RMSNorm weight [k]: row * rsqrt(mean(row^2) + eps) * norm
  float eps = 0.f;
  bool silu_mul = false;  // the row holds [gate | up] (2k values): silu(gate) * up
};

// The pre-op on one row, in plain scalar code shared by both paths (so they stay bit-identical).
void pre_op_row(const float* x, int64_t k, const PreOp& op, float* out) {
  if (op.silu_mul) {
    for (int64_t i = 0; i < k; ++i) out[i] = x[i] / (1.f + exp_portable(-x[i])) * x[k + i];
    return;
  }
  float sq[16] = {0.f};
  for (int64_t i = 0; i < k; ++i) sq[i % 16] = std::fma(x[i], x[i], sq[i % 16]);
  float total = 0.f;
  for (float v : sq) total += v;
  const float inv = 1.f / std::sqrt(total / static_cast<float>(k) + op.eps);
  for (int64_t i = 0; i < k; ++i) out[i] = x[i] * inv * op.norm[i];
}

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")

// pre_op_row with the same arithmetic, 16 lanes at a time (k is a multiple of 32).
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

#pragma GCC pop_options
#endif

// x: [m, k] (or [m, 2k] with silu_mul) float32 -> the quantized rows of pre_op(x).
Activations quantize(const at::Tensor& x, int64_t k, const PreOp& op, bool fast) {
  const int64_t m = x.size(0);
  const int64_t in_k = x.size(1);
  const bool pre = op.norm != nullptr || op.silu_mul;
  auto opt = x.options();
  Activations a{at::empty({m, k}, opt.dtype(at::kChar)), at::empty({m, k / 32}, opt.dtype(at::kFloat)),
                at::empty({m, k / 16}, opt.dtype(at::kInt)), at::empty({m, k / 32}, opt.dtype(at::kInt)),
                at::empty({m, k / 32}, opt.dtype(at::kFloat))};
  const float* xp = x.data_ptr<float>();
  int8_t* q = a.q8.data_ptr<int8_t>();
  float* d8 = a.d8.data_ptr<float>();
  int32_t* s16 = a.s16.data_ptr<int32_t>();
  int32_t* s32 = a.s32.data_ptr<int32_t>();
  float* xs = a.xs.data_ptr<float>();
  auto row = [&](int64_t r, std::vector<float>& buf) {
    const float* src = xp + r * in_k;
    if (pre) {
#if defined(__x86_64__)
      if (fast) pre_op_row_avx512(src, k, op, buf.data());
      else
#endif
        pre_op_row(src, k, op, buf.data());
      src = buf.data();
    }
#if defined(__x86_64__)
    if (fast) {
      quantize_row_avx512(src, k, q + r * k, d8 + r * (k / 32), s16 + r * (k / 16), s32 + r * (k / 32),
                          xs + r * (k / 32));
      return;
    }
#endif
    quantize_row_portable(src, k, q + r * k, d8 + r * (k / 32), s16 + r * (k / 16), s32 + r * (k / 32),
                          xs + r * (k / 32));
  };
  if (m >= 8) {
    at::parallel_for(0, m, 4, [&](int64_t b, int64_t e) {
      std::vector<float> buf(pre ? k : 0);
      for (int64_t r = b; r < e; ++r) row(r, buf);
    });
  } else {
    std::vector<float> buf(pre ? k : 0);
    for (int64_t r = 0; r < m; ++r) row(r, buf);
  }
  return a;
}

// ------------------------------------------------------------------ one weight segment

struct Segment {
  const uint8_t* blob;
  int64_t fmt, n, k, offset, sbg;
  FormatInfo fi() const { return info(fmt, sbg); }
  int64_t panels() const { return (n + kPanel - 1) / kPanel; }
  int64_t panel_bytes() const { return fi().bytes * (k / fi().superblock); }
};

struct Rows {
  const int8_t* q8;
  const float* d8;
  const int32_t* s16;
  const int32_t* s32;
  const float* xs;
  int64_t k;
};

// Code of lane byte b in step st of a packed Q6K group (see the layout above).
inline int q6_code(const uint8_t* g, int st, int b) {
  const uint8_t lo = g[64 * (st % 2) + b];
  return ((st < 2 ? lo : lo >> 4) & 15) | (((g[128 + b] >> (2 * st)) & 3) << 4);
}

// Portable reference: one panel (16 channels) x `rows` rows, accumulating into acc[rows][16].
void panel_portable(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int rows, float* acc) {
  const FormatInfo fi = s.fi();
  const int64_t nsb = s.k / fi.superblock;
  const int64_t kb = s.k / 32;
  const int64_t sbg = s.sbg;
  for (int64_t sb = 0; sb < nsb; ++sb, p += fi.bytes) {
    const uint16_t* dh = reinterpret_cast<const uint16_t*>(p);
    const int groups = fi.superblock / fi.group;
    for (int g = 0; g < groups; ++g) {
      const int64_t k0 = sb * fi.superblock + static_cast<int64_t>(g) * fi.group;
      float scale[kPanel], mins[kPanel];
      int32_t codes[kPanel][32];
      for (int c = 0; c < kPanel; ++c) {
        const float d = half_to_float(dh[c]);
        if (s.fmt == Q4K) {
          const uint16_t* dm = dh + 16;
          const uint8_t* sc = p + 64 + 16 * g;
          const uint8_t* mn = p + 64 + 16 * sbg + 16 * g;
          scale[c] = d * static_cast<float>(sc[c]);
          mins[c] = half_to_float(dm[c]) * static_cast<float>(mn[c]);
          const uint8_t* cb = p + 64 + 32 * sbg + 256 * g;
          for (int st = 0; st < 8; ++st)
            for (int j = 0; j < 4; ++j) {
              const uint8_t byte = cb[64 * (st % 4) + 4 * c + j];
              codes[c][4 * st + j] = st < 4 ? (byte & 15) : (byte >> 4);
            }
        } else if (s.fmt == Q6K) {
          const int8_t* sc = reinterpret_cast<const int8_t*>(p + 32) + 16 * g;
          scale[c] = d * static_cast<float>(sc[c]);
          const uint8_t* cb = p + 288 + 192 * g;
          for (int st = 0; st < 4; ++st)
            for (int j = 0; j < 4; ++j) codes[c][4 * st + j] = q6_code(cb, st, 4 * c + j);
        } else {
          scale[c] = d;
          const uint8_t* cb = p + 32;
          for (int st = 0; st < 8; ++st)
            for (int j = 0; j < 4; ++j) codes[c][4 * st + j] = cb[64 * st + 4 * c + j];
        }
      }
      for (int r = 0; r < rows; ++r) {
        const int64_t row = r0 + r;
        const int8_t* q = x.q8 + row * x.k + k0;
        const float d8 = x.d8[row * kb + k0 / 32];
        for (int c = 0; c < kPanel; ++c) {
          int32_t dot = 0;
          for (int i = 0; i < fi.group; ++i) dot += codes[c][i] * static_cast<int32_t>(q[i]);
          if (s.fmt == Q6K) dot -= 32 * x.s16[row * (x.k / 16) + k0 / 16];
          if (s.fmt == Q8) dot -= static_cast<int32_t>(s.offset) * x.s32[row * kb + k0 / 32];
          const float t = static_cast<float>(dot) * d8;
          float& a = acc[r * kPanel + c];
          a = std::fma(t, scale[c], a);
          if (s.fmt == Q4K) a = std::fma(-mins[c], x.xs[row * kb + k0 / 32], a);
        }
      }
    }
  }
}

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma")

// Weights stream from memory once per call; with several rows a group takes long enough that the
// hardware prefetcher falls behind, so each group also asks for the bytes ~9 KB ahead into L2.
constexpr int64_t kPrefetch = 9472;

inline void prefetch_group(const uint8_t* p, int bytes) {
  for (int off = 0; off < bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch + off), _MM_HINT_T1);
}

inline __m512i bcast4(const int8_t* q) {
  int32_t v;
  std::memcpy(&v, q, 4);
  return _mm512_set1_epi32(v);
}

inline __m512 cvt_u8(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p))); }
inline __m512 cvt_i8(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))); }
inline __m512 cvt_f16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }

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
      part[c] = _mm512_dpbusd_epi32(part[c], w[st], bcast4(q[r] + 4 * st));
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

template <int R>
void panel_q6k(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, __m512* acc) {
  const int64_t nsb = s.k / 256, kb = s.k / 32, k16 = s.k / 16;
  const __m512i low = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
  for (int64_t sb = 0; sb < nsb; ++sb, p += 3360) {
    const __m512 d = cvt_f16(p);
    for (int g = 0; g < 16; ++g) {
      const int64_t k0 = sb * 256 + g * 16;
      const __m512 scale = _mm512_mul_ps(d, cvt_i8(p + 32 + 16 * g));
      const uint8_t* cb = p + 288 + 192 * g;
      prefetch_group(p + 210 * g, 210);
      const __m512i a = _mm512_loadu_si512(cb), b = _mm512_loadu_si512(cb + 64), h = _mm512_loadu_si512(cb + 128);
      // Step s's high bits sit at bits 2s..2s+1 of h; shifted to bits 4..5 they join the nibble.
      __m512i w[4];
      w[0] = _mm512_or_si512(_mm512_and_si512(a, low), _mm512_and_si512(_mm512_slli_epi16(h, 4), top));
      w[1] = _mm512_or_si512(_mm512_and_si512(b, low), _mm512_and_si512(_mm512_slli_epi16(h, 2), top));
      w[2] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(a, 4), low), _mm512_and_si512(h, top));
      w[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(b, 4), low),
                             _mm512_and_si512(_mm512_srli_epi16(h, 2), top));
      const int8_t* q[R];
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) q[r] = x.q8 + (r0 + r) * x.k + k0;
      __m512i dot[R];
      dots<R, 4>(w, q, dot);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const int64_t row = r0 + r;
        const __m512i c = _mm512_sub_epi32(dot[r], _mm512_set1_epi32(32 * x.s16[row * k16 + k0 / 16]));
        const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(c), _mm512_set1_ps(x.d8[row * kb + k0 / 32]));
        acc[r] = _mm512_fmadd_ps(t, scale, acc[r]);
      }
    }
  }
}

template <int R>
void panel_q8(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, __m512* acc) {
  const int64_t nsb = s.k / 32, kb = s.k / 32;
  const int32_t off = static_cast<int32_t>(s.offset);
  for (int64_t sb = 0; sb < nsb; ++sb, p += 544) {
    const int64_t k0 = sb * 32;
    const __m512 scale = cvt_f16(p);
    prefetch_group(p, 544);
    __m512i w[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) w[i] = _mm512_loadu_si512(p + 32 + 64 * i);
    const int8_t* q[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) q[r] = x.q8 + (r0 + r) * x.k + k0;
    __m512i dot[R];
    dots<R, 8>(w, q, dot);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const int64_t b = (r0 + r) * kb + sb;
      const __m512i c = _mm512_sub_epi32(dot[r], _mm512_set1_epi32(off * x.s32[b]));
      const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(c), _mm512_set1_ps(x.d8[b]));
      acc[r] = _mm512_fmadd_ps(t, scale, acc[r]);
    }
  }
}

template <int R>
void tile_avx512(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, float* out, int64_t ldo,
                 const float* bias, const float* res, int valid) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  switch (s.fmt) {
    case Q4K: panel_q4k<R>(s, p, x, r0, acc); break;
    case Q6K: panel_q6k<R>(s, p, x, r0, acc); break;
    default: panel_q8<R>(s, p, x, r0, acc); break;
  }
  const __mmask16 m = valid >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(m, bias) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) {
    __m512 y = _mm512_add_ps(acc[r], b);
    if (res) y = _mm512_add_ps(_mm512_maskz_loadu_ps(m, res + (r0 + r) * ldo), y);
    _mm512_mask_storeu_ps(out + (r0 + r) * ldo, m, y);
  }
}

using TileFn = void (*)(const Segment&, const uint8_t*, const Rows&, int64_t, float*, int64_t, const float*,
                        const float*, int);

template <int... Rs>
constexpr std::array<TileFn, sizeof...(Rs)> make_tiles(std::integer_sequence<int, Rs...>) {
  return {&tile_avx512<Rs + 1>...};
}
const auto kTiles = make_tiles(std::make_integer_sequence<int, kMaxTile>{});

#pragma GCC pop_options
#endif

void tile_portable(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int rows, float* out, int64_t ldo,
                   const float* bias, const float* res, int valid) {
  float acc[kMaxTile * kPanel] = {0.f};
  panel_portable(s, p, x, r0, rows, acc);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < valid; ++c) {
      float v = acc[r * kPanel + c] + (bias ? bias[c] : 0.f);
      if (res) v = res[(r0 + r) * ldo + c] + v;
      out[(r0 + r) * ldo + c] = v;
    }
}

// ------------------------------------------------------------------ the op

// y[M, sum(n)] = pre(x)[M, K] @ concat(segments)^T (+ bias) (+ residual), one activation
// quantization for all segments. pre: an RMSNorm with weight `norm`, or silu(gate) * up when
// `silu_mul` (x then holds [gate | up], 2K columns); residual: [M, sum(n)] added to the result.
at::Tensor qlinear(const at::Tensor& x, const std::vector<at::Tensor>& blobs, const std::vector<int64_t>& fmts,
                   const std::vector<int64_t>& ns, const std::vector<int64_t>& offsets,
                   const std::vector<int64_t>& sbgs, const c10::optional<at::Tensor>& bias,
                   const c10::optional<at::Tensor>& norm, double eps, bool silu_mul,
                   const c10::optional<at::Tensor>& residual, bool portable) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "qlinear: x must be a 2-D float32 tensor");
  TORCH_CHECK(blobs.size() == fmts.size() && fmts.size() == ns.size() && ns.size() == offsets.size() &&
                  offsets.size() == sbgs.size(),
              "qlinear: one format, width, offset and super-block size per weight segment");
  const at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), k = silu_mul ? xc.size(1) / 2 : xc.size(1);
  TORCH_CHECK(!silu_mul || xc.size(1) == 2 * k, "qlinear: silu_mul needs [gate | up] rows");
  PreOp op;
  at::Tensor nc;
  if (norm.has_value() && norm->defined()) {
    nc = norm->contiguous();
    TORCH_CHECK(!silu_mul && nc.scalar_type() == at::kFloat && nc.numel() == k, "qlinear: norm must be float32 [k]");
    op.norm = nc.data_ptr<float>();
    op.eps = static_cast<float>(eps);
  }
  op.silu_mul = silu_mul;
  TORCH_CHECK(k % 32 == 0, "qlinear: input width must be a multiple of 32");
  int64_t n_total = 0;
  std::vector<Segment> segs;
  std::vector<int64_t> first_panel{0};
  for (size_t i = 0; i < blobs.size(); ++i) {
    TORCH_CHECK(fmts[i] != Q4K || (sbgs[i] >= 1 && sbgs[i] <= 8), "qlinear: Q4K takes 1 to 8 groups per super-block");
    Segment s{blobs[i].data_ptr<uint8_t>(), fmts[i], ns[i], k, offsets[i], sbgs[i]};
    TORCH_CHECK(k % s.fi().superblock == 0, "qlinear: input width ", k, " is not a multiple of the format's ",
                s.fi().superblock);
    TORCH_CHECK(blobs[i].is_contiguous() && blobs[i].numel() == s.panels() * s.panel_bytes(),
                "qlinear: weight blob ", i, " has ", blobs[i].numel(), " bytes, expected ", s.panels() * s.panel_bytes());
    segs.push_back(s);
    first_panel.push_back(first_panel.back() + s.panels());
    n_total += s.n;
  }
  const float* bp = nullptr;
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.scalar_type() == at::kFloat && bc.numel() == n_total, "qlinear: bias must be float32 [n]");
    bp = bc.data_ptr<float>();
  }
  const float* rp = nullptr;
  at::Tensor rc;
  if (residual.has_value() && residual->defined()) {
    rc = residual->contiguous();
    TORCH_CHECK(rc.scalar_type() == at::kFloat && rc.dim() == 2 && rc.size(0) == m && rc.size(1) == n_total,
                "qlinear: residual must be float32 [m, n]");
    rp = rc.data_ptr<float>();
  }
  const bool fast = !portable && has_avx512_vnni();
  Activations a = quantize(xc, k, op, fast);
  Rows rows{a.q8.data_ptr<int8_t>(), a.d8.data_ptr<float>(), a.s16.data_ptr<int32_t>(), a.s32.data_ptr<int32_t>(),
            a.xs.data_ptr<float>(), k};
  at::Tensor y = at::empty({m, n_total}, xc.options());
  float* yp = y.data_ptr<float>();
  const int64_t total_panels = first_panel.back();
  at::parallel_for(0, total_panels, 1, [&](int64_t begin, int64_t end) {
    size_t si = 0;
    int64_t col0 = 0;
    for (int64_t gp = begin; gp < end; ++gp) {
      while (gp >= first_panel[si + 1]) col0 += segs[si++].n;
      const Segment& s = segs[si];
      const int64_t p = gp - first_panel[si];
      const uint8_t* pb = s.blob + p * s.panel_bytes();
      const int valid = static_cast<int>(std::min<int64_t>(kPanel, s.n - p * kPanel));
      float* out = yp + col0 + p * kPanel;
      const float* bias_p = bp ? bp + col0 + p * kPanel : nullptr;
      const float* res_p = rp ? rp + col0 + p * kPanel : nullptr;
      const int64_t tiles = (m + kMaxTile - 1) / kMaxTile;
      for (int64_t ti = 0, r0 = 0; ti < tiles; ++ti) {
        // Balanced tiles (16 rows: 8 + 8, not 10 + 6); which tile a row lands in never changes its bits.
        const int rows_here = static_cast<int>((m - r0) / (tiles - ti));
#if defined(__x86_64__)
        if (fast && valid == kPanel) {
          kTiles[rows_here - 1](s, pb, rows, r0, out, n_total, bias_p, res_p, valid);
          r0 += rows_here;
          continue;
        }
#endif
        tile_portable(s, pb, rows, r0, rows_here, out, n_total, bias_p, res_p, valid);
        r0 += rows_here;
      }
    }
  });
  return y;
}

// Dequantize rows [r0, r1) of one segment to float32 (embedding lookups, float conversions, tests).
at::Tensor dequantize(const at::Tensor& blob, int64_t fmt, int64_t n, int64_t k, int64_t offset, int64_t sbg,
                      const at::Tensor& row_ids) {
  TORCH_CHECK(fmt != Q4K || (sbg >= 1 && sbg <= 8), "dequantize: Q4K takes 1 to 8 groups per super-block");
  const FormatInfo fi = info(fmt, sbg);
  TORCH_CHECK(k % fi.superblock == 0, "dequantize: bad input width");
  Segment s{blob.data_ptr<uint8_t>(), fmt, n, k, offset, sbg};
  TORCH_CHECK(blob.numel() == s.panels() * s.panel_bytes(), "dequantize: blob size does not match the format");
  const at::Tensor ids = row_ids.to(at::kLong).contiguous();
  const int64_t* idp = ids.data_ptr<int64_t>();
  const int64_t rows = ids.numel();
  at::Tensor out = at::empty({rows, k}, at::dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < rows; ++i) TORCH_CHECK(idp[i] >= 0 && idp[i] < n, "dequantize: row id out of range");
  at::parallel_for(0, rows, 64, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t row = idp[i], panel = row / kPanel;
      const int c = static_cast<int>(row % kPanel);
      const uint8_t* p = s.blob + panel * s.panel_bytes();
      float* o = op + i * k;
      for (int64_t sb = 0; sb < k / fi.superblock; ++sb, p += fi.bytes) {
        const uint16_t* dh = reinterpret_cast<const uint16_t*>(p);
        const float d = half_to_float(dh[c]);
        for (int g = 0; g < fi.superblock / fi.group; ++g) {
          float* og = o + sb * fi.superblock + g * fi.group;
          if (fmt == Q4K) {
            const float scale = d * static_cast<float>(p[64 + 16 * g + c]);
            const float mn = half_to_float(dh[16 + c]) * static_cast<float>(p[64 + 16 * sbg + 16 * g + c]);
            const uint8_t* cb = p + 64 + 32 * sbg + 256 * g;
            for (int st = 0; st < 8; ++st)
              for (int j = 0; j < 4; ++j) {
                const uint8_t byte = cb[64 * (st % 4) + 4 * c + j];
                const int q = st < 4 ? (byte & 15) : (byte >> 4);
                og[4 * st + j] = scale * static_cast<float>(q) - mn;
              }
          } else if (fmt == Q6K) {
            const float scale = d * static_cast<float>(reinterpret_cast<const int8_t*>(p + 32)[16 * g + c]);
            const uint8_t* cb = p + 288 + 192 * g;
            for (int st = 0; st < 4; ++st)
              for (int j = 0; j < 4; ++j) og[4 * st + j] = scale * static_cast<float>(q6_code(cb, st, 4 * c + j) - 32);
          } else {
            const uint8_t* cb = p + 32;
            for (int st = 0; st < 8; ++st)
              for (int j = 0; j < 4; ++j)
                og[4 * st + j] = d * static_cast<float>(static_cast<int>(cb[64 * st + 4 * c + j]) - offset);
          }
        }
      }
    }
  });
  return out;
}

// The activation quantization alone (tests compare it with a Python reference).
std::vector<at::Tensor> quantize_activations(const at::Tensor& x, bool portable) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % 32 == 0,
              "quantize_activations: x must be float32 [M, K] with K a multiple of 32");
  Activations a = quantize(x.contiguous(), x.size(1), PreOp{}, !portable && has_avx512_vnni());
  return {a.q8, a.d8, a.s16};
}

}  // namespace

void register_qlinear(pybind11::module& m) {
  m.def("qlinear", &qlinear, "quantized linear over weight segments");
  m.def("dequantize", &dequantize, "dequantize rows of a weight blob");
  m.def("quantize_activations", &quantize_activations, "int8 activations, one scale per 32");
  m.def("has_avx512_vnni", &has_avx512_vnni, "whether the AVX512-VNNI path runs on this CPU");
}
