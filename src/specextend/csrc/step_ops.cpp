// The PyTorch binding of the whole-step forward (core/step.h): a model's quantized layers
// described once (`StepPlan`, which keeps its tensors alive), then one call per forward. Every
// check runs before the parallel region; the core never throws.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <memory>
#include <vector>

#include "core/cpu.h"
#include "core/rope.h"
#include "core/step.h"

namespace {

struct StepPlan {
  spx::StepModel model;
  std::vector<at::Tensor> keep;  // the weights and norms the model's pointers point into
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

void add_layer(StepPlan& p, const py::tuple& qkv, const py::tuple& o, const py::tuple& gate_up, const py::tuple& down,
               const at::Tensor& attn_norm, const at::Tensor& mlp_norm, const c10::optional<at::Tensor>& q_norm,
               const c10::optional<at::Tensor>& k_norm) {
  spx::StepModel& md = p.model;
  const int64_t hd = md.heads * md.head_dim;
  spx::StepLayer l;
  l.qkv = step_linear(p, qkv, md.hidden, "qkv");
  l.o = step_linear(p, o, hd, "o");
  l.gate_up = step_linear(p, gate_up, md.hidden, "gate_up");
  TORCH_CHECK(l.qkv.n == hd + 2 * md.kv_heads * md.head_dim && l.o.n == md.hidden && l.gate_up.n % 64 == 0,
              "step: layer widths do not match the model's shape");
  l.down = step_linear(p, down, l.gate_up.n / 2, "down");
  TORCH_CHECK(l.down.n == md.hidden && l.o.bias == nullptr && l.gate_up.bias == nullptr && l.down.bias == nullptr,
              "step: down must map the MLP back to the hidden width; only qkv has a bias");
  TORCH_CHECK(md.layers.empty() || (l.qkv.n == md.layers[0].qkv.n && l.gate_up.n == md.layers[0].gate_up.n),
              "step: every layer must have the same shape");
  l.attn_norm = kept_float(p, attn_norm, md.hidden, "attn_norm");
  l.mlp_norm = kept_float(p, mlp_norm, md.hidden, "mlp_norm");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "step: q_norm and k_norm come together");
  if (q_norm.has_value()) {
    l.q_norm = kept_float(p, *q_norm, md.head_dim, "q_norm");
    l.k_norm = kept_float(p, *k_norm, md.head_dim, "k_norm");
  }
  md.layers.push_back(std::move(l));
}

const uint16_t* check_cache(const spx::StepModel& md, const at::Tensor& c, int64_t capacity) {
  TORCH_CHECK(c.scalar_type() == at::kBFloat16 && c.is_contiguous() && c.dim() == 4 &&
                  c.size(0) == static_cast<int64_t>(md.layers.size()) && c.size(1) == md.kv_heads &&
                  c.size(2) == capacity && c.size(3) == md.head_dim,
              "forward_step: caches must be contiguous bfloat16 [layers, kv_heads, capacity, head_dim]");
  return reinterpret_cast<const uint16_t*>(c.data_ptr<at::BFloat16>());
}

// x [t, hidden] float32 (the embeddings) becomes the last layer's output, in place; the new
// tokens' K/V go to cache slots [start, start + t). mask: [t, m] bool or None (causal).
// keep_q[i] [heads, t, head_dim] gets layer keep_layers[i]'s rotated queries (retrieval's).
at::Tensor forward_step(const StepPlan& p, at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                        at::Tensor k_cache, at::Tensor v_cache, int64_t start, const c10::optional<at::Tensor>& mask,
                        int64_t path_id, const std::vector<int64_t>& keep_layers, std::vector<at::Tensor> keep_q) {
  TORCH_CHECK(path_id >= 0 && path_id < spx::kPaths && spx::cpu_supports(static_cast<spx::Path>(path_id)),
              "forward_step: this CPU cannot run kernel path ", path_id);
  const spx::StepModel& md = p.model;
  TORCH_CHECK(!md.layers.empty(), "forward_step: the plan has no layers");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2 && x.size(1) == md.hidden &&
                  x.size(0) > 0,
              "forward_step: x must be contiguous float32 [t, hidden]");
  const int64_t t = x.size(0), capacity = k_cache.dim() == 4 ? k_cache.size(2) : -1;
  check_cache(md, k_cache, capacity);
  check_cache(md, v_cache, capacity);
  TORCH_CHECK(start >= 0 && start + t <= capacity, "forward_step: slots past the cache's capacity");
  const at::Tensor cc = cos.contiguous(), sc = sin.contiguous();
  TORCH_CHECK(cc.scalar_type() == at::kFloat && sc.scalar_type() == at::kFloat && cc.numel() == t * md.head_dim &&
                  sc.numel() == t * md.head_dim,
              "forward_step: cos/sin float32 [t, head_dim]");
  at::Tensor mc;
  spx::StepRows r{x.data_ptr<float>(), cc.data_ptr<float>(), sc.data_ptr<float>(), t,
                  reinterpret_cast<uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
                  reinterpret_cast<uint16_t*>(v_cache.data_ptr<at::BFloat16>()), capacity, start, nullptr, t};
  if (mask.has_value() && mask->defined()) {
    mc = mask->to(at::kBool).contiguous();
    TORCH_CHECK(mc.dim() == 2 && mc.size(0) == t && mc.size(1) >= t && mc.size(1) <= start + t,
                "forward_step: mask [t, m] with t <= m <= start + t");
    r.mask = mc.data_ptr<bool>();
    r.m = mc.size(1);
  }
  const int64_t layers = static_cast<int64_t>(md.layers.size());
  TORCH_CHECK(keep_layers.size() == keep_q.size(), "forward_step: one query tensor per kept layer");
  std::vector<float*> keep(keep_q.empty() ? 0 : layers, nullptr);
  for (size_t i = 0; i < keep_q.size(); ++i) {
    const int64_t li = keep_layers[i];
    TORCH_CHECK(li >= 0 && li < layers && keep[li] == nullptr, "forward_step: kept layer ", li, " out of range or twice");
    TORCH_CHECK(keep_q[i].scalar_type() == at::kFloat && keep_q[i].is_contiguous() && keep_q[i].dim() == 3 &&
                    keep_q[i].size(0) == md.heads && keep_q[i].size(1) == t && keep_q[i].size(2) == md.head_dim,
                "forward_step: kept queries must be contiguous float32 [heads, t, head_dim]");
    keep[li] = keep_q[i].data_ptr<float>();
  }
  r.keep_q = keep.empty() ? nullptr : keep.data();
  spx::forward_step(static_cast<spx::Path>(path_id), md, r, at::get_num_threads());
  return x;
}

}  // namespace

void bind_step(py::module& m) {
  py::class_<StepPlan, std::shared_ptr<StepPlan>>(m, "StepPlan").def("add_layer", &add_layer);
  m.def("step_plan", &step_plan, "a quantized model's layers for forward_step (add_layer once per layer)");
  m.def("forward_step", &forward_step, "every layer of a few new tokens in one parallel region");
}
