// What the native kernels share: instruction-set selection and splitting work over XLA's threads.
#ifndef SPSJAX_NATIVE_PARALLEL_H_
#define SPSJAX_NATIVE_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

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

// Helper threads of our own for the kernels, which spin between calls.
//
// A decode step calls the kernels every few microseconds, each for 5 to 50 us of work. Handing
// half of it to XLA's pool costs a wake-up of a sleeping thread (a futex, slower still in a VM)
// on most calls: small products then ran slower on two threads than on one. These helpers instead
// spin (with `pause`) for a while after each job and only then sleep, so the next call of the same
// step finds them awake. One job runs at a time; a caller that finds the helpers busy (another XLA
// thread in a kernel) does its work alone.
class Workers {
 public:
  static Workers& Get() {
    static Workers* workers = new Workers();  // Never destroyed: helpers are detached.
    return *workers;
  }

  // Runs fn over [0, n) in chunks with the caller and up to `helpers` helpers; false (nothing
  // run) if another job is in progress.
  bool TryRun(std::function<void(int64_t, int64_t)> fn, int64_t n, int64_t chunk,
              int64_t helpers) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    auto job = std::make_shared<Job>();
    job->fn = std::move(fn);
    job->n = n;
    job->chunk = chunk;
    job->num_chunks = (n + chunk - 1) / chunk;
    job->helpers = helpers;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = job;
      generation_.fetch_add(1, std::memory_order_release);
    }
    if (sleeping_.load(std::memory_order_acquire) > 0) wake_.notify_all();
    job->Work();
    // Chunks that helpers took: they are microseconds from done.
    while (job->done.load(std::memory_order_acquire) < job->num_chunks) Pause();
    return true;
  }

 private:
  // One call's work. Helpers hold it by shared_ptr, so one that arrives late finds no chunk
  // left and never calls fn after the caller returned.
  struct Job {
    std::function<void(int64_t, int64_t)> fn;
    int64_t n = 0, chunk = 1, num_chunks = 0, helpers = 0;
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

  Workers() {
    const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
    for (int64_t i = 0; i + 1 < cores; ++i) std::thread([this, i] { Loop(i); }).detach();
  }

  static void Pause() {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }

  void Loop(int64_t index) {
    uint64_t seen = 0;
    for (;;) {
      // Wait for new work a while (a decode step's kernels come every few us), then sleep:
      // a few us of `pause`, then yielding the core between looks, so that XLA's own threads
      // (which run some fusions in parallel) get it at once when they need it.
      uint64_t now = generation_.load(std::memory_order_acquire);
      for (int spins = 0; now == seen && spins < kSpins; ++spins) {
        if (spins < kPauses) {
          Pause();
        } else {
          std::this_thread::yield();
        }
        now = generation_.load(std::memory_order_acquire);
      }
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        if (generation_.load(std::memory_order_acquire) == seen) {
          sleeping_.fetch_add(1, std::memory_order_acq_rel);
          wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
          sleeping_.fetch_sub(1, std::memory_order_acq_rel);
        }
        seen = generation_.load(std::memory_order_acquire);
        job = job_;
      }
      if (job != nullptr && index < job->helpers) job->Work();
    }
  }

  static constexpr int kPauses = 1 << 10;  // A few us of `pause` on current x86 cores,
  static constexpr int kSpins = kPauses + (1 << 9);  // then ~0.2-0.5 ms of yields.
  std::mutex busy_;  // Held by the caller of the job in progress.
  std::mutex mutex_;  // Guards job_ and sleeping.
  std::condition_variable wake_;
  std::shared_ptr<Job> job_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> sleeping_{0};
};

// Runs fn(begin, end) over [0, n) in chunks that the caller and `threads - 1` helpers (`Workers`)
// claim in turn, and returns when all are done.
inline void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, int64_t threads,
                        std::function<void(int64_t, int64_t)> fn) {
  if (n <= 0) return;
  threads = std::max<int64_t>(1, std::min(threads, n));
  if (threads == 1) {
    fn(0, n);
    return;
  }
  // A few chunks per thread, so that a thread that starts late still takes a share.
  const int64_t chunk = std::max<int64_t>(1, n / (4 * threads));
  if (!Workers::Get().TryRun(fn, n, chunk, threads - 1)) fn(0, n);
}

}  // namespace spsjax

#endif  // SPSJAX_NATIVE_PARALLEL_H_
