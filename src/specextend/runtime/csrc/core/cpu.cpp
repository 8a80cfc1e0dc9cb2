// CPU feature detection for the kernel paths (cpu.h).
#include "cpu.h"

#include <algorithm>
#include <chrono>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <initializer_list>

#if defined(__x86_64__)
#include <cpuid.h>
#endif
#if defined(__x86_64__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#endif
#if defined(__aarch64__) && defined(__APPLE__)
#include <sys/sysctl.h>
#endif

namespace spx {

namespace {

#if defined(__x86_64__)
#define has(feature) (__builtin_cpu_supports(feature) != 0)
#endif

bool avx2() {
#if defined(__x86_64__)
  static const bool ok = has("avx2") && has("fma") && has("f16c");
  return ok;
#else
  return false;
#endif
}

bool avx512() {
#if defined(SPECEXTEND_EMULATE_AVX512)
  return true;  // the exactness harness runs the AVX-512 code under emulation (test/exactness.cpp)
#elif defined(__x86_64__)
  static const bool ok = avx2() && has("avx512f") && has("avx512bw") && has("avx512vl") && has("avx512dq") &&
                         has("avx512vnni");
  return ok;
#else
  return false;
#endif
}

bool neon_dotprod() {
#if defined(__aarch64__) && defined(__linux__)
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
  static const bool ok = (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
  return ok;
#elif defined(__aarch64__) && defined(__APPLE__)
  static const bool ok = [] {
    int v = 0;
    size_t n = sizeof(v);
    return sysctlbyname("hw.optional.arm.FEAT_DotProd", &v, &n, nullptr, 0) == 0 && v != 0;
  }();
  return ok;
#else
  return false;
#endif
}

#if defined(__x86_64__)
uint64_t xgetbv0() {
  uint32_t lo, hi;
  asm volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}
#endif

// The permission to use AMX's 8 KB of tile state, once per process (Linux: arch/x86 xstate
// docs). Without it the first tile instruction faults even where CPUID and XCR0 say AMX.
int request_amx_permission() {
  const char* test = std::getenv("SPECEXTEND_TEST_AMX_PERMISSION");
  if (test != nullptr && std::strcmp(test, "deny") == 0) return EPERM;
#if defined(__x86_64__) && defined(__linux__)
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0 ? 0 : errno;
#else
  return ENOSYS;
#endif
}

AmxProbe probe_amx() {
  AmxProbe p;
#if defined(__x86_64__) && !defined(SPECEXTEND_EMULATE_AVX512)
  p.x86 = true;
  p.avx512 = avx512();
  unsigned a, b, c, d;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
    p.tile = (d >> 24) & 1;
    p.int8 = (d >> 25) & 1;
  }
  if (!p.tile || !p.int8) return p;
  if (__get_cpuid_count(0x1D, 0, &a, &b, &c, &d)) p.max_palette = a;
  if (p.max_palette >= 1 && __get_cpuid_count(0x1D, 1, &a, &b, &c, &d)) {
    p.palette1[0] = a;
    p.palette1[1] = b;
    p.palette1[2] = c;
    p.palette1[3] = d;
  }
  if (__get_cpuid(1, &a, &b, &c, &d)) p.osxsave = (c >> 27) & 1;
  if (p.osxsave) p.xcr0 = xgetbv0();
  // Only a CPU and OS with AMX are asked for the permission. The refusal is judged as if it were
  // granted: `permission` starts "not asked" (-1), which amx_refusal reads as refused, so judging
  // the probe as it stands would never ask (AMX then never ran on an AMX machine).
  p.permission = 0;
  const bool hardware_has_amx = amx_refusal(p) == nullptr;
  p.permission = -1;
  if (!hardware_has_amx) return p;
  p.permission = request_amx_permission();
#endif
  return p;
}

}  // namespace

const char* amx_refusal(const AmxProbe& p) {
  if (!p.x86) return "this build has no amx code (not x86-64, or an emulated test build)";
  if (!p.tile || !p.int8) return "no AMX-TILE and AMX-INT8 in CPUID";
  if (!p.avx512) return "no AVX-512 with VNNI on this CPU";
  if (p.max_palette < 1) return "CPUID leaf 0x1D reports no tile palette 1";
  // Palette 1 as the kernels use it: 8 KB of tile data, 1 KB tiles of 16 rows x 64 bytes, 8 tiles.
  const uint32_t* t = p.palette1;
  if ((t[0] & 0xFFFF) < 8192 || (t[0] >> 16) < 1024 || (t[1] & 0xFFFF) < 64 || (t[1] >> 16) < 8 ||
      (t[2] & 0xFFFF) < 16)
    return "tile palette 1 is smaller than 8 tiles of 16 rows x 64 bytes";
  if (!p.osxsave) return "the OS does not enable XSAVE";
  if (((p.xcr0 >> 17) & 3) != 3) return "the OS does not enable the tile state (XCR0 bits 17-18)";
  if (p.permission != 0) return "Linux refused the tile-data permission (arch_prctl ARCH_REQ_XCOMP_PERM)";
  return nullptr;
}

const AmxProbe& amx_probe() {
  static const AmxProbe p = probe_amx();
  return p;
}

const char* amx_status() {
  static const char* why = amx_refusal(amx_probe());
  return why;
}

bool cpu_supports(Path p) {
  switch (p) {
    case Path::Portable: return true;
    case Path::AVX2: return avx2();
    case Path::AVX512: return avx512();
    case Path::NEON: return neon_dotprod();
    case Path::AMX: return amx_status() == nullptr;
    case Path::AMXEmulated: return true;
  }
  return false;
}

Path vector_path(Path p) {
  if (p == Path::AMX) return Path::AVX512;
  if (p != Path::AMXEmulated) return p;
  for (Path v : {Path::AVX512, Path::AVX2, Path::NEON})
    if (cpu_supports(v)) return v;
  return Path::Portable;
}

bool cpu_has_avx512_bf16() {
#if defined(SPECEXTEND_EMULATE_AVX512)
  return true;
#elif defined(__x86_64__)
  static const bool ok = avx512() && has("avx512bf16");
  return ok;
#else
  return false;
#endif
}

const char* path_name(Path p) {
  switch (p) {
    case Path::Portable: return "portable";
    case Path::AVX2: return "avx2";
    case Path::AVX512: return "avx512";
    case Path::NEON: return "neon";
    case Path::AMX: return "amx";
    case Path::AMXEmulated: return "amx-emulated";
  }
  return "?";
}

}  // namespace spx

// ------------------------------------------------------------------ VDPBF16PS against FMAs

#if defined(__x86_64__) && !defined(SPECEXTEND_EMULATE_AVX512)
#include <immintrin.h>

#include "target.h"

SPX_BEGIN_AVX512BF16
namespace spx {
namespace {

// Seconds of `iters` steps of 12 independent chains: VDPBF16PS (32 products a step) or two
// FMAs (the same 32), the inputs hidden from the compiler so that nothing folds.
template <bool kDot>
double chain_seconds(int iters) {
  __m512 c[12];
  for (auto& v : c) v = _mm512_setzero_ps();
  __m512 a = _mm512_set1_ps(1.0f), b = _mm512_set1_ps(1e-30f);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) {
    __asm__ volatile("" : "+v"(a), "+v"(b));
#pragma GCC unroll 12
    for (auto& v : c) {
      if constexpr (kDot) {
        v = _mm512_dpbf16_ps(v, (__m512bh)_mm512_castps_si512(a), (__m512bh)_mm512_castps_si512(b));
      } else {
        v = _mm512_fmadd_ps(a, b, _mm512_fmadd_ps(b, a, v));
      }
    }
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  __m512 sum = c[0];
  for (int j = 1; j < 12; ++j) sum = _mm512_add_ps(sum, c[j]);
  volatile float keep = _mm512_reduce_add_ps(sum);
  (void)keep;
  return s;
}

bool dot_beats_fma() {  // the best of three of each, interleaved (about a millisecond)
  double dot = 1e9, fma = 1e9;
  for (int r = 0; r < 3; ++r) {
    dot = std::min(dot, chain_seconds<true>(20000));
    fma = std::min(fma, chain_seconds<false>(20000));
  }
  return dot < 0.8 * fma;
}

}  // namespace
}  // namespace spx
SPX_END
#endif

namespace spx {

// AMD's Zen 4 and 5 run VDPBF16PS at twice their FMA rate, Intel's Xeons at half of theirs: timed
// once a process. SPECEXTEND_BF16_DOT=1 or 0 decides instead (the exactness tests run both: the
// bits must be the same); the emulated AVX-512 build keeps VDPBF16PS unless told.
bool avx512_bf16_dot_pays() {
  static const bool pays = [] {
    if (!cpu_has_avx512_bf16()) return false;
    if (const char* e = std::getenv("SPECEXTEND_BF16_DOT"); e != nullptr && (e[0] == '0' || e[0] == '1'))
      return e[0] == '1';
#if defined(__x86_64__) && !defined(SPECEXTEND_EMULATE_AVX512)
    return dot_beats_fma();
#else
    return true;
#endif
  }();
  return pays;
}

}  // namespace spx
