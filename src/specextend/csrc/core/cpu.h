// The instruction-set paths of the kernels and what this CPU can run.
//
// A path names the code that computes a kernel; every path computes the same arithmetic in the
// same order, so each gives the portable path's bits (and a token's outputs do not depend on
// which path, or which other tokens, shared the call). Paths differ only in speed.
#pragma once

namespace spx {

enum class Path : int { Portable = 0, AVX2 = 1, AVX512 = 2, NEON = 3 };
constexpr int kPaths = 4;

// Whether `p` is compiled into this build and this CPU runs it.
bool cpu_supports(Path p);

// AVX-512 attention uses VDPBF16PS where the CPU has it; elsewhere the avx512 path runs the
// AVX2 attention kernel (same bits).
bool cpu_has_avx512_bf16();

const char* path_name(Path p);

}  // namespace spx
