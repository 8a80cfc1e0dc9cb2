// The CPU's multiply-add limit per kernel path: register-only loops of the instruction each path's
// kernels compute with (its int8 dot product for the linear layers, the bfloat16 arithmetic of its
// attention), for `specextend kernels --peak` and the runtime bench's roofline.
//
// A loop keeps every value in registers (no loads or stores inside), runs enough independent
// accumulators to cover the instruction's latency, and passes its inputs through an empty asm
// statement before each use, so the compiler can neither fold nor hoist the arithmetic: what it
// times is the instruction's throughput on one thread. The caller times the loop (one call per
// thread) and counts multiply-adds as iterations x `macs_per_iter`.
#pragma once

#include <cstdint>

#include "cpu.h"

namespace spx {

// int8: the most int8 products a second the path's linear layers can compute; bf16: what the
// path's attention computes bfloat16 products with. Reported beside them, not part of the floor:
// bf16_native, a bfloat16 instruction the CPU has but the path's attention does not use, and
// int8_pair, avx2's dot product with every product pair widened to int32 at once.
enum class PeakKind : int { Int8 = 0, BF16 = 1, BF16Native = 2, Int8Pair = 3 };
constexpr int kPeakKinds = 4;

struct PeakLoop {
  const char* instruction;  // what one step of the loop runs
  const char* note;         // how the loop stands for the kernels' arithmetic ("" where it is their own)
  int64_t macs_per_iter;    // multiply-adds one iteration performs
  // Runs `iters` iterations from inputs derived from `seed`; returns a digest of the
  // accumulators (the caller keeps it, so the work is not dead).
  uint32_t (*run)(int64_t iters, int32_t seed);
};

// The loop for `kind` on `path`; false where the path has none (a path this CPU cannot run, a
// kind it lacks, or an emulated build).
bool peak_loop(Path path, PeakKind kind, PeakLoop* out);

const char* peak_kind_name(PeakKind kind);

}  // namespace spx
