// A barrier for the threads of one parallel region: spin for a bounded time, then sleep.
//
// Why not `#pragma omp barrier` (or a work-sharing loop's implicit one): libgomp decides how long a
// thread spins at a barrier before sleeping on a futex from a process-wide count of the threads
// in every thread's team. Once those outnumber the CPUs (a server: the main thread's team, left
// from loading the models, beside the scheduler thread's) every barrier spins ~100 iterations and
// then sleeps, so each of a step's hundreds of barriers pays a futex wake-up, and the same step
// runs slower in the server than in `generate`, where a barrier spins for milliseconds. Here the
// wait depends on nothing outside the region: spin while a partner is likely to arrive soon (the
// phases between two barriers are balanced, so on an idle CPU it arrives within microseconds),
// then sleep, so that on a busy CPU a waiting thread does not hold a core its partner needs (a
// spin-then-yield loop measured far slower than sleeping there). The spin's length adapts: each
// wait that ends asleep halves it, each that ends spinning doubles it, within [kMinSpin, kMaxSpin],
// so a team on a CPU shared with other work soon waits the way libgomp's throttled teams do.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <climits>
#endif

namespace spx {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

class TeamBarrier {
 public:
  // Every thread of the team calls wait with the same team size; the last to arrive releases all.
  void wait(int team) {
    if (team <= 1) return;
    const uint32_t gen = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == team - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_seq_cst);  // publishes the reset and every thread's writes
      if (sleepers_.load(std::memory_order_seq_cst) > 0) wake_all();
      return;
    }
    const int64_t budget = spin_ns_.load(std::memory_order_relaxed);
    if (spin(gen, budget)) {
      if (budget < kMaxSpin) spin_ns_.store(budget * 2, std::memory_order_relaxed);
      return;
    }
    if (budget > kMinSpin) spin_ns_.store(budget / 2, std::memory_order_relaxed);
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    while (generation_.load(std::memory_order_seq_cst) == gen) sleep_while(gen);
    sleepers_.fetch_sub(1, std::memory_order_relaxed);
  }

 private:
  static constexpr int64_t kMinSpin = 1000, kMaxSpin = 64000;  // nanoseconds

  // Whether the generation moved on within `ns` (the clock read once every 64 pauses).
  bool spin(uint32_t gen, int64_t ns) const {
    const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(ns);
    for (int i = 1;; ++i) {
      if (generation_.load(std::memory_order_acquire) != gen) return true;
      cpu_relax();
      if (i % 64 == 0 && std::chrono::steady_clock::now() > until) return false;
    }
  }

#if defined(__linux__)
  int* word() { return reinterpret_cast<int*>(&generation_); }
  // Sleeps unless the generation has already moved on (the kernel compares atomically).
  void sleep_while(uint32_t gen) {
    syscall(SYS_futex, word(), FUTEX_WAIT_PRIVATE, static_cast<int>(gen), nullptr, nullptr, 0);
  }
  void wake_all() { syscall(SYS_futex, word(), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0); }
#else
  void sleep_while(uint32_t) { std::this_thread::yield(); }
  void wake_all() {}
#endif

  alignas(64) std::atomic<int> arrived_{0};
  alignas(64) std::atomic<uint32_t> generation_{0};
  static_assert(sizeof(std::atomic<uint32_t>) == sizeof(int), "the futex word is the generation");
  std::atomic<int> sleepers_{0};
  std::atomic<int64_t> spin_ns_{kMaxSpin};
};

}  // namespace spx
