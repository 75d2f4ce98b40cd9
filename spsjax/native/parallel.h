// What the native kernels share: instruction-set selection and splitting work over XLA's threads.
#ifndef SPSJAX_NATIVE_PARALLEL_H_
#define SPSJAX_NATIVE_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace spsjax {

// Instruction sets, as the Python side names them by number (spsjax/native/library.py).
enum Isa : int32_t { kBest = 0, kBaseline = 1, kAvx2 = 2, kAvx512 = 3 };

inline bool Supported(int32_t isa) {
  switch (isa) {
    case kBaseline:
      return true;
#if defined(__x86_64__)
    case kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") &&
             __builtin_cpu_supports("fma");
#endif
    default:
      return false;
  }
}

inline int32_t Best() {
  for (int32_t isa : {kAvx512, kAvx2}) {
    if (Supported(isa)) return isa;
  }
  return kBaseline;
}

// Replaces kBest by the best instruction set; false if this CPU lacks the one asked.
inline bool Resolve(int32_t* isa) {
  if (*isa == kBest) *isa = Best();
  return Supported(*isa);
}

// Threads a call may use: XLA's intra-op pool, capped by SPSJAX_NATIVE_THREADS when it is set.
inline int64_t MaxThreads(xla::ffi::ThreadPool& pool) {
  static const int64_t cap = [] {
    const char* env = std::getenv("SPSJAX_NATIVE_THREADS");
    return env == nullptr ? int64_t{0} : std::max<int64_t>(1, std::atoll(env));
  }();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  return cap > 0 ? std::min(cap, threads) : threads;
}

// Runs fn(begin, end) over [0, n) in chunks that the caller and `threads - 1` pool tasks claim in
// turn, and returns when all are done. The state is shared by pointer with the pool tasks, which
// may start only after the caller has done every chunk itself (they then find nothing to claim).
inline void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, int64_t threads,
                        std::function<void(int64_t, int64_t)> fn) {
  if (n <= 0) return;
  threads = std::max<int64_t>(1, std::min(threads, n));
  if (threads == 1) {
    fn(0, n);
    return;
  }
  struct State {
    std::function<void(int64_t, int64_t)> fn;
    int64_t n, chunk, num_chunks;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    void Work() {
      for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < num_chunks;
           c = next.fetch_add(1, std::memory_order_relaxed)) {
        fn(c * chunk, std::min(n, (c + 1) * chunk));
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  auto state = std::make_shared<State>();
  state->fn = std::move(fn);
  state->n = n;
  // A few chunks per thread, so that a thread that starts late still takes a share.
  state->chunk = std::max<int64_t>(1, n / (4 * threads));
  state->num_chunks = (n + state->chunk - 1) / state->chunk;
  for (int64_t i = 1; i < threads; ++i) {
    pool.Schedule([state] { state->Work(); });
  }
  state->Work();
  // Wait for chunks that pool threads took. Spin briefly (they are microseconds from done), then
  // yield the core: a helper preempted on an oversubscribed machine needs it to finish.
  for (int spins = 0; state->done.load(std::memory_order_acquire) < state->num_chunks; ++spins) {
    if (spins < 4096) {
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
    } else {
      std::this_thread::yield();
    }
  }
}

}  // namespace spsjax

#endif  // SPSJAX_NATIVE_PARALLEL_H_
