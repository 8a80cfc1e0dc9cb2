// The PyTorch binding of the multiply-add peak loops (core/peak.h), an extension of its own:
// the roofline, `specextend kernels --peak` and the runtime bench load it (bench/roofline.py); the
// production kernels (torch_ops.cpp) do not carry it.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

#include "core/cpu.h"
#include "core/peak.h"

namespace {

// The multiply-add rate of one register-only loop on all of PyTorch's threads at once: the loop
// is sized on one thread to take about seconds / repeats, then every thread runs it together,
// `repeats` times. Returns the loop's description with each repeat's wall seconds and
// multiply-adds (all threads), or None where the path has no loop of that kind.
py::object peak(int64_t path_id, int64_t kind, double seconds, int64_t repeats) {
  TORCH_CHECK(path_id >= 0 && path_id < spx::kPaths, "peak: unknown kernel path ", path_id);
  const auto path = static_cast<spx::Path>(path_id);
  TORCH_CHECK(spx::cpu_supports(path), "this CPU cannot run the ", spx::path_name(path), " kernels");
  TORCH_CHECK(kind >= 0 && kind < spx::kPeakKinds, "peak: unknown kind ", kind);
  TORCH_CHECK(seconds > 0 && repeats >= 1, "peak: seconds must be positive and repeats at least 1");
  spx::PeakLoop loop{};
  if (!spx::peak_loop(path, static_cast<spx::PeakKind>(kind), &loop)) return py::none();
  using Clock = std::chrono::steady_clock;
  const auto since = [](Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); };
  const int threads = at::get_num_threads();
  std::vector<uint32_t> digests(threads);  // kept, so no loop is dead code
  const double per_repeat = seconds / static_cast<double>(repeats);
  int64_t iters = 256;
  double took = 0;
  for (;;) {  // sizing, which also wakes the core up to speed
    const auto t = Clock::now();
    digests[0] += loop.run(iters, 1);
    took = since(t);
    if (took >= std::min(0.02, per_repeat / 2)) break;
    iters *= 2;
  }
  iters = std::max<int64_t>(1, static_cast<int64_t>(static_cast<double>(iters) * per_repeat / took));
  std::vector<double> secs, macs;
  for (int64_t r = 0; r < repeats; ++r) {
    const auto t = Clock::now();
    at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) digests[i] += loop.run(iters, static_cast<int32_t>(1 + i));
    });
    secs.push_back(since(t));
    macs.push_back(static_cast<double>(threads) * static_cast<double>(iters) * static_cast<double>(loop.macs_per_iter));
  }
  uint32_t all = 0;
  for (uint32_t d : digests) all ^= d;
  py::dict out;
  out["instruction"] = loop.instruction;
  out["note"] = loop.note;
  out["threads"] = threads;
  out["seconds"] = secs;
  out["macs"] = macs;
  out["digest"] = all;
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("peak", &peak, "multiply-add rate of a register-only loop on every thread (kernels --peak)");
}
