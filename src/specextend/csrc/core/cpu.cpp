// CPU feature detection for the kernel paths (cpu.h).
#include "cpu.h"

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

}  // namespace

bool cpu_supports(Path p) {
  switch (p) {
    case Path::Portable: return true;
    case Path::AVX2: return avx2();
    case Path::AVX512: return avx512();
    case Path::NEON: return neon_dotprod();
  }
  return false;
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
  }
  return "?";
}

}  // namespace spx
