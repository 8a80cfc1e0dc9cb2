// Attention of new tokens over a bfloat16 KV cache on the CPU, computed so that a token's output
// depends only on its query and the keys it may see, never on which other tokens share the call.
//
// Each new token t sees the committed prefix [0, P) and, among the last M cache slots (the new
// tokens, or a draft tree's nodes), those its mask row allows, in slot order. That ordered list
// of visible keys is the same whether the token is decoded alone (its ancestors are then
// committed and it comes last) or verified inside a tree, so the kernel walks the list in blocks
// of 32 keys numbered by position in the list, with an online softmax per block, and every sum
// inside a block runs in a fixed order: the same list gives the same bits.
//
// Products are bfloat16 dot products with float32 accumulation (VDPBF16PS: 32 multiply-adds per
// instruction, twice a float32 FMA's), on the query (rounded to bfloat16 after scaling), the
// cached keys and values (stored in bfloat16) and the softmax weights (rounded to bfloat16
// before they weigh the values); maxima, exponentials and sums stay in float32. A block's keys
// are transposed (and its values interleaved by key pairs) once and shared by every query row of
// the work item: all query heads of a K/V head, for all tokens whose visible lists share that
// block (a tree's tokens share the prefix; a prefill chunk's tokens share all but their tails).
//
// The portable path computes the same arithmetic in scalar code (a VDPBF16PS lane adds its odd
// pair's product, then its even pair's, each exact product rounded once into the sum).
//
// Layout: q [H, T, D] float32; k, v [Hkv, S, D] bfloat16 (views of the cache, rows contiguous);
// mask [T, M] bool or none (causal over the T new tokens, M = T). Query head h uses K/V head
// h / (H / Hkv). Output [H, T, D] float32.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "fastexp.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int kBlock = 32;
constexpr int kTokensPerItem = 8;  // tokens sharing one pass over the prefix blocks
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp of a score minus the running maximum (x <= 0): fastexp.h, shared with the other kernels.

// The horizontal sum of 16 lanes in the tree the AVX-512 path uses: i+8, i+4, i+2, i+1.
inline float hsum16_portable(const float* p) {
  float a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) a[i] = p[i] + p[i + 8];
  for (int i = 0; i < 4; ++i) b[i] = a[i] + a[i + 4];
  for (int i = 0; i < 2; ++i) c[i] = b[i] + b[i + 2];
  return c[0] + c[1];
}

inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, as VCVTNE2PS2BF16 does (no NaNs reach here).
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

// One VDPBF16PS lane: acc + a1*b1, then + a0*b0 (products of bfloat16 are exact in float32).
inline float dot2(float acc, uint16_t a0, uint16_t a1, uint16_t b0, uint16_t b1) {
  acc = acc + bf16_to_float(a1) * bf16_to_float(b1);
  return acc + bf16_to_float(a0) * bf16_to_float(b0);
}

// q.k the way the AVX-512 path computes it: lane x of a 32-dimension chunk c holds dims
// (32c + 2x, 32c + 2x + 1); chunks 0,1 and chunks 2,3 form two VDPBF16PS chains whose sum is
// reduced over the 16 lanes by the tree of `hsum16_portable`.
inline float score_portable(const uint16_t* k, const uint16_t* q, int64_t d) {
  float lanes[16];
  for (int x = 0; x < 16; ++x) {
    float a = 0.f, b = 0.f;
    for (int64_t c = 0; c < d / 32; ++c) {
      const int64_t i = 32 * c + 2 * x;
      float& acc = c < 2 ? a : b;
      acc = dot2(acc, k[i], k[i + 1], q[i], q[i + 1]);
    }
    lanes[x] = d / 32 > 2 ? a + b : a;
  }
  return hsum16_portable(lanes);
}

struct Problem {
  const float* q;
  const uint16_t* k;
  const uint16_t* v;
  float* out;
  int64_t heads, kv_heads, t, d, s, m;  // m: trailing slots under the mask
  int64_t k_head_stride, v_head_stride;
  const bool* mask;  // [t, m] or null (causal)
  float scale;
  int64_t prefix() const { return s - m; }
};

// Visible slots after the prefix for token t (offsets into the last m slots), in slot order.
void extras_of(const Problem& pb, int64_t t, std::vector<int32_t>& out) {
  out.clear();
  if (pb.mask == nullptr) {
    for (int64_t j = 0; j <= t; ++j) out.push_back(static_cast<int32_t>(pb.m - pb.t + j));
    return;
  }
  const bool* row = pb.mask + t * pb.m;
  for (int64_t j = 0; j < pb.m; ++j)
    if (row[j]) out.push_back(static_cast<int32_t>(j));
}

// How many leading visible keys sit in consecutive slots from 0 (the prefix, plus extras that
// follow it without a gap): those blocks can be read in place and shared between tokens.
int64_t contiguous_len(const Problem& pb, const std::vector<int32_t>& extras) {
  int64_t n = pb.prefix();
  for (size_t i = 0; i < extras.size() && extras[i] == static_cast<int32_t>(i); ++i) ++n;
  return n;
}

// Keys [b0, b0 + n) of a token's visible list: a pointer into the cache when they lie in place,
// else gathered into `scratch`.
const uint16_t* block_rows(const uint16_t* base, int64_t prefix, int64_t contiguous, const std::vector<int32_t>& extras,
                           int64_t b0, int n, int64_t d, uint16_t* scratch) {
  if (b0 + n <= contiguous) return base + b0 * d;
  for (int i = 0; i < n; ++i) {
    const int64_t vis = b0 + i;
    const int64_t slot = vis < prefix ? vis : prefix + extras[vis - prefix];
    std::memcpy(scratch + i * d, base + slot * d, d * sizeof(uint16_t));
  }
  return scratch;
}

// One query row's running softmax: maximum, sum, and the weighted sum of values.
struct RowState {
  const uint16_t* q;  // bfloat16 [d], already scaled
  float* acc;         // float32 [d] (AVX-512 path: in the lane order of the interleaved values)
  float m, l;
};

// ------------------------------------------------------------------ portable

void block_portable(const uint16_t* kb, const uint16_t* vb, int n, int64_t d, RowState* rows, int nrows) {
  float s[kBlock], p[kBlock];
  uint16_t pb[kBlock];
  for (int r = 0; r < nrows; ++r) {
    RowState& st = rows[r];
    float bmax = kNegInf;
    for (int j = 0; j < kBlock; ++j) {
      if (j >= n) {
        s[j] = kNegInf;
        continue;
      }
      s[j] = score_portable(kb + j * d, st.q, d);
      bmax = std::fmax(bmax, s[j]);
    }
    const float m_new = std::fmax(st.m, bmax);
    const float alpha = exp_portable(st.m - m_new);
    float psum[16];
    for (int i = 0; i < 16; ++i) psum[i] = 0.f;
    for (int j = 0; j < kBlock; ++j) {
      p[j] = j < n ? exp_portable(s[j] - m_new) : 0.f;
      psum[j % 16] += p[j];
      pb[j] = float_to_bf16(p[j]);
    }
    st.l = std::fma(st.l, alpha, hsum16_portable(psum));
    for (int64_t i = 0; i < d; ++i) {
      float a = st.acc[i] * alpha;
      for (int j = 0; j < kBlock / 2; ++j) {
        const uint16_t v0 = 2 * j < n ? vb[(2 * j) * d + i] : 0, v1 = 2 * j + 1 < n ? vb[(2 * j + 1) * d + i] : 0;
        a = dot2(a, v0, v1, pb[2 * j], pb[2 * j + 1]);
      }
      st.acc[i] = a;
    }
    st.m = m_new;
  }
}

// ------------------------------------------------------------------ AVX-512 (BF16)

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")

inline float hsum16_avx512(__m512 v) {
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}

// Lane sums of 16 vectors at once: lane j of the result is v[perm[j]]'s sum, each summed by the
// tree of `hsum16_portable` (i+8, then i+4, i+2, i+1); `kReducePerm` undoes the lane order.
inline __m512 reduce16(const __m512* v) {
  __m512 w[8], u[4], y[2];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88), _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44), _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
}

// Which input vector's sum reduce16 leaves in each output lane, found once by reducing markers.
struct ReducePerm {
  int of_lane[16];
  ReducePerm() {
    __m512 v[16];
    for (int j = 0; j < 16; ++j) v[j] = _mm512_maskz_mov_ps(1, _mm512_set1_ps(static_cast<float>(j + 1)));
    alignas(64) float out[16];
    _mm512_store_ps(out, reduce16(v));
    for (int l = 0; l < 16; ++l) of_lane[l] = static_cast<int>(out[l]) - 1;
  }
};

// Values of one block interleaved by key pairs: vi[j][c] holds keys (2j, 2j+1) for 16 dims of
// chunk c, in unpacklo/unpackhi lane order (see `store_row`).
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

// Scores of `nrows` query rows (bfloat16 in registers, lanes over dimensions) against 16 keys:
// three rows share each key's loads; each (row, key) is a VDPBF16PS chain per pair of chunks.
template <int DC>  // 32-dimension chunks per row
void scores16(const uint16_t* kb, int n, int64_t d, RowState* rows, int nrows, float* s, int ld,
              const ReducePerm& perm) {
  alignas(64) __m512 part[3][16];
  for (int r0 = 0; r0 < nrows; r0 += 3) {
    const int rn = std::min(3, nrows - r0);
    __m512i q[3][DC];
    for (int r = 0; r < rn; ++r)
      for (int c = 0; c < DC; ++c) q[r][c] = _mm512_loadu_si512(rows[r0 + r].q + 32 * c);
    for (int j = 0; j < 16; ++j) {
      __m512i k[DC];
      for (int c = 0; c < DC; ++c) k[c] = j < n ? _mm512_loadu_si512(kb + j * d + 32 * c) : _mm512_setzero_si512();
      for (int r = 0; r < rn; ++r) {
        __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)k[0], (__m512bh)q[r][0]);
        a = _mm512_dpbf16_ps(a, (__m512bh)k[1], (__m512bh)q[r][1]);
        if constexpr (DC > 2) {
          __m512 b = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)k[2], (__m512bh)q[r][2]);
          b = _mm512_dpbf16_ps(b, (__m512bh)k[3], (__m512bh)q[r][3]);
          a = _mm512_add_ps(a, b);
        }
        part[r][j] = a;
      }
    }
    for (int r = 0; r < rn; ++r) {
      alignas(64) float out[16];
      _mm512_store_ps(out, reduce16(part[r]));
      for (int l = 0; l < 16; ++l) s[(r0 + r) * ld + perm.of_lane[l]] = out[l];
    }
  }
}

template <int DC>
void block_avx512(const uint16_t* kb, const __m512i (*vi)[2 * DC], int n, int64_t d, RowState* rows, int nrows,
                  const ReducePerm& perm, float* sbuf) {
  constexpr int DV = 2 * DC;  // float32 accumulators of 16 dims
  scores16<DC>(kb, n, d, rows, nrows, sbuf, kBlock, perm);
  if (n > 16) scores16<DC>(kb + 16 * d, n - 16, d, rows, nrows, sbuf + 16, kBlock, perm);
  const __mmask16 k0 = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
  const __mmask16 k1 = n >= 32 ? 0xFFFF : (n > 16 ? static_cast<__mmask16>((1u << (n - 16)) - 1) : 0);
  for (int r = 0; r < nrows; ++r) {
    RowState& st = rows[r];
    __m512 s[2] = {_mm512_loadu_ps(sbuf + r * kBlock), n > 16 ? _mm512_loadu_ps(sbuf + r * kBlock + 16) : _mm512_setzero_ps()};
    s[0] = _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), k0, s[0]);
    s[1] = _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), k1, s[1]);
    const float bmax = _mm512_reduce_max_ps(_mm512_max_ps(s[0], s[1]));
    const float m_new = std::fmax(st.m, bmax);
    const float alpha = _mm_cvtss_f32(_mm512_castps512_ps128(exp_avx512(_mm512_set1_ps(st.m - m_new))));
    const __m512 mn = _mm512_set1_ps(m_new);
    const __m512 p0 = _mm512_maskz_mov_ps(k0, exp_avx512(_mm512_sub_ps(s[0], mn)));
    const __m512 p1 = _mm512_maskz_mov_ps(k1, exp_avx512(_mm512_sub_ps(s[1], mn)));
    st.l = std::fma(st.l, alpha, hsum16_avx512(_mm512_add_ps(p0, p1)));
    alignas(64) int32_t pp[16];  // bfloat16 weights of key pairs (2j, 2j+1)
    _mm512_store_si512(pp, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    __m512 a[DV];
    const __m512 al = _mm512_set1_ps(alpha);
    for (int c = 0; c < DV; ++c) a[c] = _mm512_mul_ps(_mm512_load_ps(st.acc + 16 * c), al);
    const int pairs = (n + 1) / 2;  // weights past n are zero: their products add nothing
#pragma GCC unroll 16
    for (int j = 0; j < pairs; ++j) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(pp[j]);
      for (int c = 0; c < DV; ++c) a[c] = _mm512_dpbf16_ps(a[c], (__m512bh)vi[j][c], w);
    }
    for (int c = 0; c < DV; ++c) _mm512_store_ps(st.acc + 16 * c, a[c]);
    st.m = m_new;
  }
}

#pragma GCC pop_options
#endif

bool has_avx512_bf16() {
#if defined(__x86_64__)
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                         __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("fma");
  return ok;
#else
  return false;
#endif
}

// Dimension d of a row as stored by the AVX-512 path: accumulator c = 2*chunk + half holds, in
// lane l, dim 32*chunk + 8*(l/4) + 4*half + l%4 (the unpacklo/unpackhi order of 16-bit pairs).
inline int64_t stored_dim(int64_t c, int l) { return 32 * (c / 2) + 8 * (l / 4) + 4 * (c % 2) + l % 4; }

// ------------------------------------------------------------------ driver

struct Item {
  int64_t kvh, t0, t1;
};

void run_item(const Problem& pb, const Item& it, bool fast) {
  const int64_t g = pb.heads / pb.kv_heads, d = pb.d, prefix = pb.prefix();
  const int ntok = static_cast<int>(it.t1 - it.t0);
  const uint16_t* kbase = pb.k + it.kvh * pb.k_head_stride;
  const uint16_t* vbase = pb.v + it.kvh * pb.v_head_stride;
  // Per row: the scaled bfloat16 query and the float32 state.
  std::vector<uint16_t> qbuf(ntok * g * d);
  std::vector<float> accbuf(ntok * g * d + 16, 0.f);
  float* acc0 = accbuf.data() + ((16 - (reinterpret_cast<uintptr_t>(accbuf.data()) / 4) % 16) % 16);
  std::vector<RowState> rows(ntok * g);
  std::vector<std::vector<int32_t>> extras(ntok);
  std::vector<int64_t> total(ntok), contiguous(ntok);
  int64_t shared = std::numeric_limits<int64_t>::max();
  for (int i = 0; i < ntok; ++i) {
    const int64_t t = it.t0 + i;
    extras_of(pb, t, extras[i]);
    total[i] = prefix + static_cast<int64_t>(extras[i].size());
    contiguous[i] = contiguous_len(pb, extras[i]);
    shared = std::min(shared, contiguous[i]);
    for (int64_t r = 0; r < g; ++r) {
      RowState& st = rows[i * g + r];
      uint16_t* q = qbuf.data() + (i * g + r) * d;
      const float* src = pb.q + ((it.kvh * g + r) * pb.t + t) * d;
      for (int64_t x = 0; x < d; ++x) q[x] = float_to_bf16(src[x] * pb.scale);
      st = RowState{q, acc0 + (i * g + r) * d, kNegInf, 0.f};
    }
  }
  const int64_t shared_blocks = shared / kBlock;
  std::vector<uint16_t> kscratch(kBlock * d), vscratch(kBlock * d);

#if defined(__x86_64__)
  if (fast) {
    static const ReducePerm perm;
    alignas(64) __m512i vi_store[kBlock / 2][8];
    std::vector<float> sbuf(static_cast<size_t>(ntok * g) * kBlock);
    auto run_block = [&](const uint16_t* kb, const uint16_t* vb, int n, RowState* rs, int nrows) {
      if (d == 128) {
        interleave_values<8>(vb, n, d, vi_store);
        block_avx512<4>(kb, vi_store, n, d, rs, nrows, perm, sbuf.data());
      } else {
        auto vi = reinterpret_cast<__m512i(*)[4]>(vi_store);
        interleave_values<4>(vb, n, d, vi);
        block_avx512<2>(kb, vi, n, d, rs, nrows, perm, sbuf.data());
      }
    };
    for (int64_t b = 0; b < shared_blocks; ++b)
      run_block(kbase + b * kBlock * d, vbase + b * kBlock * d, kBlock, rows.data(), ntok * static_cast<int>(g));
    for (int i = 0; i < ntok; ++i)
      for (int64_t b0 = shared_blocks * kBlock; b0 < total[i]; b0 += kBlock) {
        const int n = static_cast<int>(std::min<int64_t>(kBlock, total[i] - b0));
        const uint16_t* kb = block_rows(kbase, prefix, contiguous[i], extras[i], b0, n, d, kscratch.data());
        const uint16_t* vb = block_rows(vbase, prefix, contiguous[i], extras[i], b0, n, d, vscratch.data());
        run_block(kb, vb, n, rows.data() + i * g, static_cast<int>(g));
      }
    for (int i = 0; i < ntok; ++i)
      for (int64_t r = 0; r < g; ++r) {
        const RowState& st = rows[i * g + r];
        float* o = pb.out + ((it.kvh * g + r) * pb.t + it.t0 + i) * d;
        const float inv = 1.f / st.l;
        for (int64_t c = 0; c < d / 16; ++c)
          for (int l = 0; l < 16; ++l) o[stored_dim(c, l)] = st.acc[16 * c + l] * inv;
      }
    return;
  }
#endif
  for (int64_t b = 0; b < shared_blocks; ++b)
    block_portable(kbase + b * kBlock * d, vbase + b * kBlock * d, kBlock, d, rows.data(), ntok * static_cast<int>(g));
  for (int i = 0; i < ntok; ++i)
    for (int64_t b0 = shared_blocks * kBlock; b0 < total[i]; b0 += kBlock) {
      const int n = static_cast<int>(std::min<int64_t>(kBlock, total[i] - b0));
      const uint16_t* kb = block_rows(kbase, prefix, contiguous[i], extras[i], b0, n, d, kscratch.data());
      const uint16_t* vb = block_rows(vbase, prefix, contiguous[i], extras[i], b0, n, d, vscratch.data());
      block_portable(kb, vb, n, d, rows.data() + i * g, static_cast<int>(g));
    }
  for (int i = 0; i < ntok; ++i)
    for (int64_t r = 0; r < g; ++r) {
      const RowState& st = rows[i * g + r];
      float* o = pb.out + ((it.kvh * g + r) * pb.t + it.t0 + i) * d;
      const float inv = 1.f / st.l;
      for (int64_t x = 0; x < d; ++x) o[x] = st.acc[x] * inv;
    }
}

at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& mask,
                  bool portable) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "attend: q [H,T,D], k and v [Hkv,S,D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat, "attend: q must be float32");
  TORCH_CHECK(k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16, "attend: k and v must be bfloat16");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(1) == v.size(2),
              "attend: k and v rows must be contiguous");
  const at::Tensor qc = q.contiguous();
  Problem pb{};
  pb.heads = qc.size(0);
  pb.t = qc.size(1);
  pb.d = qc.size(2);
  pb.kv_heads = k.size(0);
  pb.s = k.size(1);
  TORCH_CHECK(pb.heads % pb.kv_heads == 0, "attend: query heads must be a multiple of K/V heads");
  TORCH_CHECK(pb.d % 2 == 0 && k.size(2) == pb.d && v.size(2) == pb.d && v.size(1) == pb.s, "attend: shapes");
  at::Tensor mc;
  if (mask.has_value() && mask->defined()) {
    mc = mask->to(at::kBool).contiguous();
    TORCH_CHECK(mc.dim() == 2 && mc.size(0) == pb.t && mc.size(1) >= pb.t && mc.size(1) <= pb.s, "attend: mask [T, M]");
    pb.m = mc.size(1);
    pb.mask = mc.data_ptr<bool>();
  } else {
    TORCH_CHECK(pb.t <= pb.s, "attend: more new tokens than cache slots");
    pb.m = pb.t;
    pb.mask = nullptr;
  }
  pb.q = qc.data_ptr<float>();
  pb.k = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  pb.v = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  pb.k_head_stride = k.stride(0);
  pb.v_head_stride = v.stride(0);
  pb.scale = 1.f / std::sqrt(static_cast<float>(pb.d));
  at::Tensor out = at::empty({pb.heads, pb.t, pb.d}, qc.options());
  pb.out = out.data_ptr<float>();
  const bool fast = !portable && has_avx512_bf16() && (pb.d == 64 || pb.d == 128);
  // Tokens in balanced groups of at most kTokensPerItem (9 tokens: 5 + 4), one item per K/V head
  // and group; how tokens are grouped never changes a token's bits.
  std::vector<Item> items;
  const int64_t groups = (pb.t + kTokensPerItem - 1) / kTokensPerItem;
  for (int64_t gi = 0, t0 = 0; gi < groups; ++gi) {
    const int64_t t1 = t0 + (pb.t - t0) / (groups - gi);
    for (int64_t h = 0; h < pb.kv_heads; ++h) items.push_back({h, t0, t1});
    t0 = t1;
  }
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) run_item(pb, items[i], fast);
  });
  return out;
}

// The new tokens' attention inputs from the fused QKV projection h [T, (H + 2 Hkv) D]: queries
// (and keys) optionally RMS-normed per head (Qwen3), both rotated by RoPE (rotate-half: x*cos +
// rotate_half(x)*sin, cos/sin [T, D]); keys and values are stored in bfloat16 at cache slots
// [start, start + T) of k_cache/v_cache [Hkv, capacity, D]. Returns the rotated queries [H, T, D].
// Scalar and plain (no SIMD, no contraction): the same bits whatever the CPU.
at::Tensor rope_store(const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                      const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm, double eps,
                      at::Tensor& k_cache, at::Tensor& v_cache, int64_t start) {
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat && h.is_contiguous(), "rope_store: h [T, (H+2Hkv)D]");
  TORCH_CHECK(k_cache.scalar_type() == at::kBFloat16 && v_cache.scalar_type() == at::kBFloat16 &&
                  k_cache.dim() == 3 && k_cache.stride(2) == 1 && k_cache.stride(1) == k_cache.size(2) &&
                  v_cache.stride(2) == 1 && v_cache.stride(1) == v_cache.size(2),
              "rope_store: bfloat16 caches [Hkv, capacity, D] with contiguous rows");
  const int64_t t = h.size(0), kvh = k_cache.size(0), d = k_cache.size(2);
  TORCH_CHECK(h.size(1) == (heads + 2 * kvh) * d && d % 2 == 0, "rope_store: h width does not match the heads");
  TORCH_CHECK(start >= 0 && start + t <= k_cache.size(1), "rope_store: slots past the cache's capacity");
  const at::Tensor cc = cos.contiguous(), sc = sin.contiguous();
  TORCH_CHECK(cc.scalar_type() == at::kFloat && cc.numel() == t * d && sc.numel() == t * d, "rope_store: cos/sin [T, D]");
  at::Tensor qn, kn;
  if (q_norm.has_value() && q_norm->defined()) qn = q_norm->contiguous();
  if (k_norm.has_value() && k_norm->defined()) kn = k_norm->contiguous();
  at::Tensor q = at::empty({heads, t, d}, h.options());
  const float* hp = h.data_ptr<float>();
  const float* cp = cc.data_ptr<float>();
  const float* sp = sc.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  uint16_t* kp = reinterpret_cast<uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  uint16_t* vp = reinterpret_cast<uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  const int64_t width = h.size(1), half = d / 2;
  auto rotate = [&](const float* src, const float* norm, int64_t tok, float* dst) {
    float buf[1024];
    const float* x = src;
    if (norm != nullptr) {
      float sq = 0.f;
      for (int64_t i = 0; i < d; ++i) sq += src[i] * src[i];
      const float inv = 1.f / std::sqrt(sq / static_cast<float>(d) + static_cast<float>(eps));
      for (int64_t i = 0; i < d; ++i) buf[i] = norm[i] * (src[i] * inv);
      x = buf;
    }
    const float* c = cp + tok * d;
    const float* s = sp + tok * d;
    for (int64_t i = 0; i < d; ++i) {
      const float rot = i < half ? -x[i + half] : x[i - half];
      dst[i] = x[i] * c[i] + rot * s[i];
    }
  };
  TORCH_CHECK(d <= 1024, "rope_store: head_dim above 1024");
  at::parallel_for(0, t, 1, [&](int64_t b, int64_t e) {
    float tmp[1024];
    for (int64_t tok = b; tok < e; ++tok) {
      const float* row = hp + tok * width;
      for (int64_t hh = 0; hh < heads; ++hh)
        rotate(row + hh * d, qn.defined() ? qn.data_ptr<float>() : nullptr, tok, qp + (hh * t + tok) * d);
      for (int64_t hh = 0; hh < kvh; ++hh) {
        rotate(row + (heads + hh) * d, kn.defined() ? kn.data_ptr<float>() : nullptr, tok, tmp);
        uint16_t* kd = kp + hh * k_cache.stride(0) + (start + tok) * d;
        uint16_t* vd = vp + hh * v_cache.stride(0) + (start + tok) * d;
        const float* v = row + (heads + kvh + hh) * d;
        for (int64_t i = 0; i < d; ++i) {
          kd[i] = float_to_bf16(tmp[i]);
          vd[i] = float_to_bf16(v[i]);
        }
      }
    }
  });
  return q;
}

}  // namespace

void register_attention(pybind11::module& m) {
  m.def("rope_store", &rope_store, "rotate the new queries and keys, store keys and values in the bf16 cache");
  m.def("attend", &attend, "row-independent attention of new tokens over a bfloat16 KV cache");
  m.def("has_avx512_bf16", &has_avx512_bf16, "whether the AVX512-BF16 attention path runs on this CPU");
}
