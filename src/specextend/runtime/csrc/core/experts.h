// The row operations of a mixture-of-experts layer (runtime/experts.py) that are not products: the
// router's weighting (a row's logits -> its top-k experts and their weights) and the weighted sum of
// a row's expert outputs. Plain scalar code with fastexp.h's exp (no SIMD, built without
// contraction): the same bits on every path and CPU. The per-layer forward (through the torch
// binding) and the whole-step call (step.h) both call these, so the two give the same bits; a row's
// result reads only that row.
#pragma once

#include <cstdint>

namespace spx {

// How a row's router logits become its experts' weights (experts.py, WEIGHTINGS).
enum class Weighting : int {
  SoftmaxTopk = 0,      // softmax over all experts, then the top k (Qwen2-MoE, OLMoE)
  SoftmaxTopkNorm = 1,  // the same, the k weights divided by their sum (Qwen3-MoE, Mixtral)
  TopkSoftmax = 2,      // the top k logits, then a softmax over them (gpt-oss)
  // softmax over all experts; the top k of the probabilities plus a per-expert selection bias, weighted
  // by their probabilities divided by their sum (at least kNormMin) (ERNIE 4.5's MoE)
  SoftmaxBiasedTopkNorm = 3,
  // a sigmoid of each logit; the top k of those plus a per-expert selection bias, weighted by their sigmoids
  // divided by their sum plus kSigmoidNormEps (LFM2's MoE)
  SigmoidBiasedTopkNorm = 4,
};
constexpr int kWeightings = 5;
constexpr float kNormMin = 1e-12f;  // ERNIE 4.5's moe_norm_min
constexpr float kSigmoidNormEps = 1e-6f;  // what transformers' Lfm2MoeTopKRouter adds to the sum

// Whether a weighting picks by its probabilities plus a selection bias (it takes one, the others none).
inline bool biased(Weighting kind) {
  return kind == Weighting::SoftmaxBiasedTopkNorm || kind == Weighting::SigmoidBiasedTopkNorm;
}

// A row's top `used` of `count` experts, by descending weight (ties: the lower index first), into
// experts [used] and weights [used]. The softmax: m = the maximum, e_i = exp(l_i - m), s = their
// sum in index order (the selected ones' in rank order for TopkSoftmax), p_i = e_i / s.
// `select_bias` [count]: the biased weightings' (the others take none: null). The sigmoid: 1 / (1 + exp(-l)),
// the kernels' exp.
// scratch: 2 `count` floats and `count` indices (nothing is allocated: a step's parallel region calls it).
void route_row(const float* logits, int64_t count, int64_t used, Weighting kind, const float* select_bias,
               int64_t* experts, float* weights, float* scratch, int64_t* iscratch);

// The experts' gated activations (experts.py, ACTIVATIONS): SiLU runs inside the quantization of the down
// product's input (PreOp::silu_mul); gpt-oss's clamped SwiGLU is this row operation first.
enum class ExpertAct : int { Silu = 0, SwigluOai = 1 };
constexpr int kExpertActs = 2;

// gpt-oss's `swiglu_oai` of a row [gate | up] (2 ff values): g = min(gate, 7), u = clamp(up, -7, 7),
// out = (u + 1) * (g * sigmoid(1.702 g)), sigmoid by fastexp.h's exp_neg_plain (vectorized); out may be gu.
void swiglu_oai_row(const float* gu, int64_t ff, float* out);

// out [hidden] = w_0 * y_0 + w_1 * y_1 + ... in rank order (one product and one sum at a time).
void weighted_sum_row(const float* const* ys, const float* weights, int64_t used, int64_t hidden, float* out);

// Qwen2-MoE's shared expert added to a row's experts' sum: out [hidden] = out + sigmoid(gate) * s (the
// product rounded, then the sum; sigmoid as swiglu_oai_row's).
void shared_expert_add_row(float* out, float gate, const float* s, int64_t hidden);
// An ungated shared expert's (ERNIE 4.5's): out [hidden] = out + s.
void shared_expert_add_row(float* out, const float* s, int64_t hidden);

}  // namespace spx
