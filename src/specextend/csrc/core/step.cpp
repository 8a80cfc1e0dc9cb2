// The whole-model forward of a few rows in one parallel region (step.h).
#include "step.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "attention.h"
#include "rope.h"

namespace spx {

namespace {

int thread_num() {
#if defined(_OPENMP)
  return omp_get_thread_num();
#else
  return 0;
#endif
}

// The whole step's buffers, allocated before the parallel region (nothing is allocated in it
// but attention's per-item scratch, as in the Python-driven step).
struct Buffers {
  std::vector<float> x2, qkv, q, att, att_rows, gu, pre, acc;
  std::vector<int8_t> q8;
  std::vector<float> d8, xs;
  std::vector<int32_t> s16, s32;
  float* acc_base = nullptr;
  int64_t acc_stride = 0;

  Buffers(const StepModel& md, const StepRows& r, int threads) {
    const StepLayer& l = md.layers[0];
    const int64_t t = r.t, hd = md.heads * md.head_dim, inter = l.down.segs[0].k;
    const int64_t kmax = std::max({md.hidden, hd, inter});
    x2.resize(t * md.hidden);
    qkv.resize(t * l.qkv.n);
    q.resize(t * hd);
    att.resize(t * hd);
    att_rows.resize(t * hd);
    gu.resize(t * l.gate_up.n);
    pre_stride = kmax;
    pre.resize(static_cast<size_t>(threads) * kmax);
    q8.resize(t * kmax);
    d8.resize(t * kmax / 32);
    xs.resize(t * kmax / 32);
    s16.resize(t * kmax / 16);
    s32.resize(t * kmax / 32);
    // Each thread's accumulators 64-byte aligned, on their own 4 KB page (as torch_ops.cpp's run_linear).
    constexpr int64_t kPage = 1024;
    acc_stride = kRowBlock * kPanel + kPage + 16;
    acc.resize(static_cast<size_t>(threads) * acc_stride + kPage);
    acc_base = acc.data() + ((kPage - (reinterpret_cast<uintptr_t>(acc.data()) / 4) % kPage) % kPage);
  }
  Rows act(int64_t k) { return {q8.data(), d8.data(), s16.data(), s32.data(), xs.data(), k}; }
  float* scratch(int tid) { return pre.data() + static_cast<size_t>(tid) * pre_stride; }
  float* accumulators(int tid) { return acc_base + tid * acc_stride + 16 * tid; }
  int64_t pre_stride = 0;
};

// pre(x) of every row quantized into `a`, rows split over the team (implicit barrier at the end).
void quantize_phase(Path path, const float* x, int64_t ldx, const PreOp& op, const Rows& a, int64_t t, float* scratch) {
#pragma omp for schedule(static)
  for (int64_t r = 0; r < t; ++r) quantize_rows(path, x, ldx, op, a, r, r + 1, scratch);
}

// y [t, w.n] = a . W (+ bias) (+ residual): plan_linear's units from a shared counter.
void linear_phase(Path path, const StepLinear& w, const Rows& a, int64_t t, float* y, const float* residual,
                  int threads, float* acc) {
  const Linear lin{w.segs.data(), w.first_panel.data(), static_cast<int64_t>(w.segs.size()), a, t, y, w.n, w.bias,
                   residual};
  const LinearWork work = plan_linear(lin, w.panels(), threads);
#pragma omp for schedule(dynamic, 1)
  for (int64_t u = 0; u < work.units(); ++u) linear_unit(path, lin, work, u, acc);
}

// Rows of the attention output [heads, t, d] as the o-projection's input rows [t, heads * d],
// quantized (rows split over the team).
void gather_quantize_phase(Path path, const StepModel& md, int64_t t, const float* att, float* att_rows,
                           const Rows& a, float* scratch) {
  const int64_t d = md.head_dim, width = md.heads * d;
#pragma omp for schedule(static)
  for (int64_t r = 0; r < t; ++r) {
    const float* src = att;
    if (t > 1) {
      for (int64_t h = 0; h < md.heads; ++h)
        std::memcpy(att_rows + r * width + h * d, att + (h * t + r) * d, d * sizeof(float));
      src = att_rows;
    }
    quantize_rows(path, src, width, PreOp{}, a, r, r + 1, scratch);
  }
}

struct AttentionPhase {
  Attention pb{};
  std::vector<AttentionItem> items;
};

AttentionPhase attention_setup(const StepModel& md, const StepRows& r, float* q, float* out, int threads) {
  AttentionPhase ap;
  Attention& pb = ap.pb;
  pb.heads = md.heads;
  pb.kv_heads = md.kv_heads;
  pb.t = r.t;
  pb.d = md.head_dim;
  pb.s = r.start + r.t;
  pb.m = r.mask != nullptr ? r.m : r.t;
  pb.mask = r.mask;
  pb.q = q;
  pb.out = out;
  pb.k_head_stride = r.capacity * md.head_dim;
  pb.v_head_stride = r.capacity * md.head_dim;
  pb.scale = 1.f / std::sqrt(static_cast<float>(pb.d));
  ap.items = attention_items(pb, threads);
  return ap;
}

// One layer, run by every thread of the team; x holds the layer's input and gets its output.
void layer_phases(Path path, const StepModel& md, const StepLayer& l, int64_t li, const StepRows& r,
                  const AttentionPhase& ap0, Buffers& b, int threads) {
  const int tid = thread_num();
  float* scratch = b.scratch(tid);
  float* acc = b.accumulators(tid);
  const int64_t t = r.t, d = md.head_dim, layer_stride = md.kv_heads * r.capacity * d;
  PreOp norm;
  norm.norm = l.attn_norm;
  norm.eps = md.eps;
  quantize_phase(path, r.x, md.hidden, norm, b.act(md.hidden), t, scratch);
  linear_phase(path, l.qkv, b.act(md.hidden), t, b.qkv.data(), nullptr, threads, acc);
  const Rope rope{b.qkv.data(), r.cos, r.sin, l.q_norm, l.k_norm, md.eps, t, md.heads, md.kv_heads, d, r.start,
                  b.q.data(), r.k + li * layer_stride, r.v + li * layer_stride, r.capacity * d, r.capacity * d};
#pragma omp for schedule(static)
  for (int64_t tok = 0; tok < t; ++tok) rope_tokens(rope, tok, tok + 1);
  // Every thread sees the same pointer, so the team meets the work-sharing construct together;
  // attention only reads q, so the copy needs no barrier of its own.
  if (r.keep_q != nullptr && r.keep_q[li] != nullptr) {
#pragma omp single nowait
    std::memcpy(r.keep_q[li], b.q.data(), sizeof(float) * static_cast<size_t>(t * md.heads * d));
  }
  Attention pb = ap0.pb;
  pb.k = r.k + li * layer_stride;
  pb.v = r.v + li * layer_stride;
  const int64_t items = static_cast<int64_t>(ap0.items.size());
#pragma omp for schedule(dynamic, 1)
  for (int64_t i = 0; i < items; ++i) attend_items(path, pb, ap0.items.data(), i, i + 1);
  const int64_t hd = md.heads * d;
  gather_quantize_phase(path, md, t, b.att.data(), b.att_rows.data(), b.act(hd), scratch);
  linear_phase(path, l.o, b.act(hd), t, b.x2.data(), r.x, threads, acc);
  norm.norm = l.mlp_norm;
  quantize_phase(path, b.x2.data(), md.hidden, norm, b.act(md.hidden), t, scratch);
  linear_phase(path, l.gate_up, b.act(md.hidden), t, b.gu.data(), nullptr, threads, acc);
  PreOp silu;
  silu.silu_mul = true;
  const int64_t inter = l.gate_up.n / 2;
  quantize_phase(path, b.gu.data(), 2 * inter, silu, b.act(inter), t, scratch);
  linear_phase(path, l.down, b.act(inter), t, r.x, b.x2.data(), threads, acc);
}

}  // namespace

void forward_step(Path path, const StepModel& md, const StepRows& r, int threads) {
  if (md.layers.empty() || r.t <= 0) return;
  threads = std::max(1, threads);
  Buffers b(md, r, threads);
  const AttentionPhase ap = attention_setup(md, r, b.q.data(), b.att.data(), threads);
#pragma omp parallel num_threads(threads)
  {
    for (size_t li = 0; li < md.layers.size(); ++li)
      layer_phases(path, md, md.layers[li], static_cast<int64_t>(li), r, ap, b, threads);
  }
}

}  // namespace spx
