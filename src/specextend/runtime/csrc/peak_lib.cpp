// The multiply-add peak loops (core/peak.h) as a plain C library of their own, loaded with ctypes
// by the roofline, `specextend kernels --peak` and the runtime bench (bench/roofline.py). No
// PyTorch headers: it builds in a few seconds where a PyTorch extension took half a minute, and the
// production kernels (torch_ops.cpp) do not carry it.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

#include "core/cpu.h"
#include "core/peak.h"

extern "C" {

// The multiply-add rate of one register-only loop on `threads` threads at once: the loop is sized
// on one thread to take about seconds / repeats, then every thread runs it together, `repeats`
// times, each repeat's wall seconds and multiply-adds (all threads) written to secs[r], macs[r].
// Returns 0, 1 where the path has no loop of that kind, -1 for arguments out of range, -2 for a
// path this CPU cannot run. instruction, note: the loop's description (static strings).
int spx_peak(int path_id, int kind, double seconds, int repeats, int threads, double* secs, double* macs,
             const char** instruction, const char** note, uint32_t* digest) {
  if (path_id < 0 || path_id >= spx::kPaths || kind < 0 || kind >= spx::kPeakKinds || !(seconds > 0) ||
      repeats < 1 || threads < 1)
    return -1;
  const auto path = static_cast<spx::Path>(path_id);
  if (!spx::cpu_supports(path)) return -2;
  spx::PeakLoop loop{};
  if (!spx::peak_loop(path, static_cast<spx::PeakKind>(kind), &loop)) return 1;
  using Clock = std::chrono::steady_clock;
  const auto since = [](Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); };
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
  for (int r = 0; r < repeats; ++r) {
    const auto t = Clock::now();
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int i = 0; i < threads; ++i) digests[i] += loop.run(iters, static_cast<int32_t>(1 + i));
    secs[r] = since(t);
    macs[r] = static_cast<double>(threads) * static_cast<double>(iters) * static_cast<double>(loop.macs_per_iter);
  }
  uint32_t all = 0;
  for (uint32_t d : digests) all ^= d;
  *instruction = loop.instruction;
  *note = loop.note;
  *digest = all;
  return 0;
}

}  // extern "C"
