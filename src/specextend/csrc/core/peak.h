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

// int8: the linear layers' dot products; bf16: what the path's attention computes bfloat16
// products with; bf16_native: a bfloat16 instruction the CPU has but the path's attention does
// not use (reported, not part of the floor).
enum class PeakKind : int { Int8 = 0, BF16 = 1, BF16Native = 2 };
constexpr int kPeakKinds = 3;

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
