// The PyTorch binding of the whole-step forward (core/step.h): a model's quantized layers
// described once (`StepPlan`, which keeps its tensors alive), then one call per forward. Every
// check runs before the parallel region; the core never throws.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <vector>
#if defined(_OPENMP)
#include <omp.h>
#endif

#include "core/cpu.h"
#include "core/kv_q8.h"
#include "core/rope.h"
#include "core/step.h"

namespace {

struct StepPlan {
  spx::StepModel model;
  std::vector<at::Tensor> keep;  // the weights and norms the model's pointers point into
  spx::StepWorkspace workspace;  // the steps' buffers, reused
  std::mutex busy;
};

const float* kept_float(StepPlan& p, const at::Tensor& t, int64_t numel, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == numel, "step: ", what,
              " must be contiguous float32 of ", numel, " values");
  p.keep.push_back(t);
  return t.data_ptr<float>();
}

// One quantized weight as (blobs, formats, widths, offsets, groups, bias or None), qlinear's arguments.
spx::StepLinear step_linear(StepPlan& p, const py::tuple& w, int64_t k, const char* what) {
  TORCH_CHECK(w.size() == 6, "step: ", what, " must be (blobs, formats, widths, offsets, groups, bias)");
  const auto blobs = w[0].cast<std::vector<at::Tensor>>();
  const auto fmts = w[1].cast<std::vector<int64_t>>(), ns = w[2].cast<std::vector<int64_t>>();
  const auto offsets = w[3].cast<std::vector<int64_t>>(), sbgs = w[4].cast<std::vector<int64_t>>();
  TORCH_CHECK(!blobs.empty() && blobs.size() == fmts.size() && fmts.size() == ns.size() &&
                  ns.size() == offsets.size() && offsets.size() == sbgs.size(),
              "step: ", what, ": one format, width, offset and group count per segment");
  spx::StepLinear lin;
  for (size_t i = 0; i < blobs.size(); ++i) {
    spx::FormatInfo fi{};
    TORCH_CHECK(spx::format_info(fmts[i], sbgs[i], &fi) && k % fi.superblock == 0 && ns[i] > 0, "step: ", what,
                ": bad weight format or width");
    TORCH_CHECK(blobs[i].scalar_type() == at::kByte && blobs[i].is_contiguous(), "step: ", what,
                ": blobs must be contiguous uint8");
    const spx::Segment s{blobs[i].data_ptr<uint8_t>(), fmts[i], ns[i], k, offsets[i], sbgs[i]};
    TORCH_CHECK(blobs[i].numel() == s.panels() * s.panel_bytes(), "step: ", what, ": blob size does not match");
    p.keep.push_back(blobs[i]);
    lin.add(s);
  }
  if (!w[5].is_none()) lin.bias = kept_float(p, w[5].cast<at::Tensor>(), lin.n, "bias");
  return lin;
}

std::shared_ptr<StepPlan> step_plan(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, double eps) {
  TORCH_CHECK(hidden > 0 && hidden % 32 == 0 && heads > 0 && kv_heads > 0 && heads % kv_heads == 0 &&
                  head_dim > 0 && head_dim % 2 == 0 && head_dim <= spx::kMaxHeadDim && (heads * head_dim) % 32 == 0,
              "step_plan: unsupported shape");
  auto p = std::make_shared<StepPlan>();
  p->model.hidden = hidden;
  p->model.heads = heads;
  p->model.kv_heads = kv_heads;
  p->model.head_dim = head_dim;
  p->model.eps = static_cast<float>(eps);
  return p;
}

// Dense MLPs alike (an expert layer's is empty), attention layers alike: the step's buffers are sized over the
// layers (step.cpp).
void check_mlp(const spx::StepModel& md, const spx::StepLayer& l, bool experts) {
  const auto dense = std::find_if(md.layers.begin(), md.layers.end(),
                                  [](const spx::StepLayer& x) { return !x.gate_up.segs.empty(); });
  const auto attention = std::find_if(md.layers.begin(), md.layers.end(),
                                      [](const spx::StepLayer& x) { return x.conv == nullptr; });
  TORCH_CHECK((l.conv != nullptr || attention == md.layers.end() || l.qkv.n == attention->qkv.n) &&
                  (experts || dense == md.layers.end() || l.gate_up.n == dense->gate_up.n),
              "step: every layer must have the same shape");
}

// A layer's dense MLP (gate_up, down) or None for both (experts follow).
void dense_mlp(StepPlan& p, spx::StepLayer& l, const py::object& gate_up, const py::object& down) {
  const spx::StepModel& md = p.model;
  TORCH_CHECK(gate_up.is_none() == down.is_none(), "step: gate_up and down come together (None: experts follow)");
  if (gate_up.is_none()) return;
  l.gate_up = step_linear(p, gate_up.cast<py::tuple>(), md.hidden, "gate_up");
  TORCH_CHECK(l.gate_up.n % 64 == 0, "step: gate_up's width must be a multiple of 64");
  l.down = step_linear(p, down.cast<py::tuple>(), l.gate_up.n / 2, "down");
  TORCH_CHECK(l.down.n == md.hidden && l.gate_up.bias == nullptr && l.down.bias == nullptr,
              "step: down must map the MLP back to the hidden width; only qkv has a bias");
}

// LFM2's convolution layer (step.h's StepLayer::conv): its input projection [3 hidden, hidden], output
// projection, kernel [hidden, kernel], pre-norms and MLP; kv_index counts the convolution layers before it.
void add_conv_layer(StepPlan& p, const py::tuple& in_proj, const py::tuple& out_proj, const py::object& gate_up,
                    const py::object& down, const at::Tensor& kernel, const at::Tensor& attn_norm,
                    const at::Tensor& mlp_norm) {
  spx::StepModel& md = p.model;
  spx::StepLayer l;
  l.qkv = step_linear(p, in_proj, md.hidden, "in_proj");
  l.o = step_linear(p, out_proj, md.hidden, "out_proj");
  TORCH_CHECK(l.qkv.n == 3 * md.hidden && l.o.n == md.hidden && l.qkv.bias == nullptr && l.o.bias == nullptr,
              "step: a convolution's projections must be [3 hidden, hidden] and [hidden, hidden], without biases");
  TORCH_CHECK(kernel.dim() == 2 && kernel.size(0) == md.hidden && kernel.size(1) >= 1 &&
                  kernel.size(1) <= spx::kMaxConvKernel,
              "step: a convolution's kernel must be [hidden, length <= ", spx::kMaxConvKernel, "]");
  l.conv_kernel = kernel.size(1);
  l.conv = kept_float(p, kernel, md.hidden * l.conv_kernel, "conv");
  l.attn_norm = kept_float(p, attn_norm, md.hidden, "attn_norm");
  l.mlp_norm = kept_float(p, mlp_norm, md.hidden, "mlp_norm");
  dense_mlp(p, l, gate_up, down);
  check_mlp(md, l, gate_up.is_none());
  l.kv_index = std::count_if(md.layers.begin(), md.layers.end(), [](const spx::StepLayer& e) {
    return e.conv != nullptr;
  });
  md.layers.push_back(std::move(l));
}

void add_layer(StepPlan& p, const py::tuple& qkv, const py::tuple& o, const py::object& gate_up, const py::object& down,
               const c10::optional<at::Tensor>& attn_norm, const c10::optional<at::Tensor>& mlp_norm,
               const c10::optional<at::Tensor>& q_norm,
               const c10::optional<at::Tensor>& k_norm, int64_t rope_kind) {
  spx::StepModel& md = p.model;
  const int64_t hd = md.heads * md.head_dim;
  spx::StepLayer l;
  l.qkv = step_linear(p, qkv, md.hidden, "qkv");
  l.o = step_linear(p, o, hd, "o");
  TORCH_CHECK(l.qkv.n == hd + 2 * md.kv_heads * md.head_dim && l.o.n == md.hidden,
              "step: layer widths do not match the model's shape");
  dense_mlp(p, l, gate_up, down);  // else layer_experts gives the layer its experts
  check_mlp(md, l, gate_up.is_none());
  // OLMo 2's layers have no norm before attention or the MLP
  if (attn_norm.has_value()) l.attn_norm = kept_float(p, *attn_norm, md.hidden, "attn_norm");
  if (mlp_norm.has_value()) l.mlp_norm = kept_float(p, *mlp_norm, md.hidden, "mlp_norm");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "step: q_norm and k_norm come together");
  if (q_norm.has_value()) {
    l.q_norm = kept_float(p, *q_norm, md.head_dim, "q_norm");
    l.k_norm = kept_float(p, *k_norm, md.head_dim, "k_norm");
  }
  TORCH_CHECK(rope_kind >= 0, "step: a layer's rope kind is an index into forward_batch's rope tables");
  l.rope_kind = rope_kind;
  l.kv_index = std::count_if(md.layers.begin(), md.layers.end(), [](const spx::StepLayer& e) {
    return e.conv == nullptr;
  });  // among the attention layers; layer_family counts it among its kind's
  md.layers.push_back(std::move(l));
}

// The model's family switches (step.h's StepModel): the score scale (0: 1 / sqrt(head_dim)), the
// residual multiplier, the rotary dimensions (0: all), the scores' soft cap (0: none), LayerNorms and the
// parallel block (Cohere).
void set_family(StepPlan& p, double attn_scale, double residual_scale, int64_t rot, double attn_softcap,
                bool layer_norm, bool parallel) {
  TORCH_CHECK(rot >= 0 && rot <= p.model.head_dim && rot % 2 == 0, "step: rotary dimensions must be even, <= head_dim");
  TORCH_CHECK(p.model.layers.empty(), "step: set the family before adding layers");
  TORCH_CHECK(attn_softcap >= 0 && std::isfinite(attn_softcap), "step: the soft cap must be finite and >= 0");
  p.model.attn_scale = static_cast<float>(attn_scale);
  p.model.attn_softcap = static_cast<float>(attn_softcap);
  p.model.residual_scale = static_cast<float>(residual_scale);
  p.model.rot = rot;
  p.model.layer_norm = layer_norm;
  p.model.parallel = parallel;
}

// The last added layer's family switches (step.h's StepLayer).
void layer_family(StepPlan& p, const c10::optional<at::Tensor>& attn_out_norm,
                  const c10::optional<at::Tensor>& mlp_out_norm, const c10::optional<at::Tensor>& q_full_norm,
                  const c10::optional<at::Tensor>& k_full_norm, bool windowed, bool gelu,
                  const c10::optional<at::Tensor>& sinks) {
  spx::StepModel& md = p.model;
  TORCH_CHECK(!md.layers.empty(), "step: layer_family follows add_layer");
  spx::StepLayer& l = md.layers.back();
  TORCH_CHECK(!md.parallel || !(attn_out_norm.has_value() || mlp_out_norm.has_value()),
              "step: a parallel block has no post norms");
  if (attn_out_norm.has_value()) l.attn_out_norm = kept_float(p, *attn_out_norm, md.hidden, "attn_out_norm");
  if (mlp_out_norm.has_value()) l.mlp_out_norm = kept_float(p, *mlp_out_norm, md.hidden, "mlp_out_norm");
  TORCH_CHECK(q_full_norm.has_value() == k_full_norm.has_value() && !(q_full_norm.has_value() && l.q_norm != nullptr),
              "step: whole-row q/k norms come together, and not with per-head ones");
  if (q_full_norm.has_value()) {
    l.q_full_norm = kept_float(p, *q_full_norm, md.heads * md.head_dim, "q_full_norm");
    l.k_full_norm = kept_float(p, *k_full_norm, md.kv_heads * md.head_dim, "k_full_norm");
  }
  l.windowed = windowed;
  TORCH_CHECK(l.conv == nullptr, "step: layer_family is an attention layer's");
  l.kv_index = std::count_if(md.layers.begin(), md.layers.end() - 1, [&](const spx::StepLayer& e) {
    return e.windowed == windowed && e.conv == nullptr;
  });
  l.gelu = gelu;
  if (sinks.has_value()) l.sinks = kept_float(p, *sinks, md.heads, "sinks");
}

// The last added layer's key offset (step.h's StepLayer::k_offset: a q8 cache's keys less it), or
// None: keys stored as they are.
void layer_key_offset(StepPlan& p, const c10::optional<at::Tensor>& offset) {
  spx::StepModel& md = p.model;
  TORCH_CHECK(!md.layers.empty(), "step: layer_key_offset follows add_layer");
  spx::StepLayer& l = md.layers.back();
  l.k_offset = offset.has_value() ? kept_float(p, *offset, md.kv_heads * md.head_dim, "key offset") : nullptr;
}

// One stacked expert tensor (blob, format, rows, offset, groups): experts.py's Experts.q_stacked.
spx::Segment stacked_segment(StepPlan& p, const py::tuple& t, int64_t n, int64_t k, const char* what) {
  TORCH_CHECK(t.size() == 5, "step: ", what, " must be (blob, format, rows, offset, groups)");
  const auto blob = t[0].cast<at::Tensor>();
  const int64_t fmt = t[1].cast<int64_t>(), rows = t[2].cast<int64_t>(), offset = t[3].cast<int64_t>(),
                sbg = t[4].cast<int64_t>();
  spx::FormatInfo fi{};
  TORCH_CHECK(spx::format_info(fmt, sbg, &fi) && k % fi.superblock == 0 && rows == n, "step: ", what,
              ": bad format or shape");
  TORCH_CHECK(blob.scalar_type() == at::kByte && blob.is_contiguous(), "step: ", what, ": a contiguous uint8 blob");
  const spx::Segment s{blob.data_ptr<uint8_t>(), fmt, n, k, offset, sbg};
  TORCH_CHECK(blob.numel() == s.panels() * s.panel_bytes(), "step: ", what, ": blob size does not match");
  p.keep.push_back(blob);
  return s;
}

// The last added layer's experts (step.h's StepExperts; add_layer gave it no dense MLP): the router as
// three bfloat16 parts (experts.exact_bf16) and its bias, the stacked gate, up and down tensors, their
// biases [count, 2 ff] and [count, hidden] (or None), the activation (core/experts.h's ExpertAct), a
// shared expert's gate_up and down (or None; where `shared_gated`, its gate is the router's last row in
// each part) and the weighting's selection bias [count] (the biased weightings'; else None).
void layer_experts(StepPlan& p, const py::tuple& router, const c10::optional<at::Tensor>& router_bias,
                   const py::tuple& gate, const py::tuple& up, const py::tuple& down, int64_t count, int64_t used,
                   int64_t ff, int64_t kind, const c10::optional<at::Tensor>& gate_up_bias,
                   const c10::optional<at::Tensor>& down_bias, int64_t act, const py::object& shared_gate_up,
                   const py::object& shared_down, bool shared_gated, const c10::optional<at::Tensor>& select_bias) {
  spx::StepModel& md = p.model;
  TORCH_CHECK(!md.layers.empty() && md.layers.back().gate_up.segs.empty(), "step: layer_experts follows add_layer "
              "of a layer without a dense MLP");
  TORCH_CHECK(!md.parallel, "step: a parallel block has no experts");
  TORCH_CHECK(count >= 1 && used >= 1 && used <= count && used <= spx::kMaxExpertsUsed && ff > 0 && ff % 32 == 0 &&
                  kind >= 0 && kind < spx::kWeightings && act >= 0 && act < spx::kExpertActs,
              "step: unsupported experts (count, used, width or weighting)");
  spx::StepLayer& l = md.layers.back();
  spx::StepExperts& e = l.moe;
  TORCH_CHECK(shared_gate_up.is_none() == shared_down.is_none(), "step: a shared expert's gate_up and down come together");
  const bool shared = !shared_gate_up.is_none();
  e.shared_gated = shared && shared_gated;
  e.router = step_linear(p, router, md.hidden, "router");
  TORCH_CHECK(e.router.n == 3 * (count + (e.shared_gated ? 1 : 0)) && e.router.bias == nullptr,
              "step: the router must be [3 * (experts + 1 if a shared expert's gate follows), hidden]");
  TORCH_CHECK(select_bias.has_value() == spx::biased(static_cast<spx::Weighting>(kind)),
              "step: a selection bias comes with the biased weighting, and only with it");
  if (select_bias.has_value()) e.select_bias = kept_float(p, *select_bias, count, "select_bias");
  if (shared) {
    e.shared_gate_up = step_linear(p, shared_gate_up.cast<py::tuple>(), md.hidden, "shared_gate_up");
    TORCH_CHECK(e.shared_gate_up.n % 64 == 0 && e.shared_gate_up.bias == nullptr,
                "step: the shared expert's gate_up must be a multiple of 64 wide, without a bias");
    e.shared_ff = e.shared_gate_up.n / 2;
    e.shared_down = step_linear(p, shared_down.cast<py::tuple>(), e.shared_ff, "shared_down");
    TORCH_CHECK(e.shared_down.n == md.hidden && e.shared_down.bias == nullptr,
                "step: the shared expert's down must map back to the hidden width, without a bias");
  }
  if (router_bias.has_value()) e.router_bias = kept_float(p, *router_bias, count, "router_bias");
  e.gate = stacked_segment(p, gate, count * ff, md.hidden, "gate");
  e.up = stacked_segment(p, up, count * ff, md.hidden, "up");
  e.down = stacked_segment(p, down, count * md.hidden, ff, "down");
  TORCH_CHECK(ff % spx::kPanel == 0 && md.hidden % spx::kPanel == 0, "step: expert widths must be whole panels");
  e.count = count;
  e.used = used;
  e.ff = ff;
  e.kind = static_cast<spx::Weighting>(kind);
  e.act = static_cast<spx::ExpertAct>(act);
  if (gate_up_bias.has_value()) e.gate_up_bias = kept_float(p, *gate_up_bias, count * 2 * ff, "gate_up_bias");
  if (down_bias.has_value()) e.down_bias = kept_float(p, *down_bias, count * md.hidden, "down_bias");
  const spx::StepLayer& first = *std::find_if(md.layers.begin(), md.layers.end(),
                                               [](const spx::StepLayer& x) { return x.moe.count > 0; });
  TORCH_CHECK(first.moe.count == count && first.moe.used == used && first.moe.ff == ff &&
                  first.moe.shared_ff == e.shared_ff && first.moe.shared_gated == e.shared_gated,
              "step: every expert layer must have the same experts");
}

// The final norm and an LM head (the whole one, or a draft's trimmed one) for forward_batch.
struct HeadPlan {
  spx::StepHead head;
  std::vector<at::Tensor> keep;
};

std::shared_ptr<HeadPlan> step_head(const StepPlan& p, const py::tuple& w, const at::Tensor& norm, double eps) {
  auto h = std::make_shared<HeadPlan>();
  StepPlan kept;  // step_linear's checks and the tensors it keeps alive
  h->head.w = step_linear(kept, w, p.model.hidden, "head");
  h->head.norm = kept_float(kept, norm, p.model.hidden, "norm");
  h->head.eps = static_cast<float>(eps);
  h->keep = std::move(kept.keep);
  return h;
}

// A cache of bfloat16 rows, or of q8 rows (int8 bytes, kv_q8.h): returns whether it is q8.
bool check_cache(const spx::StepModel& md, const at::Tensor& c, int64_t capacity, int64_t layers) {
  const bool q8 = c.scalar_type() == at::kChar;
  const int64_t width = q8 ? 2 * spx::q8_row_units(md.head_dim) : md.head_dim;
  TORCH_CHECK((c.scalar_type() == at::kBFloat16 || (q8 && md.head_dim % spx::kQ8Group == 0)) && c.is_contiguous() &&
                  c.dim() == 4 && c.size(0) == layers && c.size(1) == md.kv_heads &&
                  c.size(2) == capacity && c.size(3) == width,
              "forward_batch: caches must be contiguous bfloat16 [layers, kv_heads, capacity, head_dim] "
              "(or int8 q8 rows [..., head_dim + head_dim / 16])");
  return q8;
}

// One sequence's part, checked, with what its pointers point into.
struct SeqArgs {
  spx::StepSeq seq{};
  at::Tensor mask, wmask, taps;
  std::vector<float*> keep;
};

// A part's convolution states [convs, 1, slots, hidden] (float32) and taps [rows, kernel] (slots, -1: none).
void conv_sequence(const spx::StepModel& md, const py::tuple& part, int64_t convs, SeqArgs& out) {
  spx::StepSeq& s = out.seq;
  auto state = part[7].cast<at::Tensor>();
  out.taps = part[8].cast<at::Tensor>().to(at::kLong).contiguous();
  const auto first = std::find_if(md.layers.begin(), md.layers.end(), [](const spx::StepLayer& l) {
    return l.conv != nullptr;
  });
  const int64_t kernel = first->conv_kernel;
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.is_contiguous() && state.dim() == 4 &&
                  state.size(0) == convs && state.size(1) == 1 && state.size(3) == md.hidden,
              "forward_batch: convolution states must be contiguous float32 [convs, 1, slots, hidden]");
  TORCH_CHECK(out.taps.dim() == 2 && out.taps.size(0) == s.t && out.taps.size(1) == kernel,
              "forward_batch: convolution taps [rows, kernel]");
  s.conv_capacity = state.size(2);
  const int64_t* tp = out.taps.data_ptr<int64_t>();
  for (int64_t i = 0; i < s.t * kernel; ++i) {
    const bool own = i % kernel == kernel - 1;
    TORCH_CHECK(tp[i] >= (own ? 0 : -1) && tp[i] < s.conv_capacity,
                "forward_batch: a convolution tap outside its state's slots");
  }
  s.conv_state = state.data_ptr<float>();
  s.taps = tp;
}

// part: (k_cache, v_cache, rows, start, mask or None, keep_layers, keep_q[, window_first, window_mask,
// window_k, window_v, window_offset]): with windowed layers, k and v hold the other layers.
void sequence(const spx::StepModel& md, const py::tuple& part, SeqArgs& out) {
  TORCH_CHECK(part.size() == 7 || part.size() == 9 || part.size() == 12,
              "forward_batch: a part is (k, v, rows, start, mask, keep_layers, keep_q[, window_first, window_mask, "
              "window_k, window_v, window_offset]) or (..., keep_q, conv_state, conv_taps)");
  const int64_t windowed = std::count_if(md.layers.begin(), md.layers.end(), [](const spx::StepLayer& l) {
    return l.windowed;
  });
  const int64_t convs = std::count_if(md.layers.begin(), md.layers.end(), [](const spx::StepLayer& l) {
    return l.conv != nullptr;
  });
  const int64_t others = static_cast<int64_t>(md.layers.size()) - windowed - convs;
  auto k_cache = part[0].cast<at::Tensor>(), v_cache = part[1].cast<at::Tensor>();
  const int64_t t = part[2].cast<int64_t>(), start = part[3].cast<int64_t>();
  const int64_t capacity = k_cache.dim() == 4 ? k_cache.size(2) : -1;
  const bool q8 = check_cache(md, k_cache, capacity, others);
  TORCH_CHECK(check_cache(md, v_cache, capacity, others) == q8, "forward_batch: k and v caches of different kinds");
  TORCH_CHECK(t > 0 && start >= 0 && start + t <= capacity, "forward_batch: slots past the cache's capacity");
  spx::StepSeq& s = out.seq;
  s = spx::StepSeq{t, static_cast<uint16_t*>(k_cache.data_ptr()), static_cast<uint16_t*>(v_cache.data_ptr()),
                   capacity, start, nullptr, t};
  s.q8 = q8;
  if (!part[4].is_none()) {
    out.mask = part[4].cast<at::Tensor>().to(at::kBool).contiguous();
    TORCH_CHECK(out.mask.dim() == 2 && out.mask.size(0) == t && out.mask.size(1) >= t && out.mask.size(1) <= start + t,
                "forward_batch: mask [t, m] with t <= m <= start + t");
    s.mask = out.mask.data_ptr<bool>();
    s.m = out.mask.size(1);
  }
  TORCH_CHECK(!windowed || (part.size() == 12 && !part[8].is_none()), "forward_batch: windowed layers need a window");
  if (windowed) {
    s.wfirst = part[7].cast<int64_t>();
    out.wmask = part[8].cast<at::Tensor>().to(at::kBool).contiguous();
    TORCH_CHECK(s.wfirst >= 0 && s.wfirst <= start && out.wmask.dim() == 2 && out.wmask.size(0) == t &&
                    out.wmask.size(1) == start + t - s.wfirst,
                "forward_batch: a window mask [t, start + t - window_first]");
    s.wmask = out.wmask.data_ptr<bool>();
    auto wk = part[9].cast<at::Tensor>(), wv = part[10].cast<at::Tensor>();
    s.woffset = part[11].cast<int64_t>();
    s.wcapacity = wk.dim() == 4 ? wk.size(2) : -1;
    TORCH_CHECK(check_cache(md, wk, s.wcapacity, windowed) == q8 && check_cache(md, wv, s.wcapacity, windowed) == q8,
                "forward_batch: the windowed layers' caches of another kind");
    TORCH_CHECK(s.woffset >= 0 && s.woffset <= s.wfirst && start + t - s.woffset <= s.wcapacity,
                "forward_batch: the window's keys outside the windowed layers' slots");
    s.wk = static_cast<uint16_t*>(wk.data_ptr());
    s.wv = static_cast<uint16_t*>(wv.data_ptr());
  }
  TORCH_CHECK(!convs || (part.size() == 9 && !windowed), "forward_batch: convolution layers need their states");
  if (convs) conv_sequence(md, part, convs, out);
  const auto layers_kept = part[5].cast<std::vector<int64_t>>();
  const auto queries = part[6].cast<std::vector<at::Tensor>>();
  const int64_t layers = static_cast<int64_t>(md.layers.size());
  TORCH_CHECK(layers_kept.size() == queries.size(), "forward_batch: one query tensor per kept layer");
  if (!queries.empty()) out.keep.assign(layers, nullptr);
  for (size_t i = 0; i < queries.size(); ++i) {
    const int64_t li = layers_kept[i];
    TORCH_CHECK(li >= 0 && li < layers && out.keep[li] == nullptr, "forward_batch: kept layer ", li,
                " out of range or twice");
    TORCH_CHECK(queries[i].scalar_type() == at::kFloat && queries[i].is_contiguous() && queries[i].dim() == 3 &&
                    queries[i].size(0) == md.heads && queries[i].size(1) == t && queries[i].size(2) == md.head_dim,
                "forward_batch: kept queries must be contiguous float32 [heads, t, head_dim]");
    TORCH_CHECK(md.layers[li].conv == nullptr, "forward_batch: a convolution layer has no queries to keep");
    out.keep[li] = queries[i].data_ptr<float>();
  }
}

// x [T, hidden] float32 (every part's embeddings, part after part) becomes the last layer's
// output, in place; each part's new K/V go to its cache's slots [start, start + rows); cos/sin
// [kinds, T, head_dim] (a table per rope kind the layers name). With a head: the logits [len(logit_rows), head width] of x's rows `logit_rows`.
c10::optional<at::Tensor> forward_batch(StepPlan& p, at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                                        const std::vector<py::tuple>& parts, int64_t path_id,
                                        const std::shared_ptr<HeadPlan>& head,
                                        const c10::optional<at::Tensor>& logit_rows) {
  TORCH_CHECK(path_id >= 0 && path_id < spx::kPaths && spx::cpu_supports(static_cast<spx::Path>(path_id)),
              "forward_batch: this CPU cannot run kernel path ", path_id);
  const spx::StepModel& md = p.model;
  TORCH_CHECK(!md.layers.empty(), "forward_batch: the plan has no layers");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2 && x.size(1) == md.hidden &&
                  x.size(0) > 0,
              "forward_batch: x must be contiguous float32 [T, hidden]");
  TORCH_CHECK(!parts.empty(), "forward_batch: no parts");
  std::vector<SeqArgs> args(parts.size());
  std::vector<spx::StepSeq> seqs(parts.size());
  int64_t t = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    sequence(md, parts[i], args[i]);
    args[i].seq.keep_q = args[i].keep.empty() ? nullptr : args[i].keep.data();
    seqs[i] = args[i].seq;
    t += seqs[i].t;
  }
  TORCH_CHECK(t == x.size(0), "forward_batch: the parts' rows must add up to x's");
  const at::Tensor cc = cos.contiguous(), sc = sin.contiguous();
  int64_t kinds = 0;
  for (const spx::StepLayer& l : md.layers) kinds = std::max(kinds, l.rope_kind + 1);
  TORCH_CHECK(cc.scalar_type() == at::kFloat && sc.scalar_type() == at::kFloat &&
                  cc.numel() >= kinds * t * md.rope_width() && cc.numel() % (t * md.rope_width()) == 0 &&
                  sc.numel() == cc.numel(),
              "forward_batch: cos/sin float32 [kinds, T, head_dim], a table for every layer's rope kind");
  spx::StepBatch bt{x.data_ptr<float>(), cc.data_ptr<float>(), sc.data_ptr<float>(), seqs.data(),
                    static_cast<int64_t>(seqs.size())};
  c10::optional<at::Tensor> logits;
  at::Tensor rows;
  if (head) {
    TORCH_CHECK(logit_rows.has_value(), "forward_batch: a head needs logit_rows");
    rows = logit_rows->to(at::kLong).contiguous();
    TORCH_CHECK(rows.dim() == 1, "forward_batch: logit_rows [n]");
    const int64_t n = rows.numel();
    const int64_t* r = rows.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) TORCH_CHECK(r[i] >= 0 && r[i] < t, "forward_batch: logit row out of range");
    logits = at::empty({n, head->head.w.n}, x.options());
    bt.head = &head->head;
    bt.logit_rows = r;
    bt.n_logits = n;
    bt.logits = logits->data_ptr<float>();
  }
  // The plan's buffers, unless another call is using them (the same model stepped from two threads).
  std::unique_lock<std::mutex> lock(p.busy, std::try_to_lock);
  spx::forward_batch(static_cast<spx::Path>(path_id), md, bt, at::get_num_threads(),
                     lock.owns_lock() ? &p.workspace : nullptr);
  return logits;
}

// Frees the calling thread's idle OpenMP team (step.release_thread_team says why); false where the
// runtime cannot (no OpenMP 5.0 pause, or the thread is inside a parallel region). GCC declares
// the pause from 9 on while its _OPENMP still says 4.5.
bool release_thread_team() {
#if defined(_OPENMP) && (defined(__clang__) || !defined(__GNUC__) || __GNUC__ >= 9)
  return omp_pause_resource(omp_pause_soft, omp_get_initial_device()) == 0;
#else
  return false;
#endif
}

}  // namespace

void bind_step(py::module& m) {
  m.def("release_thread_team", &release_thread_team, "free the calling thread's idle OpenMP team");
  py::class_<StepPlan, std::shared_ptr<StepPlan>>(m, "StepPlan")
      .def("add_layer", &add_layer)
      .def("add_conv_layer", &add_conv_layer)
      .def("set_family", &set_family)
      .def("layer_family", &layer_family)
      .def("layer_key_offset", &layer_key_offset)
      .def("layer_experts", &layer_experts);
  py::class_<HeadPlan, std::shared_ptr<HeadPlan>>(m, "StepHead");
  m.def("step_plan", &step_plan, "a quantized model's layers for forward_batch (add_layer once per layer)");
  m.def("step_head", &step_head, "the final norm and an LM head for forward_batch");
  m.def("forward_batch", &forward_batch, "every layer of several sequences' new tokens in one parallel region",
        py::arg("plan"), py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("parts"), py::arg("path_id"),
        py::arg("head") = nullptr, py::arg("logit_rows") = py::none());
}
