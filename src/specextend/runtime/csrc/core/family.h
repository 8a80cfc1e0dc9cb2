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

// out [k] = x - mean(x), the mean from 16 interleaved partial sums (lane i % 16) added in lane order; out may be x.
void center_row(const float* x, int64_t k, float* out);

// out [k] = x + scale * post(y), post the RMSNorm with weight `norm` (null: none) and the
// multiplication skipped where scale is 1; out may be x or y.
void residual_row(const float* x, const float* y, int64_t k, const float* norm, float eps, float scale, float* out);

// out [inter] = gelu_tanh(gate) * up, of a row [gate | up] (2 inter values); out may be gu.
void gelu_mul_row(const float* gu, int64_t inter, float* out);

// LFM2's gated short convolution, in two steps so that every row of a forward has stored its input before any
// row reads it (a tree row reads its parent's). bcx [3 * hidden] is the row's input projection (B, C, x):
// conv_input_row stores its B * x in `own` (its slot of the layer's state); conv_row then gives out [hidden] =
// C * (w[:, 0] * tap_0 + w[:, 1] * tap_1 + ...), taps[kernel] the state rows of the tokens the row reads, oldest
// first and its own last (null: none, a zero), w [hidden, kernel]; each product rounded before its add (the kernels
// build without contraction), as layers.py's PyTorch operations compute it.
void conv_input_row(const float* bcx, int64_t hidden, float* own);
void conv_row(const float* bcx, int64_t hidden, const float* const* taps, const float* w, int64_t kernel, float* out);

}  // namespace spx
