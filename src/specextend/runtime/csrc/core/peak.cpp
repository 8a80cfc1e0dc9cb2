// Register-only multiply-add loops per kernel path (peak.h). Each loop is a few lines, so the
// paths share this file, one instruction-set region each.
//
// An iteration of a vector loop is one asm statement: N multiply-add instructions, each into its
// own accumulator register, from two input registers. Written from intrinsics, GCC computed
// accumulators that started equal only once, computed the avx2 pair's products (which do not read
// the accumulator) once per iteration, and copied or spilled accumulators inside the loop; the
// asm leaves it nothing to fold, hoist, merge or spill. The inputs pass through an empty asm
// statement each iteration (no instruction), so nothing about them is known in advance either.
#include "peak.h"

#include <cstdint>
#include <cstring>

#include "amx_tiles.h"
#include "target.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#if defined(__linux__)
#include <sys/auxv.h>
#endif
#endif

#define SPX_LAUNDER(x, constraint) asm volatile("" : constraint(x))

// The accumulators c0..c15, declared from `init(j)`, as asm operands, and summed with `add`.
#define SPX_DECLARE12(T, init)                                                                             \
  T c0 = init(0), c1 = init(1), c2 = init(2), c3 = init(3), c4 = init(4), c5 = init(5), c6 = init(6), \
    c7 = init(7), c8 = init(8), c9 = init(9), c10 = init(10), c11 = init(11)
#define SPX_DECLARE16(T, init) \
  SPX_DECLARE12(T, init);      \
  T c12 = init(12), c13 = init(13), c14 = init(14), c15 = init(15)
#define SPX_OPERANDS12(K)                                                                                    \
  [c0] K(c0), [c1] K(c1), [c2] K(c2), [c3] K(c3), [c4] K(c4), [c5] K(c5), [c6] K(c6), [c7] K(c7), [c8] K(c8), \
      [c9] K(c9), [c10] K(c10), [c11] K(c11)
#define SPX_OPERANDS_LO8(K) \
  [c0] K(c0), [c1] K(c1), [c2] K(c2), [c3] K(c3), [c4] K(c4), [c5] K(c5), [c6] K(c6), [c7] K(c7)
#define SPX_OPERANDS_HI8(K) \
  [c8] K(c8), [c9] K(c9), [c10] K(c10), [c11] K(c11), [c12] K(c12), [c13] K(c13), [c14] K(c14), [c15] K(c15)
#define SPX_SUM12(add) \
  add(add(add(add(c0, c1), add(c2, c3)), add(add(c4, c5), add(c6, c7))), add(add(c8, c9), add(c10, c11)))
#define SPX_SUM16(add) add(SPX_SUM12(add), add(add(c12, c13), add(c14, c15)))
// An iteration's instructions: STEP(n) is the text of the step into accumulator n.
#define SPX_STEPS12(STEP) \
  STEP(0) STEP(1) STEP(2) STEP(3) STEP(4) STEP(5) STEP(6) STEP(7) STEP(8) STEP(9) STEP(10) STEP(11)
#define SPX_STEPS_LO8(STEP) STEP(0) STEP(1) STEP(2) STEP(3) STEP(4) STEP(5) STEP(6) STEP(7)
#define SPX_STEPS_HI8(STEP) STEP(8) STEP(9) STEP(10) STEP(11) STEP(12) STEP(13) STEP(14) STEP(15)
// 16 accumulators take two asm statements (an asm has at most 30 operands; in-out ones count twice).
#define SPX_ITERATION16(STEP, R)                                                                 \
  asm volatile(SPX_STEPS_LO8(STEP) : SPX_OPERANDS_LO8("+" R) : [a] R(a), [b] R(b)); \
  asm volatile(SPX_STEPS_HI8(STEP) : SPX_OPERANDS_HI8("+" R) : [a] R(a), [b] R(b))
#define SPX_C(n) "%[c" #n "]"

namespace spx {

namespace {

// Accumulators: enough independent chains to keep every pipe busy through the instruction's
// latency (4-6 cycles at 2 per cycle needs 8-12); 16 where there are 32 registers. Each starts
// from its own value.
constexpr int kAcc12 = 12;  // 16 ymm registers: 12 accumulators, the inputs and a temporary
constexpr int kAcc16 = 16;
constexpr int kAccScalar = 8;  // general registers: 8 chains of a 4-cycle multiply-add and the inputs

template <typename T>
uint32_t digest(const T& v) {
  uint32_t w[sizeof(T) / 4], h = 0;
  std::memcpy(w, &v, sizeof(T));
  for (uint32_t x : w) h = h * 31u + x;
  return h;
}

// bfloat16 bits of a small positive float: products stay far from overflow and denormals.
uint16_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return static_cast<uint16_t>(u >> 16);
}

// Portable: one scalar product at a time, in plain C++ (no asm: any architecture). An estimate of
// what plain code does on this CPU, not a limit: the compiler may vectorize the portable kernels
// beyond it. The accumulator is a factor (acc * a + b) and is laundered after each step, which
// keeps each chain in a scalar register (the compiler would vectorize 8 equal-shaped chains).
#if defined(__x86_64__)
#define SPX_FLOAT_REG "+x"
#elif defined(__aarch64__)
#define SPX_FLOAT_REG "+w"
#else
#define SPX_FLOAT_REG "+g"
#endif

#define SPX_SCALAR_STEP(c) \
  c = c * a + b;           \
  SPX_LAUNDER(c, CONSTRAINT)

uint32_t int8_scalar(int64_t iters, int32_t seed) {
#define CONSTRAINT "+r"
  int32_t a = 3 * seed, b = seed, c0 = 0, c1 = 1, c2 = 2, c3 = 3, c4 = 4, c5 = 5, c6 = 6, c7 = 7;
  for (int64_t i = 0; i < iters; ++i) {
    SPX_LAUNDER(a, "+r");
    SPX_LAUNDER(b, "+r");
    SPX_SCALAR_STEP(c0); SPX_SCALAR_STEP(c1); SPX_SCALAR_STEP(c2); SPX_SCALAR_STEP(c3);
    SPX_SCALAR_STEP(c4); SPX_SCALAR_STEP(c5); SPX_SCALAR_STEP(c6); SPX_SCALAR_STEP(c7);
  }
#undef CONSTRAINT
  return digest(c0 + c1 + c2 + c3 + c4 + c5 + c6 + c7);
}

uint32_t float_scalar(int64_t iters, int32_t seed) {
#define CONSTRAINT SPX_FLOAT_REG
  // a < 1: each chain tends to b / (1 - a), far from overflow and denormals
  float a = 0.999f, b = 1e-3f * static_cast<float>(seed), c0 = 0, c1 = 1, c2 = 2, c3 = 3, c4 = 4, c5 = 5, c6 = 6,
        c7 = 7;
  for (int64_t i = 0; i < iters; ++i) {
    SPX_LAUNDER(a, SPX_FLOAT_REG);
    SPX_LAUNDER(b, SPX_FLOAT_REG);
    // a multiply, then an add (the build does not contract them), as the portable attention computes
    SPX_SCALAR_STEP(c0); SPX_SCALAR_STEP(c1); SPX_SCALAR_STEP(c2); SPX_SCALAR_STEP(c3);
    SPX_SCALAR_STEP(c4); SPX_SCALAR_STEP(c5); SPX_SCALAR_STEP(c6); SPX_SCALAR_STEP(c7);
  }
#undef CONSTRAINT
  return digest(c0 + c1 + c2 + c3 + c4 + c5 + c6 + c7);
}

}  // namespace

}  // namespace spx

#if defined(__x86_64__)

SPX_BEGIN_AVX2
namespace spx {
namespace {

#define SPX_I256(j) _mm256_set1_epi32(j)
#define SPX_F256(j) _mm256_set1_ps(static_cast<float>(j))

// AVX2's 8-bit products: VPMADDUBSW (32 u8 x s8 products summed in pairs into int16) added up in
// int16 (VPADDW): 32 multiply-adds an instruction, the limit of the avx2 linear kernels, which
// approach it where they add several products in int16 before widening them once (4-bit weights).
#define SPX_MADD16(n) "vpmaddubsw %[b], %[a], %[t]\n\tvpaddw %[t], " SPX_C(n) ", " SPX_C(n) "\n\t"
uint32_t int8_avx2(int64_t iters, int32_t seed) {
  __m256i a = _mm256_set1_epi32(seed * 0x01010101), b = _mm256_set1_epi32(seed * 0x01020304), t;
  SPX_DECLARE12(__m256i, SPX_I256);
  for (int64_t i = 0; i < iters; ++i) {
    SPX_LAUNDER(a, "+x");
    SPX_LAUNDER(b, "+x");
    asm volatile(SPX_STEPS12(SPX_MADD16) : SPX_OPERANDS12("+x"), [t] "=&x"(t) : [a] "x"(a), [b] "x"(b));
  }
  return digest(SPX_SUM12(_mm256_add_epi16));
}

// The same products each widened to int32 at once: VPMADDUBSW, VPMADDWD by ones (pairs into
// int32), VPADDD into the accumulator, 32 multiply-adds per three instructions (two of them
// multiplies): a kernel that cannot keep products in int16 (8-bit weights) is capped here.
#define SPX_MADD_PAIR(n) \
  "vpmaddubsw %[b], %[a], %[t]\n\tvpmaddwd %[ones], %[t], %[t]\n\tvpaddd %[t], " SPX_C(n) ", " SPX_C(n) "\n\t"
uint32_t int8_pair_avx2(int64_t iters, int32_t seed) {
  __m256i a = _mm256_set1_epi32(seed * 0x01010101), b = _mm256_set1_epi32(seed * 0x01020304), t;
  const __m256i ones = _mm256_set1_epi16(1);
  SPX_DECLARE12(__m256i, SPX_I256);
  for (int64_t i = 0; i < iters; ++i) {
    SPX_LAUNDER(a, "+x");
    SPX_LAUNDER(b, "+x");
    asm volatile(SPX_STEPS12(SPX_MADD_PAIR) : SPX_OPERANDS12("+x"), [t] "=&x"(t)
                 : [a] "x"(a), [b] "x"(b), [ones] "x"(ones));
  }
  return digest(SPX_SUM12(_mm256_add_epi32));
}

// The avx2 attention's arithmetic: bfloat16 keys and values widened to float32 once per block of
// keys, then 8-lane float32 FMAs; the FMA's rate is the bfloat16-equivalent rate.
#define SPX_VFMADD(n) "vfmadd231ps %[b], %[a], " SPX_C(n) "\n\t"
uint32_t fma_avx2(int64_t iters, int32_t seed) {
  __m256 a = _mm256_set1_ps(1e-3f * static_cast<float>(seed)), b = _mm256_set1_ps(1e-3f);
  SPX_DECLARE12(__m256, SPX_F256);
  for (int64_t i = 0; i < iters; ++i) {
    SPX_LAUNDER(a, "+x");
    SPX_LAUNDER(b, "+x");
    asm volatile(SPX_STEPS12(SPX_VFMADD) : SPX_OPERANDS12("+x") : [a] "x"(a), [b] "x"(b));
  }
  return digest(SPX_SUM12(_mm256_add_ps));
}

}  // namespace
}  // namespace spx
SPX_END

// The emulated build (test/emulate_avx512.h) has no AVX-512 registers to time.
#if !defined(SPECEXTEND_EMULATE_AVX512)

SPX_BEGIN_AVX512
namespace spx {
namespace {

#define SPX_I512(j) _mm512_set1_epi32(j)

// VPDPBUSD: 64 u8 x s8 products added in fours into 16 int32 lanes.
#define SPX_VPDPBUSD(n) "vpdpbusd %[b], %[a], " SPX_C(n) "\n\t"
uint32_t int8_avx512(int64_t iters, int32_t seed) {
  __m512i a = _mm512_set1_epi32(seed * 0x01010101), b = _mm512_set1_epi32(seed * 0x01020304);
  SPX_DECLARE16(__m512i, SPX_I512);
  for (int64_t i = 0; i < iters; ++i) {
    SPX_LAUNDER(a, "+v");
    SPX_LAUNDER(b, "+v");
    SPX_ITERATION16(SPX_VPDPBUSD, "v");
  }
  return digest(SPX_SUM16(_mm512_add_epi32));
}

#define SPX_F512(j) _mm512_set1_ps(static_cast<float>(j))

// 16-lane float32 FMAs: where VDPBF16PS is the slower (avx512_bf16_dot_pays), the bfloat16
// products of a prefill's attention, two FMAs a pair.
#define SPX_VFMADD512(n) "vfmadd231ps %[b], %[a], " SPX_C(n) "\n\t"
uint32_t fma_avx512(int64_t iters, int32_t seed) {
  __m512 a = _mm512_set1_ps(1e-3f * static_cast<float>(seed)), b = _mm512_set1_ps(1e-3f);
  SPX_DECLARE16(__m512, SPX_F512);
  for (int64_t i = 0; i < iters; ++i) {
    SPX_LAUNDER(a, "+v");
    SPX_LAUNDER(b, "+v");
    SPX_ITERATION16(SPX_VFMADD512, "v");
  }
  return digest(SPX_SUM16(_mm512_add_ps));
}

}  // namespace
}  // namespace spx
SPX_END

SPX_BEGIN_AVX512BF16
namespace spx {
namespace {

// VDPBF16PS: 32 bfloat16 products added in pairs into 16 float32 lanes.
#define SPX_VDPBF16PS(n) "vdpbf16ps %[b], %[a], " SPX_C(n) "\n\t"
uint32_t bf16_avx512(int64_t iters, int32_t seed) {
  __m512i a = _mm512_set1_epi16(static_cast<int16_t>(bf16_bits(1e-3f * static_cast<float>(seed))));
  __m512i b = _mm512_set1_epi16(static_cast<int16_t>(bf16_bits(1e-3f)));
  SPX_DECLARE16(__m512, SPX_F512);
  for (int64_t i = 0; i < iters; ++i) {
    SPX_LAUNDER(a, "+v");
    SPX_LAUNDER(b, "+v");
    SPX_ITERATION16(SPX_VDPBF16PS, "v");
  }
  return digest(SPX_SUM16(_mm512_add_ps));
}

}  // namespace
}  // namespace spx
SPX_END

namespace spx {
namespace {

// TDPBSUD on full tiles (16 rows x 64 bytes: 16x16x64 = 16384 products an instruction), four
// independent C tiles from two A and two B tiles. Tile instructions keep their operands in the
// tiles, so nothing can be folded or hoisted; only C tile 0 is read back, for the digest. Runs
// only where cpu.h says AMX runs (the process holds the tile-data permission).
uint32_t int8_amx(int64_t iters, int32_t seed) {
  TileConfig cfg;
  for (int t = 0; t < kTileRegs; ++t) {
    cfg.rows[t] = kTileMaxRows;
    cfg.colsb[t] = kTileMaxBytes;
  }
  alignas(64) uint8_t src[kTileMaxRows * kTileMaxBytes];
  for (int i = 0; i < static_cast<int>(sizeof(src)); ++i) src[i] = static_cast<uint8_t>(seed * 7 + i);
  alignas(64) int32_t out[kTileMaxRows * 16];
  NativeTiles::config(cfg);
  NativeTiles::zero<0>();
  NativeTiles::zero<1>();
  NativeTiles::zero<2>();
  NativeTiles::zero<3>();
  NativeTiles::load<4>(src, 64);
  NativeTiles::load<5>(src, 64);
  NativeTiles::load<6>(src, 64);
  NativeTiles::load<7>(src, 64);
  for (int64_t i = 0; i < iters; ++i) {
    NativeTiles::dpbsud<0, 4, 6>();
    NativeTiles::dpbsud<1, 4, 7>();
    NativeTiles::dpbsud<2, 5, 6>();
    NativeTiles::dpbsud<3, 5, 7>();
  }
  NativeTiles::store<0>(out, 64);
  NativeTiles::release();
  return digest(out);
}

}  // namespace
}  // namespace spx

#endif  // !SPECEXTEND_EMULATE_AVX512
#endif  // __x86_64__

#if defined(__aarch64__)

SPX_BEGIN_NEON
namespace spx {
namespace {

#define SPX_I128(j) vdupq_n_s32(j)
#define SPX_F128(j) vdupq_n_f32(static_cast<float>(j))

// SDOT: 16 s8 x s8 products added in fours into 4 int32 lanes.
#define SPX_SDOT(n) "sdot " SPX_C(n) ".4s, %[a].16b, %[b].16b\n\t"
uint32_t int8_neon(int64_t iters, int32_t seed) {
  int8x16_t a = vdupq_n_s8(static_cast<int8_t>(seed)), b = vdupq_n_s8(static_cast<int8_t>(3 * seed));
  SPX_DECLARE16(int32x4_t, SPX_I128);
  for (int64_t i = 0; i < iters; ++i) {
    SPX_LAUNDER(a, "+w");
    SPX_LAUNDER(b, "+w");
    SPX_ITERATION16(SPX_SDOT, "w");
  }
  return digest(SPX_SUM16(vaddq_s32));
}

// The neon attention's arithmetic: bfloat16 widened to float32, then 4-lane float32 FMAs.
#define SPX_FMLA(n) "fmla " SPX_C(n) ".4s, %[a].4s, %[b].4s\n\t"
uint32_t fma_neon(int64_t iters, int32_t seed) {
  float32x4_t a = vdupq_n_f32(1e-3f * static_cast<float>(seed)), b = vdupq_n_f32(1e-3f);
  SPX_DECLARE16(float32x4_t, SPX_F128);
  for (int64_t i = 0; i < iters; ++i) {
    SPX_LAUNDER(a, "+w");
    SPX_LAUNDER(b, "+w");
    SPX_ITERATION16(SPX_FMLA, "w");
  }
  return digest(SPX_SUM16(vaddq_f32));
}

}  // namespace
}  // namespace spx
SPX_END

// BFDOT where the CPU has it (Linux reports it; elsewhere it is not measured).
#if defined(__linux__)
#define SPX_PEAK_BFDOT 1
SPX_BEGIN_NEONBF16
namespace spx {
namespace {

// BFDOT: 8 bfloat16 products added in pairs into 4 float32 lanes. The inputs are plain 16-bit
// vectors holding bfloat16 bits (the instruction comes from the asm, not from an intrinsic).
#define SPX_BFDOT(n) "bfdot " SPX_C(n) ".4s, %[a].8h, %[b].8h\n\t"
uint32_t bf16_neon(int64_t iters, int32_t seed) {
  uint16x8_t a = vdupq_n_u16(bf16_bits(1e-3f * static_cast<float>(seed))), b = vdupq_n_u16(bf16_bits(1e-3f));
  SPX_DECLARE16(float32x4_t, SPX_F128);
  for (int64_t i = 0; i < iters; ++i) {
    SPX_LAUNDER(a, "+w");
    SPX_LAUNDER(b, "+w");
    SPX_ITERATION16(SPX_BFDOT, "w");
  }
  return digest(SPX_SUM16(vaddq_f32));
}

bool has_bf16() {
#ifndef HWCAP2_BF16
#define HWCAP2_BF16 (1 << 14)
#endif
  static const bool ok = (getauxval(AT_HWCAP2) & HWCAP2_BF16) != 0;
  return ok;
}

}  // namespace
}  // namespace spx
SPX_END
#endif  // BFDOT

#endif  // __aarch64__

namespace spx {

bool peak_loop(Path path, PeakKind kind, PeakLoop* out) {
  if (!cpu_supports(path) || path == Path::AMXEmulated) return false;
  const bool int8 = kind == PeakKind::Int8, bf16 = kind == PeakKind::BF16, pair = kind == PeakKind::Int8Pair;
#if defined(__x86_64__) && !defined(SPECEXTEND_EMULATE_AVX512)
  if (path == Path::AMX && int8) {
    *out = {"tdpbsud tmm 16x16x64",
            "the tile unit's rate on full tiles; the kernels multiply one weight group per instruction "
            "(K = 32, Q6K's 16), which takes as long: their ceiling is half of this (a quarter for Q6K)",
            4 * 16 * 16 * 64, int8_amx};
    return true;
  }
#endif
  if (path == Path::AMX) path = Path::AVX512;  // its attention and one-row products are avx512's
  switch (path) {
    case Path::Portable:
      if (int8)
        *out = {"scalar int32 multiply-add",
                "an estimate, not a limit: one product at a time in plain C++ (the portable kernels are the "
                "reference; the compiler may vectorize them beyond it)",
                kAccScalar, int8_scalar};
      else if (bf16)
        *out = {"scalar float32 multiply + add",
                "an estimate, not a limit: one product at a time in plain C++, as the portable attention computes",
                kAccScalar, float_scalar};
      else
        return false;
      return true;
#if defined(__x86_64__)
    case Path::AVX2:
      if (int8)
        *out = {"vpmaddubsw + vpaddw ymm",
                "products added in int16: the limit of 8-bit products on AVX2; the kernels approach it where "
                "they add several products in int16 before widening them (4-bit weights)",
                32 * kAcc12, int8_avx2};
      else if (pair)
        *out = {"vpmaddubsw + vpmaddwd + vpaddd ymm",
                "every product pair widened to int32 at once (two multiplies per 32 products): where a kernel "
                "cannot add products in int16 first (8-bit weights) it is capped here; not part of the floor",
                32 * kAcc12, int8_pair_avx2};
      else if (bf16)
        *out = {"vfmadd231ps ymm",
                "bfloat16 emulated: keys and values widened to float32 once per block of keys, then float32 FMAs; "
                "the FMA rate is the bfloat16-equivalent rate (the widening not counted)",
                8 * kAcc12, fma_avx2};
      else
        return false;
      return true;
#if !defined(SPECEXTEND_EMULATE_AVX512)
    case Path::AVX512:
      if (int8) {
        *out = {"vpdpbusd zmm", "", 64 * kAcc16, int8_avx512};
      } else if (bf16 && cpu_has_avx512_bf16() && avx512_bf16_dot_pays()) {
        *out = {"vdpbf16ps zmm", "", 32 * kAcc16, bf16_avx512};
      } else if (bf16 && cpu_has_avx512_bf16()) {
        *out = {"vfmadd231ps zmm",
                "VDPBF16PS measured slower than FMAs here: a prefill's attention runs two FMAs a bfloat16 pair "
                "(the same bits); one row's attention stays on VDPBF16PS (bf16_native)",
                16 * kAcc16, fma_avx512};
      } else if (kind == PeakKind::BF16Native && cpu_has_avx512_bf16()) {
        *out = {"vdpbf16ps zmm",
                avx512_bf16_dot_pays()
                    ? "the bf16 loop here: VDPBF16PS beats FMAs on this CPU (attention, and BF16 files' products)"
                    : "the CPU has it; here slower than FMAs, so only one row's attention uses it",
                32 * kAcc16, bf16_avx512};
      } else if (bf16) {
        *out = {"vfmadd231ps ymm",
                "no AVX512-BF16 on this CPU: the avx512 path's attention runs the avx2 kernel (bfloat16 widened to "
                "float32 once per block of keys, then float32 FMAs)",
                8 * kAcc12, fma_avx2};
      } else {
        return false;
      }
      return true;
#endif
#endif
#if defined(__aarch64__)
    case Path::NEON:
      if (int8) {
        *out = {"sdot .4s", "", 16 * kAcc16, int8_neon};
      } else if (bf16) {
        *out = {"fmla .4s",
                "bfloat16 emulated: keys and values widened to float32, then float32 FMAs; the FMA rate is the "
                "bfloat16-equivalent rate (the widening not counted)",
                4 * kAcc16, fma_neon};
#if defined(SPX_PEAK_BFDOT)
      } else if (has_bf16()) {
        *out = {"bfdot .4s", "the CPU has it; the neon attention does not use it (not part of the floor)",
                8 * kAcc16, bf16_neon};
#endif
      } else {
        return false;
      }
      return true;
#endif
    default: return false;
  }
}

const char* peak_kind_name(PeakKind kind) {
  switch (kind) {
    case PeakKind::Int8: return "int8";
    case PeakKind::BF16: return "bf16";
    case PeakKind::BF16Native: return "bf16_native";
    case PeakKind::Int8Pair: return "int8_pair";
  }
  return "?";
}

}  // namespace spx
