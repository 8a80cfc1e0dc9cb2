// A barrier for the threads of one parallel region that spins briefly and then yields the CPU,
// never sleeping in the kernel.
//
// Why not `#pragma omp barrier` (or a work-sharing loop's implicit one): libgomp decides how long a
// thread spins at a barrier before sleeping on a futex from a process-wide count of the threads
// in every thread's team. Once those outnumber the CPUs (a server: the main thread's team, left
// from loading the models, beside the scheduler thread's), every barrier spins ~100 iterations and
// then sleeps, so each of a step's hundreds of barriers pays a futex wake-up, and the same step
// runs slower in the server than in `generate`. Here the wait depends on nothing outside the
// region: spin while the partner is likely to arrive within microseconds (the phases between two
// barriers are balanced), then `sched_yield`, which returns at once on an idle CPU and lets a
// descheduled partner run on a busy one (a pure spin would hold the core it needs).
#pragma once

#include <atomic>
#include <cstdint>

#include <sched.h>

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
      generation_.fetch_add(1, std::memory_order_release);  // publishes the reset and every thread's writes
      return;
    }
    for (int i = 0; generation_.load(std::memory_order_acquire) == gen; ++i) {
      if (i < kSpins)
        cpu_relax();
      else
        sched_yield();
    }
  }

 private:
  static constexpr int kSpins = 4096;  // a few microseconds to tens of them, by the CPU's pause
  alignas(64) std::atomic<int> arrived_{0};
  alignas(64) std::atomic<uint32_t> generation_{0};
};

}  // namespace spx
