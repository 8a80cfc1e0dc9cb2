// The row operations a model family adds to the Llama block (runtime/families.py): an RMSNorm
// over a whole row (OLMo 2's query/key norms, the post norms), the residual add through a post
// norm and a residual multiplier (Gemma's sandwich norms, OLMo 2, Granite), and GeGLU with the
// tanh-approximated GELU (Gemma). Plain scalar code (no SIMD; the kernels build without
// contraction) and fastexp.h's exp in plain arithmetic, not the C library's: the same bits on
// every path and every CPU. The per-layer forward (layers.py, through the torch binding) and the whole-step call
// (step.h) both call these, so the two give the same bits; a row's result reads only that row.
#pragma once

#include <cstdint>

namespace spx {

// out [k] = w * (x * 1 / sqrt(mean(x^2) + eps)) (w null: no weight); out may be x.
void rms_row(const float* x, int64_t k, const float* w, float eps, float* out);

// out [k] = x + scale * post(y), post the RMSNorm with weight `norm` (null: none) and the
// multiplication skipped where scale is 1; out may be x or y.
void residual_row(const float* x, const float* y, int64_t k, const float* norm, float eps, float scale, float* out);

// out [inter] = gelu_tanh(gate) * up, of a row [gate | up] (2 inter values); out may be gu.
void gelu_mul_row(const float* gu, int64_t inter, float* out);

}  // namespace spx
