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
#include "kv_q8.h"
#include "family.h"
#include "rope.h"
#include "team_barrier.h"

namespace spx {

namespace {

int thread_num() {
#if defined(_OPENMP)
  return omp_get_thread_num();
#else
  return 0;
#endif
}

int team_size() {
#if defined(_OPENMP)
  return omp_get_num_threads();
#else
  return 1;
#endif
}

// The region's threads and the barrier that ends each phase: every work-sharing loop here is
// `nowait` and ends in sync() instead of libgomp's implicit barrier (team_barrier.h says why).
struct Team {
  TeamBarrier& barrier;
  int size;
  void sync() const { barrier.wait(size); }
};

template <class V>
void grow(V& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

template <class F>
bool has_format(const StepLinear& w, F is) {
  return std::any_of(w.segs.begin(), w.segs.end(), [&](const Segment& s) { return is(s.fmt); });
}

// Whether any product of the step has a segment of a format `is` names (float formats: its rows then
// keep pre(x) in float32; BF16D: in bfloat16 too).
template <class F>
bool has_format(const StepModel& md, const StepBatch& bt, F is) {
  const bool head = bt.head != nullptr && has_format(bt.head->w, is);
  return head || std::any_of(md.layers.begin(), md.layers.end(), [&](const StepLayer& l) {
           const StepExperts& e = l.moe;
           const bool experts = e.count > 0 && (has_format(e.router, is) || is(e.gate.fmt) || is(e.up.fmt) ||
                                                is(e.down.fmt) || has_format(e.shared_gate_up, is) ||
                                                has_format(e.shared_down, is));
           return has_format(l.qkv, is) || has_format(l.o, is) || has_format(l.gate_up, is) ||
                  has_format(l.down, is) || experts;
         });
}

// The MLP's inner width: the dense layer's, or an expert's.
int64_t inner_width(const StepLayer& l) { return l.moe.count > 0 ? l.moe.ff : l.down.segs[0].k; }

// One used expert's product over its slots' rows (the Linear points into it: kept where it stays).
struct ExpertProduct {
  Segment segs[2];
  int64_t first_panel[3];
  Linear lin;
  LinearWork work;
};

// The step's buffers in a workspace, sized for T rows (nothing is allocated in the parallel
// region but attention's per-item scratch, as in the Python-driven step).
struct Buffers {
  StepWorkspace& w;
  float* acc_base = nullptr;
  int64_t acc_stride = 0, pre_stride = 0, gm = 0;
  bool keep_group_rows = false;
  bool floats = false;
  bool bf16d = false;  // BF16D's bfloat16 rows kept (Rows::xb)
  int64_t slot_count = 0;  // the experts' slots (t * used): the stride of their bfloat16 rows
  bool k256 = false;  // the per-256 activations kept (set_k256), for the products of widths a multiple of 256

  Buffers(Path path, StepWorkspace& ws, const StepModel& md, const StepBatch& bt, int64_t t, int threads)
      : w(ws) {
    // Every attention layer has the same shape, every convolution layer too (LFM2); the MLP may differ (dense
    // layers among expert ones: ERNIE 4.5).
    const int64_t hd = md.heads * md.head_dim;
    int64_t kmax = std::max(md.hidden, hd), gate_up = 0, qkv = 0;
    const StepLayer* expert_layer = nullptr;
    for (const StepLayer& x : md.layers) {
      kmax = std::max({kmax, inner_width(x), x.moe.shared_ff});
      gate_up = std::max(gate_up, x.gate_up.n);
      qkv = std::max(qkv, x.qkv.n);
      if (x.moe.count > 0 && expert_layer == nullptr) expert_layer = &x;
    }
    grow(w.x2, t * md.hidden);
    grow(w.qkv, t * qkv);
    grow(w.q, t * hd);
    grow(w.att, t * hd);
    grow(w.att_rows, t * std::max(hd, md.hidden));  // a convolution's output rows too
    grow(w.gu, t * gate_up);
    grow(w.hx, bt.n_logits * md.hidden);
    pre_stride = kmax;
    grow(w.pre, static_cast<size_t>(threads) * kmax);
    grow(w.q8, t * kmax);
    gm = std::max<int64_t>(t, bt.n_logits);
    keep_group_rows = wants_group_rows(path, gm);
    if (keep_group_rows) grow(w.q8g, gm * kmax);
    grow(w.d8, t * kmax / 32);
    grow(w.xs, t * kmax / 32);
    grow(w.s16, t * kmax / 16);
    grow(w.s32, t * kmax / 32);
    k256 = k256_enabled();
    if (k256) {
      grow(w.kq8, t * kmax);
      grow(w.kd, t * kmax / 256);
      grow(w.ks16, t * kmax / 16);
      grow(w.ks32, t * kmax / 32);
    }
    floats = has_format(md, bt, float_format);
    if (floats) grow(w.xf, std::max<int64_t>(t, bt.n_logits) * kmax);
    bf16d = has_format(md, bt, bf16_dot_format);
    if (bf16d) grow(w.xb, std::max<int64_t>(t, bt.n_logits) * kmax / 2);
    if (expert_layer != nullptr) experts(expert_layer->moe, t, md.hidden);
    // Each thread's accumulators 64-byte aligned, on their own 4 KB page (as torch_ops.cpp's run_linear).
    constexpr int64_t kPage = 1024;
    acc_stride = kRowBlock * kPanel + kPage + 16;
    grow(w.acc, static_cast<size_t>(threads) * acc_stride + kPage);
    acc_base = w.acc.data() + ((kPage - (reinterpret_cast<uintptr_t>(w.acc.data()) / 4) % kPage) % kPage);
  }
  Rows act(int64_t k) {
    Rows r{w.q8.data(), w.d8.data(), w.s16.data(), w.s32.data(), w.xs.data(), k, floats ? w.xf.data() : nullptr,
           keep_group_rows ? w.q8g.data() : nullptr, gm};
    if (bf16d) {
      r.xb = w.xb.data();
      r.xbm = gm;
    }
    if (k256 && k % 256 == 0) {
      r.kq8 = w.kq8.data();
      r.kd = w.kd.data();
      r.ks16 = w.ks16.data();
      r.ks32 = w.ks32.data();
    }
    return r;
  }
  // The expert layers' buffers (every expert layer has the same experts' shape).
  std::vector<ExpertProduct> gate_up, down;  // reserved here: filled in the region without allocating
  std::vector<int64_t> gate_up_base, down_base;
  void experts(const StepExperts& e, int64_t t, int64_t hidden) {
    const int64_t slots = t * e.used, ke = std::max(hidden, e.ff);
    slot_count = slots;
    grow(w.logits, t * e.router.n);
    grow(w.weights, slots);
    grow(w.experts, slots);
    grow(w.route_scratch, 2 * e.count);
    grow(w.route_index, e.count);
    grow(w.start, e.count + 1);
    grow(w.order, slots);
    grow(w.where, slots);
    grow(w.xg, slots * hidden);
    grow(w.egu, slots * 2 * e.ff);
    grow(w.ey, slots * hidden);
    grow(w.esum, t * hidden);
    if (e.shared_ff > 0) {
      grow(w.sgu, t * 2 * e.shared_ff);
      grow(w.sy, t * hidden);
    }
    grow(w.eq8, slots * ke);
    grow(w.ed8, slots * ke / 32);
    grow(w.exs, slots * ke / 32);
    grow(w.es16, slots * ke / 16);
    grow(w.es32, slots * ke / 32);
    if (floats) grow(w.exf, slots * ke);
    if (bf16d) grow(w.exb, slots * ke / 2);
    if (k256) {
      grow(w.ekq8, slots * ke);
      grow(w.ekd, slots * ke / 256);
      grow(w.eks16, slots * ke / 16);
      grow(w.eks32, slots * ke / 32);
    }
    gate_up.reserve(e.count);
    down.reserve(e.count);
    gate_up_base.reserve(e.count + 1);
    down_base.reserve(e.count + 1);
  }
  // The slots' quantized rows of width k (row s at s * k, as quantize_rows writes them), from slot s0.
  Rows slot_rows(int64_t k, int64_t s0) {
    Rows r{w.eq8.data() + s0 * k, w.ed8.data() + s0 * k / 32, w.es16.data() + s0 * k / 16, w.es32.data() + s0 * k / 32,
           w.exs.data() + s0 * k / 32, k, floats ? w.exf.data() + s0 * k : nullptr};
    if (bf16d) {
      r.xb = w.exb.data() + s0;
      r.xbm = slot_count;
    }
    if (k256 && k % 256 == 0) {
      r.kq8 = w.ekq8.data() + s0 * k;
      r.kd = w.ekd.data() + s0 * k / 256;
      r.ks16 = w.eks16.data() + s0 * k / 16;
      r.ks32 = w.eks32.data() + s0 * k / 32;
    }
    return r;
  }
  float* scratch(int tid) { return w.pre.data() + static_cast<size_t>(tid) * pre_stride; }
  float* accumulators(int tid) { return acc_base + tid * acc_stride + 16 * tid; }
};

// pre(x) of every row quantized into `a`, rows split over the team.
void quantize_phase(const Team& team, Path path, const float* x, int64_t ldx, const PreOp& op, const Rows& a,
                    int64_t t, float* scratch) {
#pragma omp for schedule(static) nowait
  for (int64_t r = 0; r < t; ++r) quantize_rows(path, x, ldx, op, a, r, r + 1, scratch);
  team.sync();
}

// y [t, w.n] = a . W (+ bias) (+ residual): plan_linear's units from a shared counter.
void linear_phase(const Team& team, Path path, const StepLinear& w, const Rows& a, int64_t t, float* y,
                  const float* residual, int threads, float* acc) {
  const Linear lin{w.segs.data(), w.first_panel.data(), static_cast<int64_t>(w.segs.size()), a, t, y, w.n, w.bias,
                   residual};
  const LinearWork work = plan_linear(path, lin, w.panels(), threads);
#pragma omp for schedule(dynamic, 1) nowait
  for (int64_t u = 0; u < work.units(); ++u) linear_unit(path, lin, work, u, acc);
  team.sync();
}

// A sequence's cache row in 16-bit units: head_dim bfloat16 values, or a q8 row (kv_q8.h).
int64_t seq_row_units(const StepModel& md, const StepSeq& r) {
  return r.q8 ? q8_row_units(md.head_dim) : md.head_dim;
}

// What every layer does per sequence, set up before the parallel region: the sequence's first
// row, its RoPE (cache pointers set per layer) and its attention problem and items.
struct SeqPlan {
  int64_t row0;
  Rope rope;
  Attention pb;
  AttentionPlan plan;  // run once a layer: its split states are reused (each run ends in a barrier)
  Attention pbw;  // the windowed layers' (StepSeq::wfirst, wmask; k and v set per layer from wfirst)
  std::vector<int64_t> wends;  // pbw.ends: each token's number (its place in its full list: its slot)
  AttentionPlan wplan;
  Rope wrope;  // the windowed layers' cache writes (their own caches, slot 0 at StepSeq::woffset)
};

// Every sequence's attention items in one list, the most work first, so threads taking them in
// order finish together (which thread computes an item never changes a bit).
struct ItemRef {
  int64_t seq, item, cost;
};

struct BatchPlan {
  std::vector<SeqPlan> seqs;
  std::vector<int64_t> seq_of_row;  // [T]
  std::vector<ItemRef> items;
  std::vector<ItemRef> witems;  // the windowed layers' items
  int64_t t = 0;
};

// A sequence's attention over its window: keys [wfirst, end) under wmask (a windowed layer's).
void window_plan(const StepModel& md, const StepSeq& r, int64_t s, SeqPlan& sp, BatchPlan& bp, int threads) {
  if (r.wmask == nullptr || std::none_of(md.layers.begin(), md.layers.end(), [](const StepLayer& l) {
        return l.windowed;
      }))
    return;
  const int64_t unit = seq_row_units(md, r);
  sp.pbw = sp.pb;
  sp.pbw.s = r.start + r.t - r.wfirst;
  sp.pbw.m = sp.pbw.s;
  sp.pbw.mask = r.wmask;
  // A window's keys keep the numbers the full list gives them (attention.h): key index 0 is slot
  // wfirst, and a token's own key is the last of its full list, whose length the full mask gives.
  sp.wends.resize(r.t);
  for (int64_t i = 0; i < r.t; ++i) sp.wends[i] = visible_keys(sp.pb, i) - 1;
  sp.pbw.ends = sp.wends.data();
  sp.pbw.lead = r.wfirst;
  sp.pbw.k_head_stride = r.wcapacity * unit;
  sp.pbw.v_head_stride = r.wcapacity * unit;
  sp.wplan = plan_attention(sp.pbw, threads);
  for (size_t i = 0; i < sp.wplan.items.size(); ++i)
    bp.witems.push_back({s, static_cast<int64_t>(i), item_cost(sp.pbw, sp.wplan.items[i])});
}

// Rows of x2 [t, hidden] become x + scale * post_norm(x2) (residual_row; out may be x2 or x).
void post_phase(const Team& team, const StepModel& md, const float* x, const float* y, const float* norm,
                float* out, int64_t t) {
  const int64_t h = md.hidden;
#pragma omp for schedule(static) nowait
  for (int64_t r = 0; r < t; ++r) residual_row(x + r * h, y + r * h, h, norm, md.eps, md.residual_scale, out + r * h);
  team.sync();
}

// The first attention layer (the rope's qkv rows are its width), or the first layer where none attends.
const StepLayer& attention_layer(const StepModel& md) {
  const auto it = std::find_if(md.layers.begin(), md.layers.end(), [](const StepLayer& l) { return l.conv == nullptr; });
  return it != md.layers.end() ? *it : md.layers[0];
}

// LFM2's convolution of every row (family.h): each row's B * x into its slot of its sequence's state, then, once
// all are stored (a tree row reads its parent's), the convolution of each row quantized as the output
// projection's input (a: rows of the hidden width).
void conv_phases(const Team& team, Path path, const StepModel& md, const StepLayer& l, const StepBatch& bt,
                 const BatchPlan& bp, Buffers& b, const Rows& a, float* scratch) {
  const int64_t h = md.hidden, k = l.conv_kernel, n = l.qkv.n;
  const float* qkv = b.w.qkv.data();
#pragma omp for schedule(static) nowait
  for (int64_t row = 0; row < bp.t; ++row) {
    const SeqPlan& sp = bp.seqs[bp.seq_of_row[row]];
    const StepSeq& r = bt.seqs[bp.seq_of_row[row]];
    float* state = r.conv_state + l.kv_index * r.conv_capacity * h;
    conv_input_row(qkv + row * n, h, state + r.taps[(row - sp.row0) * k + k - 1] * h);
  }
  team.sync();
  float* out = b.w.att_rows.data();
#pragma omp for schedule(static) nowait
  for (int64_t row = 0; row < bp.t; ++row) {
    const SeqPlan& sp = bp.seqs[bp.seq_of_row[row]];
    const StepSeq& r = bt.seqs[bp.seq_of_row[row]];
    const float* state = r.conv_state + l.kv_index * r.conv_capacity * h;
    const float* taps[kMaxConvKernel];
    for (int64_t j = 0; j < k; ++j) {
      const int64_t slot = r.taps[(row - sp.row0) * k + j];
      taps[j] = slot >= 0 ? state + slot * h : nullptr;
    }
    conv_row(qkv + row * n, h, taps, l.conv, k, out + row * h);
    quantize_rows(path, out, h, PreOp{}, a, row, row + 1, scratch);
  }
  team.sync();
}

// Whether a sublayer's output goes through post_phase rather than the product's residual epilogue.
bool posts(const StepModel& md, const float* norm) { return norm != nullptr || md.residual_scale != 1.f; }

BatchPlan batch_plan(const StepModel& md, const StepBatch& bt, Buffers& b, int threads) {
  BatchPlan bp;
  const int64_t d = md.head_dim, hd = md.heads * d;
  for (int64_t s = 0; s < bt.nseqs; ++s) bp.t += bt.seqs[s].t;
  bp.seq_of_row.resize(bp.t);
  bp.seqs.resize(bt.nseqs);
  int64_t row0 = 0;
  for (int64_t s = 0; s < bt.nseqs; ++s) {
    const StepSeq& r = bt.seqs[s];
    SeqPlan& sp = bp.seqs[s];
    sp.row0 = row0;
    std::fill(bp.seq_of_row.begin() + row0, bp.seq_of_row.begin() + row0 + r.t, s);
    const StepLayer& l0 = attention_layer(md);
    const int64_t unit = seq_row_units(md, r);
    sp.rope = Rope{b.w.qkv.data() + row0 * l0.qkv.n, bt.cos + row0 * d, bt.sin + row0 * d, nullptr, nullptr, md.eps,
                   r.t, md.heads, md.kv_heads, d, r.start, b.w.q.data() + row0 * hd, nullptr, nullptr,
                   r.capacity * unit, r.capacity * unit};
    sp.rope.q8 = r.q8;
    sp.wrope = sp.rope;
    sp.wrope.start = r.start - r.woffset;
    sp.wrope.k_head_stride = r.wcapacity * unit;
    sp.wrope.v_head_stride = r.wcapacity * unit;
    Attention& pb = sp.pb;
    pb.heads = md.heads;
    pb.kv_heads = md.kv_heads;
    pb.t = r.t;
    pb.d = d;
    pb.s = r.start + r.t;
    pb.m = r.mask != nullptr ? r.m : r.t;
    pb.mask = r.mask;
    pb.q = b.w.q.data() + row0 * hd;
    pb.out = b.w.att.data() + row0 * hd;
    pb.k_head_stride = r.capacity * unit;
    pb.v_head_stride = r.capacity * unit;
    pb.q8 = r.q8;
    pb.scale = md.attn_scale > 0.f ? md.attn_scale : 1.f / std::sqrt(static_cast<float>(d));
    pb.softcap = md.attn_softcap;
    sp.plan = plan_attention(pb, threads);
    for (size_t i = 0; i < sp.plan.items.size(); ++i)
      bp.items.push_back({s, static_cast<int64_t>(i), item_cost(pb, sp.plan.items[i])});
    window_plan(md, r, s, sp, bp, threads);
    row0 += r.t;
  }
  for (auto* list : {&bp.items, &bp.witems})
    std::stable_sort(list->begin(), list->end(), [](const ItemRef& a, const ItemRef& c) { return a.cost > c.cost; });
  return bp;
}

// Rows of each sequence's attention output [heads, t, d] as the o-projection's input rows
// [T, heads * d], quantized (rows split over the team).
void gather_quantize_phase(const Team& team, Path path, const StepModel& md, const BatchPlan& bp, const float* att,
                           float* att_rows, const Rows& a, float* scratch) {
  const int64_t d = md.head_dim, width = md.heads * d;
#pragma omp for schedule(static) nowait
  for (int64_t r = 0; r < bp.t; ++r) {
    const float* src = att;
    if (bp.t > 1) {
      const SeqPlan& sp = bp.seqs[bp.seq_of_row[r]];
      const int64_t t = sp.pb.t, row = r - sp.row0;
      const float* seq_att = att + sp.row0 * width;
      for (int64_t h = 0; h < md.heads; ++h)
        std::memcpy(att_rows + r * width + h * d, seq_att + (h * t + row) * d, d * sizeof(float));
      src = att_rows;
    }
    quantize_rows(path, src, width, PreOp{}, a, r, r + 1, scratch);
  }
  team.sync();
}

// The units of several products from one counter (each thread takes its units in increasing order).
void products_phase(const Team& team, Path path, const std::vector<ExpertProduct>& ps, const std::vector<int64_t>& base,
                    float* acc) {
  const int64_t total = base.back();
#pragma omp for schedule(dynamic, 1) nowait
  for (int64_t u = 0; u < total; ++u) {
    const size_t i = static_cast<size_t>(std::upper_bound(base.begin(), base.end(), u) - base.begin()) - 1;
    linear_unit(path, ps[i].lin, ps[i].work, u - base[i], acc);
  }
  team.sync();
}

// Each row's logits (the router's three parts summed in experts.py's order, and its bias) and experts;
// the (row, rank) slots grouped by expert (stably, as experts_rows groups them); and every used
// expert's two products over its slots' rows. One thread: the others wait at the barrier after it.
void route_and_plan(Path path, const StepModel& md, const StepExperts& e, int64_t t, Buffers& b, int threads) {
  StepWorkspace& w = b.w;
  const int64_t n = e.count, used = e.used, slots = t * used, m = e.router.n / 3;  // m: n, or n + the shared gate
  for (int64_t r = 0; r < t; ++r) {
    float* lg = w.logits.data() + r * e.router.n;  // part 0's columns become the logits, in place
    for (int64_t i = 0; i < m; ++i) {
      float v = (lg[i] + lg[m + i]) + lg[2 * m + i];
      if (e.router_bias != nullptr && i < n) v = v + e.router_bias[i];
      lg[i] = v;
    }
    route_row(lg, n, used, e.kind, e.select_bias, w.experts.data() + r * used, w.weights.data() + r * used,
              w.route_scratch.data(), w.route_index.data());
  }
  int64_t* start = w.start.data();
  std::fill(start, start + n + 1, int64_t{0});
  for (int64_t s = 0; s < slots; ++s) ++start[w.experts[s] + 1];
  for (int64_t x = 0; x < n; ++x) start[x + 1] += start[x];
  int64_t* fill = w.route_index.data();
  std::copy(start, start + n, fill);
  for (int64_t s = 0; s < slots; ++s) w.order[fill[w.experts[s]]++] = s;
  for (int64_t s = 0; s < slots; ++s) w.where[w.order[s]] = s;
  b.gate_up.clear();
  b.down.clear();
  b.gate_up_base.assign(1, 0);
  b.down_base.assign(1, 0);
  const int64_t h = md.hidden, ff = e.ff;
  for (int64_t x = 0; x < n; ++x) {
    const int64_t c = start[x + 1] - start[x];
    if (c == 0) continue;
    ExpertProduct& g = b.gate_up.emplace_back();
    g.segs[0] = StepExperts::slice(e.gate, n, x);
    g.segs[1] = StepExperts::slice(e.up, n, x);
    g.first_panel[0] = 0;
    g.first_panel[1] = g.segs[0].panels();
    g.first_panel[2] = g.first_panel[1] + g.segs[1].panels();
    // One row (a decode step): every expert reads the MLP input the router read, quantized once.
    const Rows in = t == 1 ? b.act(h) : b.slot_rows(h, start[x]);
    g.lin = Linear{g.segs, g.first_panel, 2, in, c, w.egu.data() + start[x] * 2 * ff, 2 * ff,
                   e.gate_up_bias != nullptr ? e.gate_up_bias + x * 2 * ff : nullptr, nullptr};
    g.work = plan_linear(path, g.lin, g.first_panel[2], threads);
    b.gate_up_base.push_back(b.gate_up_base.back() + g.work.units());
    ExpertProduct& d = b.down.emplace_back();
    d.segs[0] = StepExperts::slice(e.down, n, x);
    d.first_panel[0] = 0;
    d.first_panel[1] = d.first_panel[2] = d.segs[0].panels();
    d.lin = Linear{d.segs, d.first_panel, 1, b.slot_rows(ff, start[x]), c, w.ey.data() + start[x] * h, h,
                   e.down_bias != nullptr ? e.down_bias + x * h : nullptr, nullptr};
    d.work = plan_linear(path, d.lin, d.first_panel[1], threads);
    b.down_base.push_back(b.down_base.back() + d.work.units());
  }
}

// The layer's experts on the rows of x2 (norm: the MLP's pre-norm, as the router's input was
// quantized with): the router, then each slot's row quantized on its own (pre-norm), the experts'
// gate/up products, their activation quantized per slot (SiLU fused into the quantization, or the
// clamped SwiGLU's row operation first), the down products, and each row's sum in its rank order
// (plus the shared expert's, over the router's input, under its gate) added to x2 into x (through
// the post-norm and residual multiplier, if any).
void experts_phases(const Team& team, Path path, const StepModel& md, const StepLayer& l, int64_t t, float* x,
                    Buffers& b, int threads, const PreOp& norm, float* acc, float* scratch) {
  const StepExperts& e = l.moe;
  StepWorkspace& w = b.w;
  const int64_t h = md.hidden, used = e.used, slots = t * used;
  linear_phase(team, path, e.router, b.act(h), t, w.logits.data(), nullptr, threads, acc);
  if (thread_num() == 0) route_and_plan(path, md, e, t, b, threads);
  team.sync();
  if (e.shared_ff > 0)  // the router's input, before anything else is quantized into the act buffers
    linear_phase(team, path, e.shared_gate_up, b.act(h), t, w.sgu.data(), nullptr, threads, acc);
  if (t > 1) {  // each slot its row's codes, as experts_rows quantizes an expert's rows (one row: the router's)
    const Rows xin = b.slot_rows(h, 0);
#pragma omp for schedule(static) nowait
    for (int64_t s = 0; s < slots; ++s) {
      std::memcpy(w.xg.data() + s * h, w.x2.data() + (w.order[s] / used) * h, h * sizeof(float));
      quantize_rows(path, w.xg.data(), h, norm, xin, s, s + 1, scratch);
    }
    team.sync();
  }
  products_phase(team, path, b.gate_up, b.gate_up_base, acc);
  PreOp act;
  act.silu_mul = e.act == ExpertAct::Silu;
  const Rows gin = b.slot_rows(e.ff, 0);
#pragma omp for schedule(static) nowait
  for (int64_t s = 0; s < slots; ++s) {
    float* gu = w.egu.data() + s * 2 * e.ff;
    if (e.act == ExpertAct::SwigluOai) swiglu_oai_row(gu, e.ff, gu);  // the first ff values, then quantized
    quantize_rows(path, w.egu.data(), 2 * e.ff, act, gin, s, s + 1, scratch);
  }
  team.sync();
  products_phase(team, path, b.down, b.down_base, acc);
  if (e.shared_ff > 0) {  // as a dense SiLU MLP: the activation fused into the down product's quantization
    PreOp silu;
    silu.silu_mul = true;
    quantize_phase(team, path, w.sgu.data(), 2 * e.shared_ff, silu, b.act(e.shared_ff), t, scratch);
    linear_phase(team, path, e.shared_down, b.act(e.shared_ff), t, w.sy.data(), nullptr, threads, acc);
  }
#pragma omp for schedule(static) nowait
  for (int64_t r = 0; r < t; ++r) {
    const float* ys[kMaxExpertsUsed];
    for (int64_t j = 0; j < used; ++j) ys[j] = w.ey.data() + w.where[r * used + j] * h;
    float* sum = w.esum.data() + r * h;
    weighted_sum_row(ys, w.weights.data() + r * used, used, h, sum);
    if (e.shared_ff > 0 && e.shared_gated) {
      shared_expert_add_row(sum, w.logits[r * e.router.n + e.count], w.sy.data() + r * h, h);
    } else if (e.shared_ff > 0) {
      shared_expert_add_row(sum, w.sy.data() + r * h, h);
    }
    residual_row(w.x2.data() + r * h, sum, h, l.mlp_out_norm, md.eps, md.residual_scale, x + r * h);
  }
  team.sync();
}

// A layer's RoPE and cache writes (after its q/k norms), per row of each sequence.
void rope_phase(const Team& team, const StepModel& md, const StepLayer& l, const StepBatch& bt, const BatchPlan& bp,
                Buffers& b) {
  const int64_t t = bp.t, d = md.head_dim;
#pragma omp for schedule(static) nowait
  for (int64_t row = 0; row < t; ++row) {
    const int64_t s = bp.seq_of_row[row];
    const StepSeq& r = bt.seqs[s];
    const bool own = l.windowed && r.wk != nullptr;  // the layer writes to the windowed layers' caches
    const int64_t layer_stride = md.kv_heads * (own ? r.wcapacity : r.capacity) * seq_row_units(md, r);
    const int64_t tok = row - bp.seqs[s].row0;
    Rope rope = own ? bp.seqs[s].wrope : bp.seqs[s].rope;
    // this layer's rope, this sequence's rows
    const int64_t table = (l.rope_kind * t + bp.seqs[s].row0) * md.rope_width();
    rope.cos = bt.cos + table;
    rope.sin = bt.sin + table;
    rope.rot = md.rot;
    if (l.q_full_norm != nullptr) {  // OLMo 2: one norm over the row's queries, one over its keys
      float* h = b.w.qkv.data() + row * l.qkv.n;
      rms_row(h, md.heads * d, l.q_full_norm, md.eps, h);
      rms_row(h + md.heads * d, md.kv_heads * d, l.k_full_norm, md.eps, h + md.heads * d);
    }
    rope.q_norm = l.q_norm;
    rope.k_norm = l.k_norm;
    rope.k_offset = l.k_offset;
    rope.k = (own ? r.wk : r.k) + l.kv_index * layer_stride;
    rope.v = (own ? r.wv : r.v) + l.kv_index * layer_stride;
    rope_tokens(rope, tok, tok + 1);
  }
  team.sync();
}

// A layer's attention after RoPE and the cache writes: kept queries, each sequence's attention items, and the
// rows of its output quantized as the output projection's input.
void attend_phases(const Team& team, Path path, const StepModel& md, const StepLayer& l, int64_t li,
                   const StepBatch& bt, const BatchPlan& bp, Buffers& b, float* scratch) {
  const int64_t d = md.head_dim;
  // Attention only reads q, so the copies need no barrier of their own.
#pragma omp for schedule(static) nowait
  for (int64_t s = 0; s < bt.nseqs; ++s) {
    const StepSeq& r = bt.seqs[s];
    if (r.keep_q != nullptr && r.keep_q[li] != nullptr)
      std::memcpy(r.keep_q[li], bp.seqs[s].pb.q, sizeof(float) * static_cast<size_t>(r.t * md.heads * d));
  }
  const bool win = l.windowed && !bp.witems.empty();
  const std::vector<ItemRef>& list = win ? bp.witems : bp.items;
  const int64_t items = static_cast<int64_t>(list.size());
#pragma omp for schedule(dynamic, 1) nowait
  for (int64_t i = 0; i < items; ++i) {
    const ItemRef& ref = list[i];
    const StepSeq& r = bt.seqs[ref.seq];
    const SeqPlan& sp = bp.seqs[ref.seq];
    const int64_t unit = seq_row_units(md, r);
    const bool own = l.windowed && r.wk != nullptr;
    const int64_t layer_stride = md.kv_heads * (own ? r.wcapacity : r.capacity) * unit;
    const int64_t first = win ? (r.wfirst - (own ? r.woffset : 0)) * unit : 0;
    Attention pb = win ? sp.pbw : sp.pb;
    pb.sinks = l.sinks;
    pb.k = (own ? r.wk : r.k) + l.kv_index * layer_stride + first;
    pb.v = (own ? r.wv : r.v) + l.kv_index * layer_stride + first;
    attend_item(path, pb, win ? sp.wplan : sp.plan, ref.item);
  }
  team.sync();
  gather_quantize_phase(team, path, md, bp, b.w.att.data(), b.w.att_rows.data(), b.act(md.heads * d), scratch);
}

// The layer's MLP (or experts) on x2, the residual stream after its mixer; x gets the layer's output.
void mlp_phases(const Team& team, Path path, const StepModel& md, const StepLayer& l, const StepBatch& bt,
                const BatchPlan& bp, Buffers& b, int threads, float* acc, float* scratch) {
  const int64_t t = bp.t;
  PreOp norm;
  norm.norm = md.parallel ? l.attn_norm : l.mlp_norm;
  norm.eps = md.eps;
  norm.center = md.layer_norm;
  // a parallel block's MLP reads the layer's input, which the attention's product left in x (its sum went to x2)
  quantize_phase(team, path, md.parallel ? bt.x : b.w.x2.data(), md.hidden, norm, b.act(md.hidden), t, scratch);
  if (l.moe.count > 0) {
    experts_phases(team, path, md, l, t, bt.x, b, threads, norm, acc, scratch);
    return;
  }
  linear_phase(team, path, l.gate_up, b.act(md.hidden), t, b.w.gu.data(), nullptr, threads, acc);
  PreOp act;
  act.silu_mul = !l.gelu;
  const int64_t inter = l.gate_up.n / 2;
  if (l.gelu) {  // GeGLU into the gate half of each row, then quantized as it is
#pragma omp for schedule(static) nowait
    for (int64_t r = 0; r < t; ++r) gelu_mul_row(b.w.gu.data() + r * 2 * inter, inter, b.w.gu.data() + r * 2 * inter);
    team.sync();
  }
  quantize_phase(team, path, b.w.gu.data(), 2 * inter, act, b.act(inter), t, scratch);
  const bool post_mlp = posts(md, l.mlp_out_norm);
  linear_phase(team, path, l.down, b.act(inter), t, bt.x, post_mlp ? nullptr : b.w.x2.data(), threads, acc);
  if (post_mlp) post_phase(team, md, b.w.x2.data(), bt.x, l.mlp_out_norm, bt.x, t);
}

// One layer, run by every thread of the team; x holds the layer's input and gets its output.
void layer_phases(const Team& team, Path path, const StepModel& md, const StepLayer& l, int64_t li,
                  const StepBatch& bt, const BatchPlan& bp, Buffers& b, int threads) {
  const int tid = thread_num();
  float* scratch = b.scratch(tid);
  float* acc = b.accumulators(tid);
  const int64_t t = bp.t;
  PreOp norm;
  norm.norm = l.attn_norm;
  norm.eps = md.eps;
  norm.center = md.layer_norm;
  quantize_phase(team, path, bt.x, md.hidden, norm, b.act(md.hidden), t, scratch);
  linear_phase(team, path, l.qkv, b.act(md.hidden), t, b.w.qkv.data(), nullptr, threads, acc);
  const bool conv = l.conv != nullptr;
  if (conv) {
    conv_phases(team, path, md, l, bt, bp, b, b.act(md.hidden), scratch);
  } else {
    rope_phase(team, md, l, bt, bp, b);
    attend_phases(team, path, md, l, li, bt, bp, b, scratch);
  }
  const bool post_attn = posts(md, l.attn_out_norm);
  const int64_t in = conv ? md.hidden : md.heads * md.head_dim;
  linear_phase(team, path, l.o, b.act(in), t, b.w.x2.data(), post_attn ? nullptr : bt.x, threads, acc);
  if (post_attn) post_phase(team, md, bt.x, b.w.x2.data(), l.attn_out_norm, b.w.x2.data(), t);
  mlp_phases(team, path, md, l, bt, bp, b, threads, acc, scratch);
}

// The picked rows through the final norm and the head (the team's last phases).
void head_phases(const Team& team, Path path, const StepModel& md, const StepBatch& bt, Buffers& b, int threads) {
  const int tid = thread_num();
  const int64_t n = bt.n_logits, h = md.hidden;
#pragma omp for schedule(static) nowait
  for (int64_t i = 0; i < n; ++i) std::memcpy(b.w.hx.data() + i * h, bt.x + bt.logit_rows[i] * h, h * sizeof(float));
  team.sync();
  PreOp norm;
  norm.norm = bt.head->norm;
  norm.eps = bt.head->eps;
  norm.center = md.layer_norm;
  quantize_phase(team, path, b.w.hx.data(), h, norm, b.act(h), n, b.scratch(tid));
  linear_phase(team, path, bt.head->w, b.act(h), n, bt.logits, nullptr, threads, b.accumulators(tid));
}

}  // namespace

void forward_batch(Path path, const StepModel& md, const StepBatch& bt, int threads, StepWorkspace* ws) {
  int64_t t = 0;
  for (int64_t s = 0; s < bt.nseqs; ++s) t += bt.seqs[s].t;
  if (md.layers.empty() || t <= 0) return;
  threads = std::max(1, threads);
  StepWorkspace local;
  Buffers b(path, ws != nullptr ? *ws : local, md, bt, t, threads);
  const BatchPlan bp = batch_plan(md, bt, b, threads);
  const bool head = bt.head != nullptr && bt.n_logits > 0;
  TeamBarrier barrier;
#pragma omp parallel num_threads(threads)
  {
    const Team team{barrier, team_size()};
    for (size_t li = 0; li < md.layers.size(); ++li)
      layer_phases(team, path, md, md.layers[li], static_cast<int64_t>(li), bt, bp, b, threads);
    if (head) head_phases(team, path, md, bt, b, threads);
  }
}

void forward_step(Path path, const StepModel& md, const StepRows& r, int threads) {
  const StepSeq seq{r.t, r.k, r.v, r.capacity, r.start, r.mask, r.m, r.keep_q};
  StepBatch bt{r.x, r.cos, r.sin, &seq, 1};
  forward_batch(path, md, bt, threads);
}

}  // namespace spx
