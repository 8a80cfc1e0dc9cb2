// TeamBarrier (core/team_barrier.h) under OpenMP with more threads than CPUs, so waiters reach the
// yielding branch: after each wait every thread sees every other thread's write of that round,
// and no thread passes a barrier before all have arrived. Exit status 0 when it holds.
#include <omp.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "../core/team_barrier.h"

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 4, rounds = argc > 2 ? std::atoi(argv[2]) : 20000;
  std::vector<int> slot(threads, -1);
  std::atomic<int> failures{0};
  spx::TeamBarrier barrier;
#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num(), team = omp_get_num_threads();
    for (int r = 0; r < rounds; ++r) {
      slot[tid] = r;  // a plain write: the barrier must publish it
      barrier.wait(team);
      for (int i = 0; i < team; ++i)
        if (slot[i] != r) failures.fetch_add(1);
      barrier.wait(team);  // nobody writes round r + 1 before everyone has read round r
    }
  }
  std::printf("%d threads, %d rounds, %d failed\n", threads, rounds, failures.load());
  return failures.load() == 0 ? 0 : 1;
}
