// Per-file instruction-set regions: code between SPX_BEGIN_<ISA> and SPX_END is compiled for that
// instruction set (and runs only after cpu.h says the CPU has it); the rest of the build stays
// at the baseline, so one binary serves every CPU of its architecture.
#pragma once

#if defined(SPECEXTEND_EMULATE_AVX512)
// test/emulate_avx512.h builds AVX-512 operations from AVX2 ones
#define SPX_END _Pragma("GCC pop_options")
#define SPX_BEGIN_AVX2 _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma,f16c\")")
#define SPX_BEGIN_AVX512 SPX_BEGIN_AVX2
#define SPX_BEGIN_AVX512BF16 SPX_BEGIN_AVX2
#define SPX_BEGIN_NEON
#define SPX_BEGIN_NEONBF16
#elif defined(__clang__)
#define SPX_END _Pragma("clang attribute pop")
#define SPX_BEGIN_AVX2 _Pragma("clang attribute push(__attribute__((target(\"avx2,fma,f16c\"))), apply_to = function)")
#define SPX_BEGIN_AVX512 \
  _Pragma("clang attribute push(__attribute__((target(\"avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c\"))), apply_to = function)")
#define SPX_BEGIN_AVX512BF16 \
  _Pragma("clang attribute push(__attribute__((target(\"avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c\"))), apply_to = function)")
#define SPX_BEGIN_NEON _Pragma("clang attribute push(__attribute__((target(\"dotprod\"))), apply_to = function)")
#define SPX_BEGIN_NEONBF16 \
  _Pragma("clang attribute push(__attribute__((target(\"dotprod,bf16\"))), apply_to = function)")
#else
#define SPX_END _Pragma("GCC pop_options")
#define SPX_BEGIN_AVX2 _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma,f16c\")")
#define SPX_BEGIN_AVX512 \
  _Pragma("GCC push_options") _Pragma("GCC target(\"avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c\")")
#define SPX_BEGIN_AVX512BF16 \
  _Pragma("GCC push_options") _Pragma("GCC target(\"avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c\")")
#define SPX_BEGIN_NEON _Pragma("GCC push_options") _Pragma("GCC target(\"arch=armv8.2-a+dotprod\")")
#define SPX_BEGIN_NEONBF16 _Pragma("GCC push_options") _Pragma("GCC target(\"arch=armv8.2-a+dotprod+bf16\")")
#endif
