// The kernel core's exactness tests without PyTorch, for any architecture the core builds on
// (`make test-arm` cross-builds this for aarch64 and runs it under user-mode emulation):
//   1. every vector path this CPU runs gives the portable path's bits: quantized products of
//      every format (with the fused norm, SiLU, bias and residual), the activation quantization,
//      and attention over a bfloat16 cache (causal and tree masks, several head sizes);
//   2. rows are independent: a row computed alone equals the same row inside batches of 2-16;
//   3. the amx path's code on emulated tiles (amx-emulated, any CPU) is among the paths of 1 and 2,
//      and its detection refuses AMX at every step a CPU, an OS or a VM can deny it.
//   4. the whole-step forward (step.h) of a small random model, one row and a tree level, with
//      and without a family's switches (family.h: post norms, GeGLU, whole-row q/k norms, partial
//      rotary, a score scale, a residual multiplier, a windowed layer).
// `--detected-only` leaves out amx-emulated (a second run on another CPU of the same build need not
// check the emulated tiles again, their code the same on both); `--paths-only` prints the detected
// paths and stops (the aarch64 build without dot products: its only path, portable, is checked by
// the run with them, the same machine code).
// Exit status 0 when every check passes; each failure is printed.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "../core/attention.h"
#include "../core/cpu.h"
#include "../core/fastexp.h"
#include "../core/half.h"
#include "../core/qlinear.h"
#include "../core/step.h"

namespace {

using spx::Path;

int failures = 0, checks = 0;
std::mt19937 rng(1234);

void check(bool ok, const std::string& what) {
  ++checks;
  if (!ok) {
    ++failures;
    std::printf("FAIL %s\n", what.c_str());
  }
}

bool same_bits(const float* a, const float* b, size_t n) { return std::memcmp(a, b, n * sizeof(float)) == 0; }

std::vector<float> randn(size_t n, float scale = 1.f) {
  std::normal_distribution<float> dist(0.f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

uint16_t half_bits(float f) {  // a positive normal float as binary16, rounded down (test data only)
  int e;
  const float m = std::frexp(f, &e);  // f = m * 2^e, m in [0.5, 1)
  const int he = e - 1 + 15;
  const uint16_t man = static_cast<uint16_t>((m * 2.f - 1.f) * 1024.f);
  return static_cast<uint16_t>((he << 10) | man);
}

// A random blob in the kernel layout (qlinear.h): random codes and signed scales, sane halves;
// the float formats: normal weights of either sign, a few zeros.
std::vector<uint8_t> random_blob(const spx::Segment& shape) {
  const spx::FormatInfo fi = shape.fi();
  std::vector<uint8_t> blob(shape.panels() * shape.panel_bytes());
  if (spx::float_format(shape.fmt) || spx::bf16_dot_format(shape.fmt)) {
    const std::vector<float> w = randn(blob.size() / 2, 0.05f);
    for (size_t i = 0; i < w.size(); ++i) {
      uint16_t h = shape.fmt == spx::F16 ? half_bits(std::fabs(w[i]) + 1e-4f) : spx::float_to_bf16(w[i]);
      if (shape.fmt == spx::F16 && w[i] < 0) h |= 0x8000;
      if (i % 97 == 0) h = 0;
      if (shape.fmt == spx::BF16D && i % 89 == 0) h = static_cast<uint16_t>(0x0041 | (i & 0x8000));  // subnormal
      std::memcpy(&blob[2 * i], &h, 2);
    }
    return blob;
  }
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> scale(0.001f, 0.02f);
  for (uint8_t& b : blob) b = static_cast<uint8_t>(byte(rng));
  const int halves = shape.fmt == spx::Q4K || spx::has_minimum(shape.fmt) || shape.fmt == spx::Q2K ? 32 : 16;
  for (size_t off = 0; off < blob.size(); off += fi.bytes) {
    if (spx::e8m0_header(shape.fmt)) {  // exponents around 2^-10, and channel 0's 0..2 (the subnormal scales)
      for (int c = 0; c < 16; ++c) blob[off + c] = static_cast<uint8_t>(c == 0 ? blob[off] % 3 : 110 + blob[off + c] % 20);
      continue;
    }
    if (spx::f32_d(shape.fmt)) {  // d as float32, a quarter or an eighth of a float16's scale
      for (int c = 0; c < 16; ++c) {
        const float d = scale(rng) / 8.f;
        std::memcpy(&blob[off + 4 * c], &d, 4);
      }
      continue;
    }
    for (int i = 0; i < halves; ++i) {
      const uint16_t h = half_bits(scale(rng));
      std::memcpy(&blob[off + 2 * i], &h, 2);
    }
    if (shape.fmt == spx::Q4K)  // 6-bit scales and mins
      for (int i = 0; i < 32 * shape.sbg; ++i) blob[off + 64 + i] &= 63;
  }
  return blob;
}

struct LinearCase {
  int64_t fmt, n, k, offset, sbg;
  bool norm, silu, bias, residual;
};

std::vector<float> run_linear(Path path, const LinearCase& c, const spx::Segment& seg, const std::vector<float>& x,
                              int64_t m, const std::vector<float>& norm, const std::vector<float>& bias,
                              const std::vector<float>& res) {
  const int64_t k = c.k;
  std::vector<int8_t> q8(m * k);
  std::vector<float> d8(m * k / 32), xs(m * k / 32), scratch(k), y(m * c.n);
  std::vector<int32_t> s16(m * k / 16), s32(m * k / 32);
  std::vector<float> xf(spx::float_format(c.fmt) ? m * k : 0);
  std::vector<int8_t> q8g(m * k);
  spx::Rows rows{q8.data(), d8.data(), s16.data(), s32.data(), xs.data(), k, xf.empty() ? nullptr : xf.data(),
                 q8g.data(), m};
  std::vector<uint32_t> xb(spx::bf16_dot_format(c.fmt) ? m * k / 2 : 0);  // pair-major, as torch_ops.cpp keeps it
  if (!xb.empty()) {
    rows.xb = xb.data();
    rows.xbm = m;
  }
  // The per-256 activations where the K-quants take them (as torch_ops.cpp allocates them).
  const bool k256 = spx::k256_segment(c.fmt, c.sbg);
  std::vector<int8_t> kq8(k256 ? m * k : 0);
  std::vector<float> kd(k256 ? m * k / 256 : 0);
  std::vector<int16_t> ks16(k256 ? m * k / 16 : 0), ks32(k256 ? m * k / 32 : 0);
  if (k256) {
    rows.kq8 = kq8.data();
    rows.kd = kd.data();
    rows.ks16 = ks16.data();
    rows.ks32 = ks32.data();
  }
  spx::PreOp op;
  op.norm = c.norm ? norm.data() : nullptr;
  op.eps = 1e-6f;
  op.silu_mul = c.silu;
  spx::quantize_rows(path, x.data(), c.silu ? 2 * k : k, op, rows, 0, m, scratch.data());
  const int64_t first[2] = {0, seg.panels()};
  const spx::Linear lin{&seg, first, 1, rows, m, y.data(), c.n, c.bias ? bias.data() : nullptr,
                        c.residual ? res.data() : nullptr};
  // The units as threads would take them, here last to first: the order must not matter.
  const spx::LinearWork work = spx::plan_linear(path, lin, seg.panels(), 2);
  std::vector<float> acc(spx::kRowBlock * spx::kPanel + 16);
  float* a = acc.data() + ((16 - (reinterpret_cast<uintptr_t>(acc.data()) / 4) % 16) % 16);
  for (int64_t u = work.units() - 1; u >= 0; --u) spx::linear_unit(path, lin, work, u, a);
  return y;
}

void linear_tests(const std::vector<Path>& paths) {
  const LinearCase cases[] = {
      {spx::Q4K, 48, 512, 0, 8, false, false, true, false},  {spx::Q4K, 64, 1536, 0, 8, true, false, false, true},
      {spx::Q4K, 40, 896, 0, 7, false, true, false, false},  {spx::Q4K, 35, 96, 0, 3, false, false, true, true},
      {spx::Q4K, 33, 160, 0, 1, true, false, true, false},  // one group a super-block (widths of 32)
      {spx::Q6K, 40, 256, 0, 8, true, false, true, false},   {spx::Q6K, 32, 1536, 0, 8, false, true, false, true},
      {spx::Q8, 35, 96, 128, 1, false, false, false, false}, {spx::Q50, 33, 64, 16, 1, true, false, true, true},
      {spx::Q8, 48, 896, 128, 1, false, true, false, false}, {spx::Q50, 32, 640, 16, 1, true, false, true, true},
      {spx::Q40, 35, 96, 8, 1, false, false, true, false},   {spx::Q40, 48, 1536, 8, 1, true, false, false, true},
      {spx::IQ4NL, 33, 64, 128, 1, false, true, true, true}, {spx::IQ4NL, 40, 896, 128, 1, true, false, false, false},
      {spx::MXFP4, 40, 896, 128, 1, false, true, true, false}, {spx::MXFP4, 33, 64, 128, 1, true, false, false, true},
      {spx::Q41, 35, 96, 0, 1, true, false, true, false},    {spx::Q51, 48, 896, 0, 1, false, true, false, true},
      {spx::Q5K, 48, 512, 0, 8, true, false, true, false},   {spx::IQ4, 32, 768, 128, 8, false, true, false, true},
      {spx::Q5K, 35, 96, 0, 1, false, false, true, true},    {spx::IQ4, 33, 64, 128, 1, true, false, false, false},
      {spx::IQ3S, 40, 512, 128, 8, false, true, true, false}, {spx::IQ3S, 33, 256, 128, 8, true, false, false, true},
      {spx::IQ3XXS, 48, 512, 128, 8, true, false, true, false}, {spx::IQ2XXS, 35, 256, 128, 8, false, true, false, true},
      {spx::IQ1S, 33, 768, 128, 8, false, false, true, true},
      {spx::Q3K, 40, 512, 0, 8, true, false, true, true},    {spx::Q2K, 48, 768, 0, 8, false, true, true, false},
      {spx::IQ2XS, 40, 512, 0, 8, false, true, true, true},  {spx::IQ1M, 33, 768, 0, 8, true, false, false, true},
      {spx::IQ2XS, 35, 256, 0, 8, true, false, true, false},
      {spx::F16, 48, 512, 0, 1, false, false, true, false},  {spx::BF16, 35, 96, 0, 1, true, false, true, true},
      {spx::F16, 33, 160, 0, 1, false, true, false, true},   {spx::BF16, 64, 1536, 0, 1, true, false, false, false},
      {spx::BF16D, 35, 96, 0, 1, true, false, true, true},   {spx::BF16D, 80, 1536, 0, 1, false, true, false, false},
  };
  for (const LinearCase& c : cases) {
    const spx::Segment shape{nullptr, c.fmt, c.n, c.k, c.offset, c.sbg};
    const std::vector<uint8_t> blob = random_blob(shape);
    spx::Segment seg = shape;
    seg.blob = blob.data();
    const int64_t m = 150;  // tiles, the rows kernel and its blocks of 64 rows
    const std::vector<float> x = randn(m * (c.silu ? 2 : 1) * c.k, 3.f), norm = randn(c.k), bias = randn(c.n),
                             res = randn(m * c.n);
    const std::string name = "linear fmt " + std::to_string(c.fmt) + " n " + std::to_string(c.n) + " k " +
                             std::to_string(c.k);
    const std::vector<float> ref = run_linear(Path::Portable, c, seg, x, m, norm, bias, res);
    for (Path p : paths) {
      const std::vector<float> y = run_linear(p, c, seg, x, m, norm, bias, res);
      check(same_bits(y.data(), ref.data(), y.size()), name + ": " + spx::path_name(p) + " = portable");
      // rows alone and in batches of 1..65 from a few offsets
      for (int64_t rows : {1, 2, 3, 5, 9, 12, 16, 65})
        for (int64_t r0 : {int64_t{0}, m - rows}) {
          const int64_t w = c.silu ? 2 * c.k : c.k;
          std::vector<float> xs(x.begin() + r0 * w, x.begin() + (r0 + rows) * w);
          std::vector<float> rs(res.begin() + r0 * c.n, res.begin() + (r0 + rows) * c.n);
          const std::vector<float> part = run_linear(p, c, seg, xs, rows, norm, bias, rs);
          check(same_bits(part.data(), ref.data() + r0 * c.n, part.size()),
                name + ": " + spx::path_name(p) + " rows " + std::to_string(r0) + "+" + std::to_string(rows));
        }
    }
  }
}

std::vector<uint16_t> random_bf16(size_t n) {
  const std::vector<float> f = randn(n);
  std::vector<uint16_t> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = spx::float_to_bf16(f[i]);
  return out;
}

// Whether two plans hold the same whole items in the same order (no pieces in either).
bool same_items(const spx::AttentionPlan& a, const spx::AttentionPlan& b) {
  if (!a.splits.empty() || !b.splits.empty() || a.items.size() != b.items.size()) return false;
  for (size_t i = 0; i < a.items.size(); ++i) {
    const spx::AttentionItem &x = a.items[i], &y = b.items[i];
    if (x.kvh != y.kvh || x.t0 != y.t0 || x.t1 != y.t1 || x.split != y.split) return false;
  }
  return true;
}

bool same_kernel(const spx::BlockKernel& a, const spx::BlockKernel& b) {
  return a.block == b.block && a.finish == b.finish && a.workspace == b.workspace && a.dequant == b.dequant &&
         a.run == b.run && a.run_rows == b.run_rows && a.fold == b.fold;
}

// The plan for `threads` run on this thread, its items in order or backwards (a long cache read in
// pieces, the last piece to finish folding them): the bits of one thread reading it all.
std::vector<float> run_attention(Path path, spx::Attention pb, int threads = 1, bool backwards = false) {
  std::vector<float> out(pb.heads * pb.t * pb.d);
  pb.out = out.data();
  const spx::AttentionPlan plan = spx::plan_attention(pb, threads);
  const int64_t n = static_cast<int64_t>(plan.items.size());
  for (int64_t i = 0; i < n; ++i) spx::attend_item(path, pb, plan, backwards ? n - 1 - i : i);
  return out;
}

void attention_tests(const std::vector<Path>& paths) {
  struct Case {
    int64_t heads, kv, t, s, d;
    bool tree, sinks = false;  // sinks: a learned logit a head in the softmax (gpt-oss)
    float softcap = 0.f;       // > 0: soft-capped scores (Gemma 2's 50; a small cap reaches tanh's outer form)
  };
  const Case cases[] = {{12, 2, 1, 100, 128, false}, {12, 2, 9, 700, 128, true}, {4, 1, 20, 77, 64, false},
                        {6, 2, 3, 35, 32, true},     {4, 2, 5, 66, 96, true},   {2, 1, 17, 1000, 128, false},
                        {8, 2, 1, 90, 64, false, true}, {8, 2, 9, 300, 64, true, true},
                        {12, 2, 1, 5000, 128, false}, {7, 1, 9, 2600, 64, true}, {4, 1, 2, 1600, 64, false},
                        {8, 2, 1, 2600, 64, false, true},  // sinks over a cache read in pieces
                        // prefill chunks: many rows a pass, rows across the lanes where a path has that
                        // (whole and part-filled groups of 16 rows, tiles of several groups, chunk folds)
                        {6, 1, 64, 1100, 128, false}, {8, 1, 40, 900, 64, false}, {6, 2, 8, 600, 128, false},
                        {7, 1, 48, 1100, 64, false, true}, {6, 1, 20, 1300, 128, true},
                        // head size 256 (Gemma 2 and 3): a decode step, a tree, a prefill chunk
                        {8, 4, 1, 1500, 256, false}, {8, 4, 9, 700, 256, true}, {4, 1, 40, 800, 256, false},
                        // soft-capped scores (Gemma 2): a decode step, a tree, a prefill chunk, pieces
                        {8, 4, 1, 1100, 256, false, false, 50.f}, {8, 4, 9, 300, 256, true, false, 0.7f},
                        {4, 1, 40, 300, 256, false, false, 0.7f}, {6, 1, 32, 600, 128, false, false, 1.5f},
                        {6, 2, 3, 35, 32, true, false, 50.f}};
  for (const Case& c : cases) {
    const std::vector<float> q = randn(c.heads * c.t * c.d);
    const std::vector<uint16_t> k = random_bf16(c.kv * c.s * c.d), v = random_bf16(c.kv * c.s * c.d);
    std::vector<uint8_t> mask_bytes(c.t * c.t);
    std::bernoulli_distribution coin(0.5);
    for (int64_t i = 0; i < c.t; ++i)
      for (int64_t j = 0; j < c.t; ++j) mask_bytes[i * c.t + j] = (i == j) || (j < i && coin(rng));
    std::vector<char> mask(mask_bytes.begin(), mask_bytes.end());
    spx::Attention pb{q.data(), k.data(), v.data(), nullptr, c.heads, c.kv, c.t, c.d, c.s, c.t, c.s * c.d, c.s * c.d,
                      c.tree ? reinterpret_cast<const bool*>(mask.data()) : nullptr,
                      1.f / std::sqrt(static_cast<float>(c.d))};
    const std::vector<float> sinks = randn(c.heads, 2.f);
    if (c.sinks) pb.sinks = sinks.data();
    pb.softcap = c.softcap;
    const std::vector<float> ref = run_attention(Path::Portable, pb);
    const std::string name = "attention d " + std::to_string(c.d) + " t " + std::to_string(c.t) + " s " +
                             std::to_string(c.s) + (c.sinks ? " sinks" : "") +
                             (c.softcap > 0.f ? " softcap " + std::to_string(c.softcap) : "") + ": ";
    const spx::AttentionPlan one = spx::plan_attention(pb, 1);
    std::vector<spx::BlockKernel> attended;  // the kernels whose runs were checked
    for (Path p : paths) {
      // A path whose block kernel an earlier path's runs used (the amx paths take their vector path's)
      // makes the same calls on the same data again: those runs' checks are its checks.
      const spx::BlockKernel kn = spx::kernel_for(p, c.d);
      if (std::any_of(attended.begin(), attended.end(), [&](const spx::BlockKernel& a) { return same_kernel(a, kn); }))
        continue;
      attended.push_back(kn);
      // The portable path's one-thread run is `ref` itself; its pieces below are its own checks.
      if (p != Path::Portable) {
        const std::vector<float> y = run_attention(p, pb);
        check(same_bits(y.data(), ref.data(), y.size()), name + spx::path_name(p) + " = portable");
      }
      for (int threads : {2, 3, 8}) {
        // A plan with one thread's items and no pieces, run in the same order, is the run above again
        // (the same calls on the same data): its check is that run's. Backwards (3) always runs.
        if (threads != 3 && same_items(spx::plan_attention(pb, threads), one)) continue;
        const std::vector<float> z = run_attention(p, pb, threads, threads == 3);
        check(same_bits(z.data(), ref.data(), z.size()),
              name + spx::path_name(p) + " in pieces for " + std::to_string(threads) + " threads");
      }
    }
  }
}

// fastexp.h's tanh (soft-capped scores) against the C library's, in units in the last place, over both
// of its forms and the switch between them; and an odd function, bit for bit.
void tanh_tests() {
  double worst = 0.0;
  bool odd = true;
  for (int i = 0; i <= 400000; ++i) {
    const float x = static_cast<float>(i) * 5e-5f;  // [0, 20]
    const float y = spx::tanh_portable(x);
    const double exact = std::tanh(static_cast<double>(x));
    const float up = std::nextafter(static_cast<float>(exact), 2.f);
    const double ulp = static_cast<double>(up) - static_cast<double>(static_cast<float>(exact));
    if (x > 0.f) worst = std::max(worst, std::fabs(y - exact) / ulp);
    const float ny = spx::tanh_portable(-x);
    odd = odd && ny == -y;
  }
  check(worst <= 3.0, "tanh_portable within 3 ulp of tanh on [0, 20] (worst " + std::to_string(worst) + ")");
  check(odd, "tanh_portable(-x) = -tanh_portable(x)");
  check(spx::tanh_portable(100.f) == 1.f && spx::tanh_portable(-100.f) == -1.f, "tanh_portable saturates at +-1");
}

// The detection's verdicts on made-up probes: each missing step refuses AMX, all present accept it.
void amx_detection_tests() {
  spx::AmxProbe ok;
  ok.x86 = ok.avx512 = ok.tile = ok.int8 = ok.osxsave = true;
  ok.max_palette = 1;
  ok.palette1[0] = 8192u | (1024u << 16);
  ok.palette1[1] = 64u | (8u << 16);
  ok.palette1[2] = 16;
  ok.xcr0 = 0x600e7;    // x87, SSE, AVX, AVX-512 state, XTILECFG, XTILEDATA
  ok.permission = 0;
  check(spx::amx_refusal(ok) == nullptr, "amx detection: a complete probe runs amx");
  const std::pair<const char*, spx::AmxProbe (*)(spx::AmxProbe)> denials[] = {
      {"CPUID", [](spx::AmxProbe p) { p.int8 = false; return p; }},
      {"palette", [](spx::AmxProbe p) { p.max_palette = 0; return p; }},
      {"palette", [](spx::AmxProbe p) { p.palette1[2] = 8; return p; }},
      {"XCR0", [](spx::AmxProbe p) { p.xcr0 &= ~(uint64_t{1} << 18); return p; }},
      {"XSAVE", [](spx::AmxProbe p) { p.osxsave = false; return p; }},
      {"arch_prctl", [](spx::AmxProbe p) { p.permission = 1; return p; }},
      {"AVX-512", [](spx::AmxProbe p) { p.avx512 = false; return p; }},
  };
  for (const auto& d : denials) {
    const char* why = spx::amx_refusal(d.second(ok));
    check(why != nullptr && std::strstr(why, d.first) != nullptr, std::string("amx detection refuses: ") + d.first);
  }
  const char* here = spx::amx_status();
  check(spx::cpu_supports(Path::AMX) == (here == nullptr), "amx detection: cpu_supports agrees with amx_status");
  std::printf("amx on this CPU: %s\n", here == nullptr ? "runs" : here);
}

// A random weight of the step's model, kept alive in `blobs`.
spx::StepLinear step_weight(std::vector<std::vector<uint8_t>>& blobs, int64_t n, int64_t k, int64_t fmt) {
  const spx::Segment shape{nullptr, fmt, n, k, fmt == spx::Q8 ? 128 : 0, 8};
  blobs.push_back(random_blob(shape));
  spx::StepLinear w;
  spx::Segment s = shape;
  s.blob = blobs.back().data();
  w.add(s);
  return w;
}

// One row and a tree level (a root and its children) at slots from 40 of a 64-slot cache on `threads`
// threads: every path's rows and K/V are the portable path's bits, and finite.
void steps_equal_portable(const std::vector<Path>& paths, const spx::StepModel& md, const std::string& what,
                          int threads) {
  const int64_t hidden = md.hidden, kv = md.kv_heads, d = md.head_dim, cap = 64, start = 40;
  const int64_t layers = static_cast<int64_t>(md.layers.size());
  for (const int64_t t : {1, 5}) {
    const std::vector<float> x0 = randn(t * hidden), cos = randn(t * d), sin = randn(t * d);
    const std::vector<uint16_t> k0 = random_bf16(layers * kv * cap * d), v0 = random_bf16(layers * kv * cap * d);
    std::vector<char> mask(t * t);
    for (int64_t i = 0; i < t; ++i)
      for (int64_t j = 0; j < t; ++j) mask[i * t + j] = j == i || j == 0;  // a root and its children
    std::vector<float> ref_x;
    std::vector<uint16_t> ref_k;
    for (Path p : paths) {
      std::vector<float> x = x0;
      std::vector<uint16_t> k = k0, v = v0;
      const spx::StepRows rows{x.data(), cos.data(), sin.data(), t, k.data(), v.data(), cap, start,
                               t > 1 ? reinterpret_cast<const bool*>(mask.data()) : nullptr, t};
      spx::forward_step(p, md, rows, threads);
      const std::string name = what + " t " + std::to_string(t) + ": " + spx::path_name(p);
      check(std::all_of(x.begin(), x.end(), [](float f) { return std::isfinite(f); }), name + ": finite");
      if (p == Path::Portable) {
        ref_x = x, ref_k = k;
        continue;
      }
      check(same_bits(x.data(), ref_x.data(), x.size()) && k == ref_k, name + " = portable");
    }
  }
}

// Sequences of 1, 6 (a tree), 1 and 21 (a prompt chunk) rows over caches of their own in one
// batched step, with the head on some rows: each sequence's rows, K/V and logits are the bits
// of its step alone, and of the head applied to its rows alone.
void step_batch_tests(const std::vector<Path>& paths, const spx::StepModel& md) {
  const int64_t hidden = md.hidden, d = md.head_dim, kv = md.kv_heads, layers = md.layers.size(), cap = 96;
  std::vector<std::vector<uint8_t>> blobs;
  spx::StepHead head;
  head.w = step_weight(blobs, 80, hidden, spx::Q6K);
  const std::vector<float> head_norm = randn(hidden, 0.1f);
  head.norm = head_norm.data();
  head.eps = 1e-6f;
  const std::vector<int64_t> ts{1, 6, 1, 21}, starts{40, 17, 0, 60};
  const int64_t total = 29;
  const std::vector<float> x0 = randn(total * hidden), cos = randn(total * d), sin = randn(total * d);
  std::vector<std::vector<uint16_t>> k0, v0;
  for (size_t s = 0; s < ts.size(); ++s) {
    k0.push_back(random_bf16(layers * kv * cap * d));
    v0.push_back(random_bf16(layers * kv * cap * d));
  }
  std::vector<char> tree(6 * 6, 0);
  const int parent[6] = {-1, 0, 0, 1, 1, 2};
  for (int i = 0; i < 6; ++i) {
    if (i > 0) std::memcpy(&tree[i * 6], &tree[parent[i] * 6], 6);
    tree[i * 6 + i] = 1;
  }
  const std::vector<int64_t> picked{0, 2, 5, 7, 27, 28};  // rows of sequences 0, 1, 1, 2, 3, 3
  for (Path p : paths) {
    std::vector<float> x = x0, logits(picked.size() * 80);
    std::vector<std::vector<uint16_t>> k = k0, v = v0;
    std::vector<spx::StepSeq> seqs;
    for (size_t s = 0; s < ts.size(); ++s)
      seqs.push_back({ts[s], k[s].data(), v[s].data(), cap, starts[s],
                      s == 1 ? reinterpret_cast<const bool*>(tree.data()) : nullptr, ts[s]});
    spx::StepBatch bt{x.data(), cos.data(), sin.data(), seqs.data(), static_cast<int64_t>(seqs.size()), &head,
                      picked.data(), static_cast<int64_t>(picked.size()), logits.data()};
    spx::StepWorkspace ws;
    spx::forward_batch(p, md, bt, 2, &ws);
    int64_t row0 = 0;
    bool same = true;
    for (size_t s = 0; s < ts.size(); ++s) {
      std::vector<float> xs(x0.begin() + row0 * hidden, x0.begin() + (row0 + ts[s]) * hidden);
      std::vector<uint16_t> ks = k0[s], vs = v0[s];
      std::vector<int64_t> rows;
      for (int64_t r : picked)
        if (r >= row0 && r < row0 + ts[s]) rows.push_back(r - row0);
      std::vector<float> ls(rows.size() * 80);
      const spx::StepSeq one{ts[s], ks.data(), vs.data(), cap, starts[s], seqs[s].mask, ts[s]};
      const spx::StepBatch alone{xs.data(), cos.data() + row0 * d, sin.data() + row0 * d, &one, 1, &head,
                                 rows.data(), static_cast<int64_t>(rows.size()), ls.data()};
      spx::forward_batch(p, md, alone, 1);
      const int64_t first = std::lower_bound(picked.begin(), picked.end(), row0) - picked.begin();
      same = same && same_bits(xs.data(), x.data() + row0 * hidden, xs.size()) && ks == k[s] && vs == v[s] &&
             same_bits(ls.data(), logits.data() + first * 80, ls.size());
      row0 += ts[s];
    }
    check(same, std::string("batched step: each sequence alone, ") + spx::path_name(p));
  }
}

// The step with a family's switches on (layer 0: Gemma's sandwich norms, GeGLU and a window of 8;
// layer 1: OLMo 2's post norms only and whole-row q/k norms), partial rotary (48 of 64), a score
// scale, soft-capped scores (Gemma 2's, at a cap small enough to reach tanh's outer form) and a
// residual multiplier: every path gives the portable path's bits, for one row and a tree level whose
// rows sit at start + depth.
void family_step_tests(const std::vector<Path>& paths, spx::StepModel md) {
  const int64_t hidden = md.hidden, kv = md.kv_heads, d = md.head_dim, cap = 64, start = 40, window = 8;
  const int64_t layers = static_cast<int64_t>(md.layers.size());
  md.attn_scale = 0.2f, md.residual_scale = 0.7f, md.rot = 48, md.attn_softcap = 0.6f;
  std::vector<std::vector<float>> floats;
  auto weight = [&](int64_t n) {
    floats.push_back(randn(n, 0.1f));
    for (float& f : floats.back()) f += 1.f;
    return floats.back().data();
  };
  spx::StepLayer& g = md.layers[0];
  g.attn_out_norm = weight(hidden), g.mlp_out_norm = weight(hidden), g.gelu = true, g.windowed = true;
  spx::StepLayer& o = md.layers[1];
  o.attn_norm = o.mlp_norm = nullptr;
  o.attn_out_norm = weight(hidden), o.mlp_out_norm = weight(hidden);
  o.q_full_norm = weight(md.heads * d), o.k_full_norm = weight(kv * d);
  for (const int64_t t : {1, 5}) {
    const std::vector<float> x0 = randn(t * hidden), cos = randn(t * md.rot), sin = randn(t * md.rot);
    const std::vector<uint16_t> k0 = random_bf16(layers * kv * cap * d), v0 = random_bf16(layers * kv * cap * d);
    std::vector<char> mask(t * t);
    std::vector<int64_t> pos(t);
    for (int64_t i = 0; i < t; ++i) {
      pos[i] = start + (i > 0);  // a root and its children
      for (int64_t j = 0; j < t; ++j) mask[i * t + j] = j == i || j == 0;
    }
    const int64_t first = start - window + 1, m = start + t - first;
    std::vector<char> wmask(t * m);
    for (int64_t i = 0; i < t; ++i)
      for (int64_t j = 0; j < m; ++j) {
        const int64_t slot = first + j, kpos = slot < start ? slot : pos[slot - start];
        const bool seen = slot < start || (t > 1 ? mask[i * t + slot - start] != 0 : slot - start <= i);
        wmask[i * m + j] = seen && pos[i] - kpos < window;
      }
    std::vector<float> ref_x;
    std::vector<uint16_t> ref_k;
    for (Path p : paths) {
      std::vector<float> x = x0;
      std::vector<uint16_t> k = k0, v = v0;
      spx::StepSeq seq{t, k.data(), v.data(), cap, start, t > 1 ? reinterpret_cast<const bool*>(mask.data()) : nullptr,
                       t};
      seq.wfirst = first;
      seq.wmask = reinterpret_cast<const bool*>(wmask.data());
      const spx::StepBatch bt{x.data(), cos.data(), sin.data(), &seq, 1};
      spx::forward_batch(p, md, bt, 1);
      if (p == Path::Portable) {
        ref_x = x, ref_k = k;
        continue;
      }
      check(same_bits(x.data(), ref_x.data(), x.size()) && k == ref_k,
            "family step t " + std::to_string(t) + ": " + spx::path_name(p) + " = portable");
    }
  }
}

// The step with expert layers in place of the MLPs (step.h's StepExperts): layer 0 SiLU experts
// (Q4_K gate/up, BF16 down on bfloat16 products, softmax then top-k renormalised) with Qwen2-MoE's shared expert (Q8_0
// gate/up, Q4_K down, its gate the router's last row), layer 1 gpt-oss's (MXFP4, biases on
// the router and the experts, the clamped SwiGLU, top-k then softmax, attention sinks); 8 experts of
// 256, 2 a token. Every path gives the portable path's bits for one row and a tree level, and a
// batched step gives each sequence the bits of its step alone.
void expert_step_tests(const std::vector<Path>& paths, spx::StepModel md) {
  const int64_t hidden = md.hidden, count = 8, ff = 256;
  const int64_t layers = static_cast<int64_t>(md.layers.size());
  std::vector<std::vector<uint8_t>> blobs;
  std::vector<std::vector<float>> floats;
  auto vec = [&](int64_t n, float scale) {
    floats.push_back(randn(n, scale));
    return floats.back().data();
  };
  for (int64_t li = 0; li < layers; ++li) {
    spx::StepLayer& l = md.layers[li];
    l.gate_up = spx::StepLinear{};
    l.down = spx::StepLinear{};
    spx::StepExperts& e = l.moe;
    e.count = count, e.used = 2, e.ff = ff;
    const bool oss = li == 1;
    e.router = step_weight(blobs, 3 * (count + (oss ? 0 : 1)), hidden, spx::BF16);
    if (!oss) {
      e.shared_ff = 256;
      e.shared_gate_up = step_weight(blobs, 2 * e.shared_ff, hidden, spx::Q8);
      e.shared_down = step_weight(blobs, hidden, e.shared_ff, spx::Q4K);
    }
    e.gate = step_weight(blobs, count * ff, hidden, oss ? spx::MXFP4 : spx::Q4K).segs[0];
    e.up = step_weight(blobs, count * ff, hidden, oss ? spx::MXFP4 : spx::Q4K).segs[0];
    e.down = step_weight(blobs, count * hidden, ff, oss ? spx::MXFP4 : spx::BF16D).segs[0];  // BF16D: the slots' rows
    e.kind = oss ? spx::Weighting::TopkSoftmax : spx::Weighting::SoftmaxTopkNorm;
    e.act = oss ? spx::ExpertAct::SwigluOai : spx::ExpertAct::Silu;
    if (oss) {
      e.router_bias = vec(count, 0.5f);
      e.gate_up_bias = vec(count * 2 * ff, 0.1f);
      e.down_bias = vec(count * hidden, 0.1f);
      l.sinks = vec(md.heads, 1.f);
    }
  }
  steps_equal_portable(paths, md, "expert step", 2);
  step_batch_tests(paths, md);
}

void step_tests(const std::vector<Path>& paths) {
  const int64_t hidden = 256, heads = 4, kv = 2, d = 64, inter = 512, layers = 2;
  std::vector<std::vector<uint8_t>> blobs;
  std::vector<std::vector<float>> floats;
  spx::StepModel md;
  md.hidden = hidden, md.heads = heads, md.kv_heads = kv, md.head_dim = d, md.eps = 1e-6f;
  for (int64_t li = 0; li < layers; ++li) {
    spx::StepLayer l;
    l.qkv = step_weight(blobs, (heads + 2 * kv) * d, hidden, spx::Q4K);
    l.o = step_weight(blobs, hidden, heads * d, li == 0 ? spx::Q8 : spx::F16);  // layer 1: the float formats
    l.gate_up = step_weight(blobs, 2 * inter, hidden, li == 0 ? spx::Q6K : spx::BF16D);
    l.down = step_weight(blobs, hidden, inter, li == 0 ? spx::Q4K : spx::BF16);
    floats.push_back(randn((heads + 2 * kv) * d, 0.1f));
    l.qkv.bias = floats.back().data();
    for (const float** norm : {&l.attn_norm, &l.mlp_norm}) {
      floats.push_back(randn(hidden, 0.1f));
      for (float& f : floats.back()) f += 1.f;
      *norm = floats.back().data();
    }
    md.layers.push_back(l);
  }
  steps_equal_portable(paths, md, "whole step", 1);
  step_batch_tests(paths, md);
  family_step_tests(paths, md);
  expert_step_tests(paths, md);
}

}  // namespace

int main(int argc, char** argv) {
  const bool detected_only = argc > 1 && std::string(argv[1]) == "--detected-only";
  std::vector<Path> paths;
  std::string names = "portable";
  for (Path p : {Path::AVX2, Path::AVX512, Path::NEON, Path::AMX})
    if (spx::cpu_supports(p)) {
      paths.push_back(p);
      names += std::string(", ") + spx::path_name(p);
    }
  std::printf("kernel paths on this CPU: %s\n", names.c_str());
  // `--paths-only`: the detection alone (a CPU model whose checks another run of the same build
  // already made: under emulation without the dot-product extension, neon must not be chosen).
  if (argc > 1 && std::string(argv[1]) == "--paths-only") return 0;
  paths.insert(paths.begin(), Path::Portable);  // the portable path's own row independence
  // The amx code on emulated tiles everywhere (with AVX-512's epilogue where this build runs it).
  if (!detected_only) paths.push_back(Path::AMXEmulated);
  amx_detection_tests();
  linear_tests(paths);
  attention_tests(paths);
  tanh_tests();
  step_tests(paths);
  // Again with the K-quants' activations per 256 (qlinear.h): every path the portable bits.
  spx::set_k256(~int64_t{0});
  linear_tests(paths);
  step_tests(paths);
  spx::set_k256(0);
  std::printf("%d checks, %d failed\n", checks, failures);
  return failures == 0 ? 0 : 1;
}
