// A whole forward of a few new tokens through every layer of a quantized model, in one call.
//
// Why: a one-row decode step of a 0.5B draft streams ~0.3 GB of weights in ~12 ms, and driving it
// from Python costs six kernel calls a layer, each a Python-to-C++ crossing and a wake-up of the
// thread team (docs/log/2026-11-step-costs.md measures that share). Here one parallel region runs every
// layer; the threads meet at a barrier between the layer's phases instead of being handed work
// anew for each operator.
//
// The bits are the Python-driven layer's (transformer.py, Block.forward_rows): every phase calls the
// same core functions with the same arguments (quantize_rows with the fused pre-op, linear_unit
// of plan_linear's units, rope_tokens, attend_item of plan_attention), and none of them
// depends on which thread computes which unit.
//
// One layer, for t rows x [t, hidden]:
//   qkv = quantize(rmsnorm(x)) . Wqkv (+ bias); q = rope(q), k = rope(k) (Qwen3: per-head norms
//   first); k, v stored in bfloat16 at the pending cache slots; a = attend(q, cache[:end], mask);
//   x2 = x + a . Wo; gu = quantize(rmsnorm(x2)) . Wgu; x = x2 + quantize(silu(g) * u) . Wdown.
// A family's switches (StepLayer, family.h) change it where its per-layer forward does
// (layers.py, Block._switched_rows): no pre-norm (OLMo 2), whole-row q/k norms before rope,
// partial rotary, a score scale, a windowed layer's keys, x2 = x + scale * post_norm(a . Wo)
// (likewise after the MLP), GeGLU; LFM2's convolution layers replace rope and attention with their
// convolution (a = conv(qkv), the output projection's input of the hidden width).
#pragma once

#include <cstdint>
#include <vector>

#include "cpu.h"
#include "experts.h"
#include "qlinear.h"

namespace spx {

// One product's weight: its segments side by side (qlinear.h's Linear without its rows).
struct StepLinear {
  std::vector<Segment> segs;
  std::vector<int64_t> first_panel{0};  // [segs + 1]
  int64_t n = 0;                        // output width
  const float* bias = nullptr;          // [n] or null
  void add(const Segment& s) {
    segs.push_back(s);
    first_panel.push_back(first_panel.back() + s.panels());
    n += s.n;
  }
  int64_t panels() const { return first_panel.back(); }
};

// A layer's mixture of experts (runtime/experts.py) in place of gate_up and down (Qwen3-MoE, OLMoE,
// Mixtral, gpt-oss, Qwen2-MoE). Each used expert runs its gate/up and down products (with its biases,
// if any) once over the rows that chose it, each row quantized on its own (as experts_rows does from
// Python), and a row's outputs are summed in its own rank order; a shared expert (Qwen2-MoE, ERNIE 4.5) runs
// over every row as a dense MLP and joins that sum, under its sigmoid gate where it has one
// (shared_expert_add_row). Layers without experts among them (ERNIE 4.5's first) have count 0.
struct StepExperts {
  // The router's float32 weights as three bfloat16 parts [3 * m, hidden], m = count (+ 1: the shared
  // expert's gate, the last row of each part).
  StepLinear router;
  const float* router_bias = nullptr;  // [count] or null
  const float* select_bias = nullptr;  // [count]: the biased weightings' selection bias, else null
  Segment gate{}, up{}, down{};        // stacked: [count * ff, hidden] twice, [count * hidden, ff]
  const float* gate_up_bias = nullptr;  // [count, 2 ff] or null
  const float* down_bias = nullptr;     // [count, hidden] or null
  int64_t count = 0, used = 0, ff = 0;
  StepLinear shared_gate_up, shared_down;  // [2 shared_ff, hidden], [hidden, shared_ff]; empty: none
  int64_t shared_ff = 0;
  bool shared_gated = true;  // the shared expert under a sigmoid gate (Qwen2-MoE), or added as it is (ERNIE 4.5)
  Weighting kind = Weighting::SoftmaxTopk;
  ExpertAct act = ExpertAct::Silu;
  // Expert e's rows of a stacked segment: its panels' byte range (the kernels' layout is panel-major).
  static Segment slice(Segment s, int64_t experts, int64_t e) {
    s.n /= experts;
    s.blob += e * s.panels() * s.panel_bytes();
    return s;
  }
};
constexpr int64_t kMaxExpertsUsed = 64;
constexpr int64_t kMaxConvKernel = 16;  // the longest short convolution (LFM2's: 3)

struct StepLayer {
  StepLinear qkv, o, gate_up, down;  // gate_up and down empty where the layer has experts (moe)
  StepExperts moe;                   // count 0: none
  const float* attn_norm = nullptr;  // [hidden]
  const float* mlp_norm = nullptr;   // [hidden]
  const float* q_norm = nullptr;     // [head_dim] or null (Qwen3)
  const float* k_norm = nullptr;
  // Which of the batch's rope tables rotates this layer's queries and keys: a family may give
  // some layers a rope of their own, or none (SmolLM3's NoPE layers: a table of angle zero,
  // cos 1 and sin 0, which rope_tokens applies exactly as the identity).
  int64_t rope_kind = 0;
  // A family's switches (family.h; all off: the Llama block). attn_norm/mlp_norm may be null
  // (OLMo 2 has no norms before its sublayers).
  const float* attn_out_norm = nullptr;  // [hidden]: on attention's output, before the residual add
  const float* mlp_out_norm = nullptr;   // [hidden]: on the MLP's output
  const float* q_full_norm = nullptr;    // [heads * head_dim]: over all of a row's queries, before rope
  const float* k_full_norm = nullptr;    // [kv_heads * head_dim]
  bool windowed = false;                 // attends through its sequence's window (StepSeq::wfirst, wmask)
  int64_t kv_index = 0;                  // its index among the windowed layers' or the others' caches
  bool gelu = false;                     // GeGLU (tanh GELU) instead of SwiGLU
  const float* sinks = nullptr;          // [heads]: gpt-oss's attention sinks (attention.h), or null
  const float* k_offset = nullptr;       // [kv_heads * head_dim]: subtracted from keys a q8 cache stores (rope.h)
  // LFM2's short convolution in place of attention (family.h's conv_input_row, conv_row): qkv is its input
  // projection [3 hidden] (B, C, x), o its output projection, conv its kernel [hidden, conv_kernel]; kv_index
  // then indexes the sequences' convolution states (StepSeq::conv_state). Null: an attention layer.
  const float* conv = nullptr;
  int64_t conv_kernel = 0;
};

struct StepModel {
  int64_t hidden = 0, heads = 0, kv_heads = 0, head_dim = 0;
  float eps = 0.f;
  std::vector<StepLayer> layers;
  float attn_scale = 0.f;      // the attention score scale; 0: 1 / sqrt(head_dim)
  float attn_softcap = 0.f;    // > 0: attention scores soft-capped at it (Gemma 2; attention.h)
  float residual_scale = 1.f;  // multiplies the sublayers' outputs (Granite)
  bool layer_norm = false;     // every norm a LayerNorm without bias (PreOp::center; Cohere)
  // Attention and the MLP both read the layer's input through its attention norm, their outputs added to it in
  // that order (Cohere's parallel block); the layers have no post norms and no experts.
  bool parallel = false;
  int64_t rot = 0;             // rotary dimensions of a head (partial rotary); 0: head_dim
  int64_t rope_width() const { return rot > 0 ? rot : head_dim; }
};

// The new tokens and the cache they extend.
struct StepRows {
  float* x;          // [t, hidden]: the embeddings in, the last layer's output out
  const float* cos;  // [t, head_dim]
  const float* sin;
  int64_t t;
  uint16_t* k;  // bfloat16 caches [layers, kv_heads, capacity, head_dim]
  uint16_t* v;
  int64_t capacity;
  int64_t start;      // the first pending slot: the new tokens' K/V go to [start, start + t)
  const bool* mask;   // [t, m] (what each new token sees among the last m slots) or null: causal
  int64_t m;
  // Per layer, where that layer's rotated queries [heads, t, head_dim] are copied, or null (all
  // null, or no array: none). Retrieval scores the cache with some layers' queries.
  float* const* keep_q = nullptr;
};

// One sequence's part of a batched step: its rows are `t` consecutive rows of the batch's x,
// cos and sin; the rest is StepRows' (its own cache, mask and kept queries).
struct StepSeq {
  int64_t t;
  uint16_t* k;
  uint16_t* v;
  int64_t capacity, start;
  const bool* mask;
  int64_t m;
  float* const* keep_q = nullptr;
  // The windowed layers' keys: slots [wfirst, start + t), under wmask [t, start + t - wfirst]
  // (attention.py's window_mask: what the tree or causal mask allows within each row's window).
  int64_t wfirst = 0;
  const bool* wmask = nullptr;
  // The windowed layers' own caches [windowed layers, kv_heads, wcapacity, head_dim], whose slot 0
  // holds the token at position woffset (kv_cache.py: they may keep only the window); k and v
  // then hold the other layers.
  uint16_t* wk = nullptr;
  uint16_t* wv = nullptr;
  int64_t wcapacity = 0, woffset = 0;
  bool q8 = false;  // k, v hold q8 rows (kv_q8.h); sizes and strides in 16-bit units either way
  // The convolution layers' states [conv layers, conv_capacity, hidden] (float32: each slot a token's B * x)
  // and each row's taps [t, conv_kernel]: the slots it reads, oldest first and its own last (-1: none).
  float* conv_state = nullptr;
  int64_t conv_capacity = 0;
  const int64_t* taps = nullptr;
};

// The final norm and the LM head (a draft's trimmed head, or the whole one).
struct StepHead {
  StepLinear w;  // k = hidden
  const float* norm = nullptr;
  float eps = 0.f;
};

// Several sequences' new tokens in one forward: the products take every row at once (each weight
// is read once for all of them), RoPE, the cache writes and attention run per sequence over its
// own cache. Rows `logit_rows` of the last layer's output then go through the head into
// `logits` [n_logits, head->w.n] (no head, or no rows: no logits).
struct StepBatch {
  float* x;  // [T, hidden], T the sequences' rows together
  const float* cos;  // [kinds, T, rope_width]: one table per rope kind (StepLayer::rope_kind)
  const float* sin;
  const StepSeq* seqs;
  int64_t nseqs;
  const StepHead* head = nullptr;
  const int64_t* logit_rows = nullptr;
  int64_t n_logits = 0;
  float* logits = nullptr;
};

// A step's buffers, kept by the caller between steps so that a prefill chunk's (tens of MB) are
// not mapped anew each time: they only grow. One step at a time uses one.
struct StepWorkspace {
  std::vector<float> x2, qkv, q, att, att_rows, gu, pre, acc, hx, d8, xs, xf;
  std::vector<int8_t> q8, q8g, kq8;
  std::vector<int32_t> s16, s32;
  std::vector<float> kd;
  std::vector<int16_t> ks16, ks32;
  // Expert layers: router logits, each row's experts and weights, the (row, rank) slots grouped by
  // expert, the slots' inputs, their quantized rows, gate/up and outputs, and the weighted sums.
  std::vector<float> logits, weights, route_scratch, xg, egu, ey, esum, sgu, sy;  // sgu, sy: the shared expert's
  std::vector<int64_t> experts, start, order, where, route_index;
  std::vector<int8_t> eq8, ekq8;
  std::vector<float> ed8, exs, exf, ekd;
  std::vector<uint32_t> xb, exb;  // BF16D's bfloat16 rows (Rows::xb)
  std::vector<int32_t> es16, es32;
  std::vector<int16_t> eks16, eks32;
};

// Runs every layer on `threads` threads (one parallel region). The caller has checked the shapes.
void forward_step(Path path, const StepModel& model, const StepRows& rows, int threads);

// The batch in one parallel region; a sequence's outputs (its rows of x, its K/V, kept queries
// and logits) are the bits forward_step gives it alone, whatever shares the batch: every kernel
// is row-independent. ws: null allocates the buffers for this call.
void forward_batch(Path path, const StepModel& model, const StepBatch& batch, int threads,
                   StepWorkspace* ws = nullptr);

}  // namespace spx
