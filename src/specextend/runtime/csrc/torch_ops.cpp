// The PyTorch binding of the kernel core (core/): tensors in, checked, raw pointers handed to the
// core, threads from PyTorch's pool. Every check runs before any parallel work, and the core
// never throws, so no exception crosses a parallel region.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "core/attention.h"
#include "core/cpu.h"
#include "core/experts.h"
#include "core/qlinear.h"
#include "core/family.h"
#include "core/kv_q8.h"
#include "core/rope.h"

namespace {

spx::Path checked_path(int64_t path) {
  TORCH_CHECK(path >= 0 && path < spx::kPaths, "unknown kernel path ", path);
  const auto p = static_cast<spx::Path>(path);
  TORCH_CHECK(spx::cpu_supports(p), "this CPU cannot run the ", spx::path_name(p), " kernels");
  return p;
}

std::vector<std::string> cpu_paths() {
  std::vector<std::string> out;
  for (int i = 0; i < spx::kPaths; ++i) {
    const auto p = static_cast<spx::Path>(i);
    if (p != spx::Path::AMXEmulated && spx::cpu_supports(p)) out.emplace_back(spx::path_name(p));
  }
  return out;
}

// Why the amx path cannot run here (one clause), or None where it runs.
py::object amx_status() {
  const char* why = spx::amx_status();
  return why == nullptr ? py::object(py::none()) : py::object(py::str(why));
}

// The int8 activations of rows x [m, k], with their scales and sums, and (`floats`: for the float
// formats) pre(x) in float32.
// (`k256`: also the per-256 activations of the K-quants, Rows::kq8.)
struct QuantizedRows {
  at::Tensor q8, d8, s16, s32, xs, xf, q8g, kq8, kd, ks16, ks32, xb;
  spx::Rows rows() {
    spx::Rows r{q8.data_ptr<int8_t>(), d8.data_ptr<float>(), s16.data_ptr<int32_t>(), s32.data_ptr<int32_t>(),
                xs.data_ptr<float>(), q8.size(1), xf.defined() ? xf.data_ptr<float>() : nullptr,
                q8g.defined() ? q8g.data_ptr<int8_t>() : nullptr, q8.size(0)};
    if (xb.defined()) {
      r.xb = reinterpret_cast<uint32_t*>(xb.data_ptr<int32_t>());
      r.xbm = xb.size(1);
    }
    if (kq8.defined()) {
      r.kq8 = kq8.data_ptr<int8_t>();
      r.kd = kd.data_ptr<float>();
      r.ks16 = ks16.data_ptr<int16_t>();
      r.ks32 = ks32.data_ptr<int16_t>();
    }
    return r;
  }
};

QuantizedRows quantize(spx::Path path, const at::Tensor& x, int64_t k, const spx::PreOp& op, bool floats = false,
                       bool k256 = false, bool bf16d = false) {
  const int64_t m = x.size(0);
  auto opt = x.options();
  QuantizedRows a{at::empty({m, k}, opt.dtype(at::kChar)), at::empty({m, k / 32}, opt.dtype(at::kFloat)),
                  at::empty({m, k / 16}, opt.dtype(at::kInt)), at::empty({m, k / 32}, opt.dtype(at::kInt)),
                  at::empty({m, k / 32}, opt.dtype(at::kFloat)),
                  floats ? at::empty({m, k}, opt.dtype(at::kFloat)) : at::Tensor(),
                  spx::wants_group_rows(path, m) ? at::empty({k / 32, m, 32}, opt.dtype(at::kChar)) : at::Tensor()};
  if (bf16d) a.xb = at::empty({k / 2, m}, opt.dtype(at::kInt));  // pair-major (Rows::xb)
  if (k256) {
    a.kq8 = at::empty({m, k}, opt.dtype(at::kChar));
    a.kd = at::empty({m, k / 256}, opt.dtype(at::kFloat));
    a.ks16 = at::empty({m, k / 16}, opt.dtype(at::kShort));
    a.ks32 = at::empty({m, k / 32}, opt.dtype(at::kShort));
  }
  const spx::Rows rows = a.rows();
  const float* xp = x.data_ptr<float>();
  const int64_t ldx = x.size(1);
  // One scratch row per thread, allocated here: nothing is allocated inside the parallel region.
  const int64_t threads = m >= 8 ? at::get_num_threads() : 1;
  std::vector<float> scratch(static_cast<size_t>(threads) * k);
  if (m >= 8) {
    at::parallel_for(0, m, 4, [&](int64_t b, int64_t e) {
      spx::quantize_rows(path, xp, ldx, op, rows, b, e, scratch.data() + at::get_thread_num() * k);
    });
  } else {
    spx::quantize_rows(path, xp, ldx, op, rows, 0, m, scratch.data());
  }
  return a;
}

// The product's units (spx::plan_linear) taken by the threads from a shared counter: a thread
// that another process slows down hands its share over, and whichever thread computes a unit,
// its outputs are the same bits.
void run_linear(spx::Path path, const spx::Linear& lin, int64_t panels) {
  const int threads = at::get_num_threads();
  const spx::LinearWork work = spx::plan_linear(path, lin, panels, threads);
  std::atomic<int64_t> next{0};
  constexpr int64_t kScratch = spx::kRowBlock * spx::kPanel;
  // Each thread's accumulators (a rows kernel stores and reloads them for every weight group) on
  // their own 4 KB page, at a different offset in it: packed side by side from a 64-byte boundary
  // they made the avx2 rows kernel's prefill measurably slower (docs/log/2026-11-many-row-kernels.md).
  constexpr int64_t kPage = 1024;  // floats
  std::vector<float> scratch(static_cast<size_t>(threads) * (kScratch + kPage) + kPage);
  float* base = scratch.data() + ((kPage - (reinterpret_cast<uintptr_t>(scratch.data()) / 4) % kPage) % kPage);
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
    float* acc = base + (b % threads) * (kScratch + kPage) + 16 * (b % threads);
    for (int64_t u; (u = next.fetch_add(1)) < work.units();) spx::linear_unit(path, lin, work, u, acc);
    (void)e;
  });
}

const float* optional_float(const c10::optional<at::Tensor>& t, at::Tensor& keep, int64_t numel, const char* what) {
  if (!t.has_value() || !t->defined()) return nullptr;
  keep = t->contiguous();
  TORCH_CHECK(keep.scalar_type() == at::kFloat && keep.numel() == numel, "qlinear: ", what, " must be float32 of ",
              numel, " values");
  return keep.data_ptr<float>();
}

// y[M, sum(n)] = pre(x)[M, K] @ concat(segments)^T (+ bias) (+ residual), one activation
// quantization for all segments. pre: an RMSNorm with weight `norm` (a LayerNorm's where `center`: the row's
// mean subtracted first), or silu(gate) * up when
// `silu_mul` (x then holds [gate | up], 2K columns); residual: [M, sum(n)] added to the result.
at::Tensor qlinear(const at::Tensor& x, const std::vector<at::Tensor>& blobs, const std::vector<int64_t>& fmts,
                   const std::vector<int64_t>& ns, const std::vector<int64_t>& offsets,
                   const std::vector<int64_t>& sbgs, const c10::optional<at::Tensor>& bias,
                   const c10::optional<at::Tensor>& norm, double eps, bool silu_mul,
                   const c10::optional<at::Tensor>& residual, int64_t path_id,
                   const c10::optional<at::Tensor>& out, bool center) {
  const spx::Path path = checked_path(path_id);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "qlinear: x must be a 2-D float32 tensor");
  TORCH_CHECK(blobs.size() == fmts.size() && fmts.size() == ns.size() && ns.size() == offsets.size() &&
                  offsets.size() == sbgs.size() && !blobs.empty(),
              "qlinear: one format, width, offset and super-block size per weight segment");
  const at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), k = silu_mul ? xc.size(1) / 2 : xc.size(1);
  TORCH_CHECK(!silu_mul || xc.size(1) == 2 * k, "qlinear: silu_mul needs [gate | up] rows");
  TORCH_CHECK(k % 32 == 0 && k > 0, "qlinear: input width must be a positive multiple of 32");
  spx::PreOp op;
  at::Tensor norm_keep, bias_keep, res_keep;
  op.norm = optional_float(norm, norm_keep, k, "norm");
  TORCH_CHECK(!(op.norm && silu_mul), "qlinear: norm and silu_mul do not combine");
  op.eps = static_cast<float>(eps);
  TORCH_CHECK(!center || op.norm, "qlinear: center is a LayerNorm's, with a norm");
  op.center = center;
  op.silu_mul = silu_mul;
  int64_t n_total = 0;
  std::vector<spx::Segment> segs;
  std::vector<int64_t> first_panel{0};
  for (size_t i = 0; i < blobs.size(); ++i) {
    spx::FormatInfo fi{};
    TORCH_CHECK(spx::format_info(fmts[i], sbgs[i], &fi), "qlinear: unknown weight format ", fmts[i],
                " (Q4K, Q5K and IQ4 take 1 to 8 groups per super-block)");
    TORCH_CHECK(k % fi.superblock == 0, "qlinear: input width ", k, " is not a multiple of the format's ",
                fi.superblock);
    TORCH_CHECK(ns[i] > 0 && blobs[i].scalar_type() == at::kByte && blobs[i].is_contiguous(),
                "qlinear: weight blob ", i, " must be contiguous uint8 of a positive width");
    spx::Segment s{blobs[i].data_ptr<uint8_t>(), fmts[i], ns[i], k, offsets[i], sbgs[i]};
    TORCH_CHECK(blobs[i].numel() == s.panels() * s.panel_bytes(), "qlinear: weight blob ", i, " has ",
                blobs[i].numel(), " bytes, expected ", s.panels() * s.panel_bytes());
    segs.push_back(s);
    first_panel.push_back(first_panel.back() + s.panels());
    n_total += s.n;
  }
  const float* bp = optional_float(bias, bias_keep, n_total, "bias");
  const float* rp = optional_float(residual, res_keep, m * n_total, "residual");
  TORCH_CHECK(!rp || (res_keep.dim() == 2 && res_keep.size(0) == m), "qlinear: residual must be [m, n]");
  bool floats = false, k256 = false, bf16d = false;
  for (const spx::Segment& s : segs) {
    floats = floats || spx::float_format(s.fmt);
    k256 = k256 || spx::k256_segment(s.fmt, s.sbg);
    bf16d = bf16d || spx::bf16_dot_format(s.fmt);
  }
  QuantizedRows a = quantize(path, xc, k, op, floats, k256, bf16d);
  at::Tensor y;
  if (out.has_value() && out->defined()) {
    y = *out;
    TORCH_CHECK(y.scalar_type() == at::kFloat && y.is_contiguous() && y.dim() == 2 && y.size(0) == m &&
                    y.size(1) == n_total,
                "qlinear: out must be contiguous float32 [", m, ", ", n_total, "]");
  } else {
    y = at::empty({m, n_total}, xc.options());
  }
  const spx::Linear lin{segs.data(), first_panel.data(), static_cast<int64_t>(segs.size()), a.rows(), m,
                        y.data_ptr<float>(), n_total, bp, rp};
  run_linear(path, lin, first_panel.back());
  return y;
}

// Rows of one segment in float32 (embedding lookups, float conversions, tests), into `out` [rows, k]
// when given (a slice of a stacked weight: no copy afterwards). Ids that run on within a panel are
// unpacked together: a whole weight's conversion unpacks each group once, not once a row.
at::Tensor dequantize(const at::Tensor& blob, int64_t fmt, int64_t n, int64_t k, int64_t offset, int64_t sbg,
                      const at::Tensor& row_ids, const c10::optional<at::Tensor>& out_opt) {
  spx::FormatInfo fi{};
  TORCH_CHECK(spx::format_info(fmt, sbg, &fi), "dequantize: unknown format (Q4K, Q5K and IQ4 take 1 to 8 groups per super-block)");
  TORCH_CHECK(k > 0 && k % fi.superblock == 0 && n > 0, "dequantize: bad input width");
  TORCH_CHECK(blob.scalar_type() == at::kByte && blob.is_contiguous(), "dequantize: blob must be contiguous uint8");
  spx::Segment s{blob.data_ptr<uint8_t>(), fmt, n, k, offset, sbg};
  TORCH_CHECK(blob.numel() == s.panels() * s.panel_bytes(), "dequantize: blob size does not match the format");
  const at::Tensor ids = row_ids.to(at::kLong).contiguous();
  const int64_t* idp = ids.data_ptr<int64_t>();
  const int64_t rows = ids.numel();
  for (int64_t i = 0; i < rows; ++i) TORCH_CHECK(idp[i] >= 0 && idp[i] < n, "dequantize: row id out of range");
  at::Tensor out;
  if (out_opt.has_value()) {
    out = *out_opt;
    TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(0) == rows &&
                out.size(1) == k, "dequantize: out must be a contiguous float32 [rows, k]");
  } else {
    out = at::empty({rows, k}, at::dtype(at::kFloat));
  }
  float* op = out.data_ptr<float>();
  std::vector<int64_t> starts;  // runs of ids i, i + 1, ... within one panel
  for (int64_t i = 0; i < rows; ++i)
    if (i == 0 || idp[i] != idp[i - 1] + 1 || idp[i] % spx::kPanel == 0) starts.push_back(i);
  starts.push_back(rows);
  const int64_t runs = static_cast<int64_t>(starts.size()) - 1;
  at::parallel_for(0, runs, 4, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const int64_t i = starts[r], len = starts[r + 1] - i, id = idp[i];
      const int c0 = static_cast<int>(id % spx::kPanel);
      spx::dequantize_channels(s, id / spx::kPanel, c0, c0 + static_cast<int>(len), op + i * k, k);
    }
  });
  return out;
}

// The activation quantization alone (tests compare it with a Python reference and across paths).
std::vector<at::Tensor> quantize_activations(const at::Tensor& x, int64_t path_id) {
  const spx::Path path = checked_path(path_id);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % 32 == 0 && x.size(1) > 0,
              "quantize_activations: x must be float32 [M, K] with K a positive multiple of 32");
  QuantizedRows a = quantize(path, x.contiguous(), x.size(1), spx::PreOp{});
  return {a.q8, a.d8, a.s16};
}

// The per-256 activations alone (K a multiple of 256): codes, scales, sums of 16 and of 32.
std::vector<at::Tensor> quantize_activations256(const at::Tensor& x, int64_t path_id) {
  const spx::Path path = checked_path(path_id);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % 256 == 0 && x.size(1) > 0,
              "quantize_activations256: x must be float32 [M, K] with K a positive multiple of 256");
  QuantizedRows a = quantize(path, x.contiguous(), x.size(1), spx::PreOp{}, false, true);
  return {a.kq8, a.kd, a.ks16, a.ks32};
}

at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& mask,
                  int64_t path_id, double scale, const c10::optional<at::Tensor>& sinks, double softcap,
                  const c10::optional<at::Tensor>& ends, int64_t lead) {
  const spx::Path path = checked_path(path_id);
  TORCH_CHECK(softcap >= 0 && std::isfinite(softcap), "attend: softcap must be finite and >= 0 (0: none)");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "attend: q [H,T,D], k and v [Hkv,S,D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat, "attend: q must be float32");
  const bool q8 = k.scalar_type() == at::kChar;
  TORCH_CHECK((k.scalar_type() == at::kBFloat16 || q8) && v.scalar_type() == k.scalar_type(),
              "attend: k and v must be bfloat16 (or int8 q8 rows)");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(1) == v.size(2),
              "attend: k and v rows must be contiguous");
  const at::Tensor qc = q.contiguous();
  spx::Attention pb{};
  pb.q8 = q8;
  pb.heads = qc.size(0);
  pb.t = qc.size(1);
  pb.d = qc.size(2);
  pb.kv_heads = k.size(0);
  pb.s = k.size(1);
  TORCH_CHECK(pb.kv_heads > 0 && pb.heads % pb.kv_heads == 0, "attend: query heads must be a multiple of K/V heads");
  const int64_t width = q8 ? 2 * spx::q8_row_units(pb.d) : pb.d;  // a row in k's elements
  TORCH_CHECK(!q8 || (pb.d % spx::kQ8Group == 0 && k.stride(0) % 2 == 0 && v.stride(0) % 2 == 0),
              "attend: q8 rows need head_dim a multiple of 32");
  TORCH_CHECK(pb.d % 2 == 0 && pb.d > 0 && k.size(2) == width && v.size(2) == width && v.size(1) == pb.s &&
                  v.size(0) == pb.kv_heads,
              "attend: shapes");
  at::Tensor mc;
  if (mask.has_value() && mask->defined()) {
    mc = mask->to(at::kBool).contiguous();
    TORCH_CHECK(mc.dim() == 2 && mc.size(0) == pb.t && mc.size(1) >= pb.t && mc.size(1) <= pb.s, "attend: mask [T, M]");
    pb.m = mc.size(1);
    pb.mask = mc.data_ptr<bool>();
  } else {
    TORCH_CHECK(pb.t <= pb.s, "attend: more new tokens than cache slots");
    pb.m = pb.t;
    pb.mask = nullptr;
  }
  pb.q = qc.data_ptr<float>();
  pb.k = static_cast<const uint16_t*>(k.data_ptr());
  pb.v = static_cast<const uint16_t*>(v.data_ptr());
  pb.k_head_stride = q8 ? k.stride(0) / 2 : k.stride(0);  // in 16-bit units
  pb.v_head_stride = q8 ? v.stride(0) / 2 : v.stride(0);
  pb.scale = scale > 0 ? static_cast<float>(scale) : 1.f / std::sqrt(static_cast<float>(pb.d));
  pb.softcap = static_cast<float>(softcap);
  at::Tensor sc;
  if (sinks.has_value() && sinks->defined()) {
    sc = sinks->to(at::kFloat).contiguous();
    TORCH_CHECK(sc.dim() == 1 && sc.size(0) == pb.heads, "attend: sinks [H]");
    pb.sinks = sc.data_ptr<float>();
  }
  at::Tensor ec;
  if (ends.has_value() && ends->defined()) {  // a window's numbers (attention.h): each token's, and key 0's
    ec = ends->to(at::kLong).contiguous();
    TORCH_CHECK(ec.dim() == 1 && ec.size(0) == pb.t && lead >= 0, "attend: ends [T] and lead >= 0");
    const int64_t* e = ec.data_ptr<int64_t>();
    for (int64_t i = 0; i < pb.t; ++i) {  // a token's list must be numbered from 0 on at least
      const int64_t seen = spx::visible_keys(pb, i);
      TORCH_CHECK(e[i] >= seen - 1, "attend: token ", i, " sees ", seen, " keys, more than its number ", e[i], " + 1");
    }
    pb.ends = e;
    pb.lead = lead;
  } else {
    TORCH_CHECK(lead == 0, "attend: lead without ends");
  }
  at::Tensor out = at::empty({pb.heads, pb.t, pb.d}, qc.options());
  pb.out = out.data_ptr<float>();
  // Items from a shared counter, most work first: threads finish together on any causal shape, and
  // a decode step's long cache is read in pieces by every thread (attention.h).
  const int threads = at::get_num_threads();
  const spx::AttentionPlan plan = spx::plan_attention(pb, threads);
  const int64_t count = static_cast<int64_t>(plan.items.size());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(threads, count), 1, [&](int64_t, int64_t) {
    for (int64_t i; (i = next.fetch_add(1)) < count;) spx::attend_item(path, pb, plan, i);
  });
  return out;
}

at::Tensor rope_store(const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                      const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm, double eps,
                      at::Tensor& k_cache, at::Tensor& v_cache, int64_t start,
                      const c10::optional<at::Tensor>& k_offset) {
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat && h.is_contiguous(), "rope_store: h [T, (H+2Hkv)D]");
  const bool q8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK((k_cache.scalar_type() == at::kBFloat16 || q8) && v_cache.scalar_type() == k_cache.scalar_type() &&
                  k_cache.dim() == 3 && k_cache.stride(2) == 1 && k_cache.stride(1) == k_cache.size(2) &&
                  v_cache.stride(2) == 1 && v_cache.stride(1) == v_cache.size(2) && v_cache.size(2) == k_cache.size(2),
              "rope_store: bfloat16 (or int8 q8) caches [Hkv, capacity, D] with contiguous rows");
  // A q8 row of D values is D + D/16 bytes (kv_q8.h).
  const int64_t t = h.size(0), kvh = k_cache.size(0), d = q8 ? k_cache.size(2) * 16 / 17 : k_cache.size(2);
  TORCH_CHECK(!q8 || (d % spx::kQ8Group == 0 && 2 * spx::q8_row_units(d) == k_cache.size(2) &&
                      k_cache.stride(0) % 2 == 0 && v_cache.stride(0) % 2 == 0),
              "rope_store: q8 rows of a head_dim that is a multiple of 32");
  TORCH_CHECK(h.size(1) == (heads + 2 * kvh) * d && d % 2 == 0, "rope_store: h width does not match the heads");
  TORCH_CHECK(d <= spx::kMaxHeadDim, "rope_store: head_dim above ", spx::kMaxHeadDim);
  TORCH_CHECK(start >= 0 && start + t <= k_cache.size(1) && start + t <= v_cache.size(1),
              "rope_store: slots past the cache's capacity");
  const at::Tensor cc = cos.contiguous(), sc = sin.contiguous();
  const int64_t rot = t > 0 ? cc.numel() / t : d;  // partial rotary: cos/sin [T, rot]
  TORCH_CHECK(cc.scalar_type() == at::kFloat && sc.scalar_type() == at::kFloat && cc.numel() == t * rot &&
                  sc.numel() == t * rot && rot <= d && rot % 2 == 0 && rot > 0,
              "rope_store: cos/sin float32 [T, R], R <= D even");
  at::Tensor qn, kn;
  if (q_norm.has_value() && q_norm->defined()) qn = q_norm->contiguous();
  if (k_norm.has_value() && k_norm->defined()) kn = k_norm->contiguous();
  TORCH_CHECK((!qn.defined() || (qn.scalar_type() == at::kFloat && qn.numel() == d)) &&
                  (!kn.defined() || (kn.scalar_type() == at::kFloat && kn.numel() == d)),
              "rope_store: q_norm/k_norm float32 [D]");
  at::Tensor ko;
  if (k_offset.has_value() && k_offset->defined()) ko = k_offset->contiguous();
  TORCH_CHECK(!ko.defined() || (ko.scalar_type() == at::kFloat && ko.numel() == kvh * d),
              "rope_store: k_offset float32 [Hkv, D]");
  at::Tensor q = at::empty({heads, t, d}, h.options());
  spx::Rope op{h.data_ptr<float>(), cc.data_ptr<float>(), sc.data_ptr<float>(),
               qn.defined() ? qn.data_ptr<float>() : nullptr, kn.defined() ? kn.data_ptr<float>() : nullptr,
               static_cast<float>(eps), t, heads, kvh, d, start, q.data_ptr<float>(),
               static_cast<uint16_t*>(k_cache.data_ptr()), static_cast<uint16_t*>(v_cache.data_ptr()),
               q8 ? k_cache.stride(0) / 2 : k_cache.stride(0), q8 ? v_cache.stride(0) / 2 : v_cache.stride(0),
               rot, q8};
  op.k_offset = ko.defined() ? ko.data_ptr<float>() : nullptr;  // a q8 cache's only (rope.h)
  at::parallel_for(0, t, 1, [&](int64_t b, int64_t e) { spx::rope_tokens(op, b, e); });
  return q;
}

// A family's row operations (core/family.h), row by row: the per-layer forward's, with the
// whole-step call's bits.
at::Tensor family_rows(const at::Tensor& x, int64_t width, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) == width, what, ": float32 rows [T, ", width,
              "]");
  return x.contiguous();
}

const float* family_weight(const c10::optional<at::Tensor>& w, int64_t k, at::Tensor& keep, const char* what) {
  if (!w.has_value() || !w->defined()) return nullptr;
  keep = w->contiguous();
  TORCH_CHECK(keep.scalar_type() == at::kFloat && keep.numel() == k, what, ": a float32 weight of the rows' width");
  return keep.data_ptr<float>();
}

at::Tensor rms_rows(const at::Tensor& x, const c10::optional<at::Tensor>& w, double eps) {
  const at::Tensor xc = family_rows(x, x.dim() == 2 ? x.size(1) : -1, "rms_rows");
  at::Tensor wk;
  const float* wp = family_weight(w, xc.size(1), wk, "rms_rows");
  at::Tensor out = at::empty_like(xc);
  const int64_t k = xc.size(1);
  at::parallel_for(0, xc.size(0), 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r)
      spx::rms_row(xc.data_ptr<float>() + r * k, k, wp, static_cast<float>(eps), out.data_ptr<float>() + r * k);
  });
  return out;
}

at::Tensor post_residual(const at::Tensor& x, const at::Tensor& y, const c10::optional<at::Tensor>& norm, double eps,
                         double scale) {
  const at::Tensor xc = family_rows(x, x.dim() == 2 ? x.size(1) : -1, "post_residual");
  const at::Tensor yc = family_rows(y, xc.size(1), "post_residual");
  TORCH_CHECK(yc.size(0) == xc.size(0), "post_residual: x and y must have the same rows");
  at::Tensor nk;
  const int64_t k = xc.size(1);
  const float* np = family_weight(norm, k, nk, "post_residual");
  at::Tensor out = at::empty_like(xc);
  at::parallel_for(0, xc.size(0), 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r)
      spx::residual_row(xc.data_ptr<float>() + r * k, yc.data_ptr<float>() + r * k, k, np, static_cast<float>(eps),
                        static_cast<float>(scale), out.data_ptr<float>() + r * k);
  });
  return out;
}

at::Tensor gelu_mul(const at::Tensor& gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) % 2 == 0, "gelu_mul: float32 rows [T, 2 * inter]");
  const at::Tensor xc = family_rows(gu, gu.size(1), "gelu_mul");
  const int64_t inter = xc.size(1) / 2;
  at::Tensor out = at::empty({xc.size(0), inter}, xc.options());
  at::parallel_for(0, xc.size(0), 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) spx::gelu_mul_row(xc.data_ptr<float>() + r * 2 * inter, inter, out.data_ptr<float>() + r * inter);
  });
  return out;
}

// LFM2's short convolution of rows h [T, 3 * hidden] (B, C, x) over `state` [slots, hidden] (a layer's buffer):
// each row's B * x goes to its slot taps[r, kernel - 1], then out [T, hidden] reads the slots taps[r] (-1: none).
at::Tensor conv_rows(const at::Tensor& h, at::Tensor& state, const at::Tensor& taps, const at::Tensor& w) {
  TORCH_CHECK(state.dim() == 2 && state.scalar_type() == at::kFloat && state.is_contiguous(),
              "conv_rows: a contiguous float32 state [slots, hidden]");
  const int64_t hidden = state.size(1), slots = state.size(0);
  const at::Tensor hc = family_rows(h, 3 * hidden, "conv_rows");
  TORCH_CHECK(w.dim() == 2 && w.size(0) == hidden && w.scalar_type() == at::kFloat, "conv_rows: w [hidden, kernel]");
  const int64_t kernel = w.size(1), t = hc.size(0);
  const at::Tensor tc = taps.to(at::kLong).contiguous();
  TORCH_CHECK(tc.dim() == 2 && tc.size(0) == t && tc.size(1) == kernel, "conv_rows: taps [T, kernel]");
  const at::Tensor wc = w.contiguous();
  const int64_t* tp = tc.data_ptr<int64_t>();
  for (int64_t i = 0; i < t * kernel; ++i)
    TORCH_CHECK(tp[i] >= -1 && tp[i] < slots, "conv_rows: a tap outside the state's ", slots, " slots");
  float* sp = state.data_ptr<float>();
  const float* hp = hc.data_ptr<float>();
  for (int64_t r = 0; r < t; ++r) {
    const int64_t own = tp[r * kernel + kernel - 1];
    TORCH_CHECK(own >= 0, "conv_rows: each row needs its own slot");
    spx::conv_input_row(hp + r * 3 * hidden, hidden, sp + own * hidden);
  }
  at::Tensor out = at::empty({t, hidden}, hc.options());
  at::parallel_for(0, t, 1, [&](int64_t b, int64_t e) {
    std::vector<const float*> rows(kernel);
    for (int64_t r = b; r < e; ++r) {
      for (int64_t j = 0; j < kernel; ++j) {
        const int64_t slot = tp[r * kernel + j];
        rows[j] = slot >= 0 ? sp + slot * hidden : nullptr;
      }
      spx::conv_row(hp + r * 3 * hidden, hidden, rows.data(), wc.data_ptr<float>(), kernel,
                    out.data_ptr<float>() + r * hidden);
    }
  });
  return out;
}

// A mixture of experts' products for rows x [m, hidden] routed to `experts` [m, used] under
// `weights` [m, used] (experts.py, Experts.forward_rows): each used expert's gate/up product over
// the rows that chose it (rmsnorm(x) with weight `norm` quantized per row), silu(gate) * up
// quantized per row into its down product, and each row's outputs summed in its own rank order,
// w0 * y0 + w1 * y1 + ... (one product and one sum at a time, float32: PyTorch's elementwise bits).
// The experts' products run in two parallel regions, all experts' units from one counter: a
// one-row step makes one call a layer, not two products an expert from Python. Expert e of a
// stacked [count * n, k] blob is its panels' byte range (the kernels' layout is panel-major).
struct Product {
  std::vector<spx::Segment> segs;
  std::vector<int64_t> first_panel{0};
  QuantizedRows a;
  spx::Linear lin{};
  spx::LinearWork work{};
};

void run_products(spx::Path path, std::vector<Product>& ps) {
  const int threads = at::get_num_threads();
  std::vector<int64_t> base{0};
  for (Product& p : ps) {
    p.work = spx::plan_linear(path, p.lin, p.first_panel.back(), threads);
    base.push_back(base.back() + p.work.units());
  }
  std::atomic<int64_t> next{0};
  constexpr int64_t kScratch = spx::kRowBlock * spx::kPanel, kPage = 1024;
  std::vector<float> scratch(static_cast<size_t>(threads) * (kScratch + kPage) + kPage);
  float* first = scratch.data() + ((kPage - (reinterpret_cast<uintptr_t>(scratch.data()) / 4) % kPage) % kPage);
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t) {
    float* acc = first + (b % threads) * (kScratch + kPage) + 16 * (b % threads);
    size_t i = 0;
    for (int64_t u; (u = next.fetch_add(1)) < base.back();) {
      while (u >= base[i + 1]) ++i;  // units come in increasing order: each thread walks forward
      spx::linear_unit(path, ps[i].lin, ps[i].work, u - base[i], acc);
    }
  });
}

spx::Segment expert_segment(const at::Tensor& blob, int64_t fmt, int64_t n, int64_t k, int64_t offset, int64_t sbg,
                            int64_t count, int64_t e, const char* what) {
  spx::FormatInfo fi{};
  TORCH_CHECK(spx::format_info(fmt, sbg, &fi) && k % fi.superblock == 0, "experts: bad format of ", what);
  spx::Segment s{blob.data_ptr<uint8_t>(), fmt, n, k, offset, sbg};
  TORCH_CHECK(n % spx::kPanel == 0 && blob.scalar_type() == at::kByte && blob.is_contiguous() &&
                  blob.numel() == count * s.panels() * s.panel_bytes(),
              "experts: ", what, " must be a contiguous uint8 blob of ", count, " experts of ", n, " x ", k);
  s.blob += e * s.panels() * s.panel_bytes();
  return s;
}

// One product a used expert, y = pre(x rows) . W_e^T into rows [start, start + c) of y.
void add_product(std::vector<Product>& ps, spx::Path path, const at::Tensor& xe, int64_t k, const spx::PreOp& op,
                 std::vector<spx::Segment> segs, float* y, int64_t ldy, const float* bias = nullptr) {
  Product p;
  bool k256 = false;
  for (const spx::Segment& s : segs) {
    p.first_panel.push_back(p.first_panel.back() + s.panels());
    k256 = k256 || spx::k256_segment(s.fmt, s.sbg);
  }
  p.segs = std::move(segs);
  p.a = quantize(path, xe, k, op, false, k256);
  ps.push_back(std::move(p));
  Product& q = ps.back();
  q.lin = spx::Linear{q.segs.data(), q.first_panel.data(), static_cast<int64_t>(q.segs.size()), q.a.rows(),
                      xe.size(0), y, ldy, bias, nullptr};
}

// An optional per-expert bias [count, n] as float32, or null.
const float* expert_bias(const c10::optional<at::Tensor>& b, at::Tensor& keep, int64_t count, int64_t n,
                         const char* what) {
  if (!b.has_value() || !b->defined()) return nullptr;
  keep = b->to(at::kFloat).contiguous();
  TORCH_CHECK(keep.dim() == 2 && keep.size(0) == count && keep.size(1) == n, "experts: ", what, " bias must be [",
              count, ", ", n, "]");
  return keep.data_ptr<float>();
}

at::Tensor experts_rows(const at::Tensor& x, const c10::optional<at::Tensor>& norm, double eps,
                        const at::Tensor& experts, const at::Tensor& weights, const std::vector<at::Tensor>& blobs,
                        const std::vector<int64_t>& fmts, const std::vector<int64_t>& offsets,
                        const std::vector<int64_t>& sbgs, int64_t count, int64_t ff, int64_t path_id,
                        const c10::optional<at::Tensor>& gate_up_bias, const c10::optional<at::Tensor>& down_bias,
                        int64_t act_kind) {
  const spx::Path path = checked_path(path_id);
  TORCH_CHECK(act_kind >= 0 && act_kind < spx::kExpertActs, "experts: unknown activation");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "experts: x must be float32 [m, hidden]");
  const at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), hidden = xc.size(1);
  TORCH_CHECK(experts.dim() == 2 && experts.size(0) == m && experts.scalar_type() == at::kLong &&
                  weights.sizes() == experts.sizes() && weights.scalar_type() == at::kFloat,
              "experts: experts int64 and weights float32, both [m, used]");
  TORCH_CHECK(blobs.size() == 3 && fmts.size() == 3 && offsets.size() == 3 && sbgs.size() == 3,
              "experts: the gate, up and down blobs");
  const at::Tensor ec = experts.contiguous(), wc = weights.contiguous();
  const int64_t used = ec.size(1), slots = m * used;
  const int64_t* ep = ec.data_ptr<int64_t>();
  std::vector<int64_t> start(count + 1, 0), order(slots);  // the slots (row, rank) grouped by expert, stable
  for (int64_t i = 0; i < slots; ++i) {
    TORCH_CHECK(ep[i] >= 0 && ep[i] < count, "experts: an expert index out of range");
    ++start[ep[i] + 1];
  }
  for (int64_t e = 0; e < count; ++e) start[e + 1] += start[e];
  std::vector<int64_t> fill(start.begin(), start.end() - 1), where(slots);
  for (int64_t i = 0; i < slots; ++i) order[fill[ep[i]]++] = i;
  for (int64_t s = 0; s < slots; ++s) where[order[s]] = s;
  spx::PreOp pre;
  at::Tensor norm_keep;
  pre.norm = optional_float(norm, norm_keep, hidden, "norm");
  pre.eps = static_cast<float>(eps);
  at::Tensor gu = at::empty({slots, 2 * ff}, xc.options()), ys = at::empty({slots, hidden}, xc.options());
  at::Tensor gub_keep, db_keep;
  const float* gub = expert_bias(gate_up_bias, gub_keep, count, 2 * ff, "gate_up");
  const float* db = expert_bias(down_bias, db_keep, count, hidden, "down");
  std::vector<Product> ps;
  ps.reserve(count);
  for (int64_t e = 0; e < count; ++e) {
    const int64_t c = start[e + 1] - start[e];
    if (c == 0) continue;
    at::Tensor xe = xc;
    if (m > 1) {
      at::Tensor ids = at::empty({c}, ec.options());
      for (int64_t j = 0; j < c; ++j) ids.data_ptr<int64_t>()[j] = order[start[e] + j] / used;
      xe = xc.index_select(0, ids);
    }
    add_product(ps, path, xe, hidden, pre,
                {expert_segment(blobs[0], fmts[0], ff, hidden, offsets[0], sbgs[0], count, e, "gate"),
                 expert_segment(blobs[1], fmts[1], ff, hidden, offsets[1], sbgs[1], count, e, "up")},
                gu.data_ptr<float>() + start[e] * 2 * ff, 2 * ff, gub != nullptr ? gub + e * 2 * ff : nullptr);
  }
  run_products(path, ps);
  std::vector<Product> downs;
  downs.reserve(count);
  spx::PreOp act;
  at::Tensor h = gu;  // the down products' input: [gate | up] with SiLU fused into their quantization
  if (act_kind == static_cast<int64_t>(spx::ExpertAct::SwigluOai)) {
    h = at::empty({slots, ff}, xc.options());
    at::parallel_for(0, slots, 16, [&](int64_t b, int64_t e) {
      for (int64_t s = b; s < e; ++s) spx::swiglu_oai_row(gu.data_ptr<float>() + s * 2 * ff, ff, h.data_ptr<float>() + s * ff);
    });
  } else {
    act.silu_mul = true;
  }
  for (int64_t e = 0; e < count; ++e) {
    const int64_t c = start[e + 1] - start[e];
    if (c == 0) continue;
    add_product(downs, path, h.narrow(0, start[e], c), ff, act,
                {expert_segment(blobs[2], fmts[2], hidden, ff, offsets[2], sbgs[2], count, e, "down")},
                ys.data_ptr<float>() + start[e] * hidden, hidden, db != nullptr ? db + e * hidden : nullptr);
  }
  run_products(path, downs);
  at::Tensor out = at::empty({m, hidden}, xc.options());
  const float* yp = ys.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  at::parallel_for(0, m, 1, [&](int64_t b, int64_t e) {
    std::vector<const float*> rows(used);
    for (int64_t r = b; r < e; ++r) {
      for (int64_t j = 0; j < used; ++j) rows[j] = yp + where[r * used + j] * hidden;
      spx::weighted_sum_row(rows.data(), wp + r * used, used, hidden, out.data_ptr<float>() + r * hidden);
    }
  });
  return out;
}

// Router logits [m, count] -> each row's top `used` experts (int64, rank order) and weights (float32)
// by weighting `kind` (core/experts.h: experts.py's WEIGHTINGS with bits of their own).
// gpt-oss's clamped SwiGLU of rows [gate | up] [m, 2 ff] -> [m, ff] (core/experts.h).
at::Tensor swiglu_oai(const at::Tensor& gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.scalar_type() == at::kFloat && gu.size(1) % 2 == 0,
              "swiglu_oai: rows [m, 2 ff] of float32");
  const at::Tensor gc = gu.contiguous();
  const int64_t ff = gc.size(1) / 2;
  at::Tensor out = at::empty({gc.size(0), ff}, gc.options());
  at::parallel_for(0, gc.size(0), 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) spx::swiglu_oai_row(gc.data_ptr<float>() + r * 2 * ff, ff, out.data_ptr<float>() + r * ff);
  });
  return out;
}

// Qwen2-MoE's shared expert into the experts' sums: out [m, hidden] + sigmoid(gate [m]) * s [m, hidden], a new
// tensor (core/experts.h's shared_expert_add_row, which the whole-step call runs too).
at::Tensor shared_expert_add(const at::Tensor& out, const at::Tensor& gate, const at::Tensor& s) {
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && s.sizes() == out.sizes() &&
                  s.scalar_type() == at::kFloat && gate.scalar_type() == at::kFloat && gate.numel() == out.size(0),
              "shared_expert_add: out and s float32 [m, hidden], gate float32 [m]");
  at::Tensor res = out.contiguous().clone();
  const at::Tensor gc = gate.contiguous(), sc = s.contiguous();
  const int64_t hidden = res.size(1);
  at::parallel_for(0, res.size(0), 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r)
      spx::shared_expert_add_row(res.data_ptr<float>() + r * hidden, gc.data_ptr<float>()[r],
                                 sc.data_ptr<float>() + r * hidden, hidden);
  });
  return res;
}

std::tuple<at::Tensor, at::Tensor> route_rows(const at::Tensor& logits, int64_t used, int64_t kind,
                                              const c10::optional<at::Tensor>& select_bias) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "route: logits must be float32 [m, experts]");
  const at::Tensor lc = logits.contiguous();
  const int64_t m = lc.size(0), count = lc.size(1);
  TORCH_CHECK(used >= 1 && used <= count && kind >= 0 && kind < spx::kWeightings, "route: bad top-k or weighting");
  const bool biased = spx::biased(static_cast<spx::Weighting>(kind));
  TORCH_CHECK(select_bias.has_value() == biased, "route: a selection bias comes with the biased weighting, and only with it");
  at::Tensor bias;
  if (biased) {
    bias = select_bias->contiguous();
    TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.numel() == count, "route: the selection bias is float32 [experts]");
  }
  at::Tensor experts = at::empty({m, used}, lc.options().dtype(at::kLong)), weights = at::empty({m, used}, lc.options());
  std::vector<float> scratch(2 * count);
  std::vector<int64_t> iscratch(count);
  for (int64_t r = 0; r < m; ++r)
    spx::route_row(lc.data_ptr<float>() + r * count, count, used, static_cast<spx::Weighting>(kind),
                   biased ? bias.data_ptr<float>() : nullptr, experts.data_ptr<int64_t>() + r * used,
                   weights.data_ptr<float>() + r * used, scratch.data(), iscratch.data());
  return {experts, weights};
}

}  // namespace

void bind_step(py::module& m);  // step_ops.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qlinear", &qlinear, "quantized linear over weight segments", py::arg("x"), py::arg("blobs"), py::arg("fmts"),
        py::arg("ns"), py::arg("offsets"), py::arg("sbgs"), py::arg("bias"), py::arg("norm"), py::arg("eps"),
        py::arg("silu_mul"), py::arg("residual"), py::arg("path"), py::arg("out") = py::none(),
        py::arg("center") = false);
  m.def("swiglu_oai", &swiglu_oai, "gpt-oss's clamped SwiGLU of rows [gate | up] (core/experts.h)");
  m.def("shared_expert_add", &shared_expert_add, "a shared expert's rows into the experts' sums under its sigmoid gate");
  m.def("route_rows", &route_rows, "router logits -> each row's top-k experts and weights (core/experts.h)",
        py::arg("logits"), py::arg("used"), py::arg("kind"), py::arg("select_bias") = py::none());
  m.def("experts_rows", &experts_rows, "a mixture of experts' products and weighted sum (experts.py)");
  m.def("dequantize", &dequantize, "dequantize rows of a weight blob", py::arg("blob"), py::arg("fmt"), py::arg("n"),
        py::arg("k"), py::arg("offset"), py::arg("sbg"), py::arg("row_ids"), py::arg("out") = py::none());
  m.def("quantize_activations", &quantize_activations, "int8 activations, one scale per 32");
  m.def("attend", &attend,
        "row-independent attention of new tokens over a bfloat16 KV cache (and sinks [H], soft-capped scores)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("mask"), py::arg("path"), py::arg("scale") = 0.0,
        py::arg("sinks") = py::none(), py::arg("softcap") = 0.0, py::arg("ends") = py::none(), py::arg("lead") = 0);
  m.def("rms_rows", &rms_rows, "RMSNorm of whole rows (a family's q/k norms)");
  m.def("conv_rows", &conv_rows, "LFM2's short convolution of rows over a layer's state (family.h)");
  m.def("post_residual", &post_residual, "x + scale * post_norm(y), row by row (a family's residual add)");
  m.def("gelu_mul", &gelu_mul, "GeGLU with the tanh GELU, row by row");
  m.def("quantize_activations256", &quantize_activations256, "int8 activations, one scale per 256 (the K-quants')");
  m.def("set_k256", &spx::set_k256, "the K-quant formats (a mask of bit fmt) whose activations are quantized per 256");
  m.def("k256_formats", &spx::k256_formats, "the mask of K-quant formats quantizing activations per 256");
  m.def("rope_store", &rope_store, "rotate the new queries and keys, store keys and values in the cache",
        py::arg("h"), py::arg("cos"), py::arg("sin"), py::arg("heads"), py::arg("q_norm"), py::arg("k_norm"),
        py::arg("eps"), py::arg("k_cache"), py::arg("v_cache"), py::arg("start"), py::arg("k_offset") = py::none());
  m.def("cpu_paths", &cpu_paths, "the kernel paths this CPU runs, slowest first (amx-emulated, a test path, not listed)");
  m.def("amx_status", &amx_status, "why the amx path cannot run here, or None where it runs");
  m.def("has_avx512_bf16", &spx::cpu_has_avx512_bf16, "whether the avx512 path's attention uses AVX512-BF16");
  m.def("bf16_dot_pays", &spx::avx512_bf16_dot_pays,
        "whether VDPBF16PS beats FMAs here (else attention's many-row runs use two FMAs a pair)");
  bind_step(m);
}
