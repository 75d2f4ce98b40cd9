// What the native kernels share: instruction-set selection, and splitting work between the calling
// thread and helper threads, as many as the process has usable CPUs.
#ifndef SPSJAX_NATIVE_PARALLEL_H_
#define SPSJAX_NATIVE_PARALLEL_H_

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
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

// The whole text of a file, or "" if it cannot be read.
inline std::string ReadText(const std::string& path) {
  std::ifstream file(path);
  return std::string(std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>());
}

// `text`, decimal digits between blanks, as a positive integer (at most 2^40), or 0 if it is not
// one.
inline int64_t PositiveInteger(const std::string& text) {
  const char* blanks = " \t\n\r";
  const size_t begin = text.find_first_not_of(blanks);
  if (begin == std::string::npos) return 0;
  const size_t end = text.find_last_not_of(blanks) + 1;
  int64_t value = 0;
  for (size_t i = begin; i < end; ++i) {
    if (text[i] < '0' || text[i] > '9') return 0;
    value = std::min<int64_t>(int64_t{1} << 40, value * 10 + (text[i] - '0'));
  }
  return value;
}

// CPUs that a CFS quota of `quota` us per `period` us allows, ceil(quota / period); 0 if there is
// no quota ("max" in cgroup v2, "-1" in v1) or the texts are not numbers.
inline int64_t QuotaCpus(const std::string& quota, const std::string& period) {
  const int64_t q = PositiveInteger(quota), p = PositiveInteger(period);
  return q > 0 && p > 0 ? (q + p - 1) / p : 0;
}

// The smallest CPU quota set on this process's cgroups or their ancestors (QuotaCpus), 0 if none.
// `proc_cgroup` is the text of /proc/self/cgroup ("ID:CONTROLLERS:PATH" lines) and `root` where
// the hierarchies are mounted (/sys/fs/cgroup): cgroup v2 ("0::PATH") keeps "QUOTA PERIOD" in
// ROOT/PATH/cpu.max, v1 (CONTROLLERS naming cpu) keeps cpu.cfs_quota_us and cpu.cfs_period_us
// under ROOT/cpu (or cpu,cpuacct)/PATH. Each directory from PATH up to the mount counts: a parent's
// quota caps its children, and inside a container (whose mount shows its own cgroup as the root
// while PATH names it as the host sees it) the files are found at the top.
inline int64_t CgroupCpuLimit(const std::string& root, const std::string& proc_cgroup) {
  int64_t limit = 0;
  const auto take = [&limit](int64_t cpus) {
    if (cpus > 0 && (limit == 0 || cpus < limit)) limit = cpus;
  };
  std::istringstream lines(proc_cgroup);
  std::string line;
  while (std::getline(lines, line)) {
    const size_t colon1 = line.find(':'), colon2 = line.find(':', colon1 + 1);
    if (colon1 == std::string::npos || colon2 == std::string::npos) continue;
    const std::string controllers = line.substr(colon1 + 1, colon2 - colon1 - 1);
    std::string path = line.substr(colon2 + 1);
    std::vector<std::string> mounts;
    if (controllers.empty()) {
      mounts = {root};
    } else if (("," + controllers + ",").find(",cpu,") != std::string::npos) {
      mounts = {root + "/cpu", root + "/cpu,cpuacct", root + "/cpuacct,cpu"};
    } else {
      continue;
    }
    for (;;) {  // PATH, then each parent up to the mount.
      if (!path.empty() && path.back() == '/') path.pop_back();
      for (const std::string& mount : mounts) {
        if (controllers.empty()) {
          const std::string cpu_max = ReadText(mount + path + "/cpu.max");
          const size_t space = cpu_max.find(' ');
          if (space != std::string::npos) {
            take(QuotaCpus(cpu_max.substr(0, space), cpu_max.substr(space + 1)));
          }
        } else {
          take(QuotaCpus(ReadText(mount + path + "/cpu.cfs_quota_us"),
                         ReadText(mount + path + "/cpu.cfs_period_us")));
        }
      }
      if (path.empty()) break;
      const size_t slash = path.rfind('/');
      path.erase(slash == std::string::npos ? 0 : slash);
    }
  }
  return limit;
}

// CPUs in this thread's affinity mask (the process's, unless someone changed the thread's).
inline int64_t AffinityCpus() {
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  // Over 1024 CPUs, or not Linux.
  return std::max<int64_t>(1, std::thread::hardware_concurrency());
}

// Threads a kernel call may use, decided once per process: the CPUs this process may run on (its
// affinity mask, e.g. `taskset -c 0`), fewer under a cgroup CPU quota (ceil(quota / period): a
// container given 1.5 CPUs gets 2), fewer still if SPSJAX_NATIVE_THREADS is set. That variable is
// a positive decimal integer; any other value ("", "0", "-2", "two", "1.5") is ignored, as if
// unset. At least 1, the calling thread; the helpers (`Workers`) are the other UsableCpus() - 1,
// so with one usable CPU none is ever started.
inline int64_t UsableCpus() {
  static const int64_t usable = [] {
    int64_t cpus = AffinityCpus();
    const int64_t quota = CgroupCpuLimit("/sys/fs/cgroup", ReadText("/proc/self/cgroup"));
    if (quota > 0) cpus = std::min(cpus, quota);
    const char* env = std::getenv("SPSJAX_NATIVE_THREADS");
    const int64_t cap = env == nullptr ? 0 : PositiveInteger(env);
    if (cap > 0) cpus = std::min(cpus, cap);
    return std::max<int64_t>(1, cpus);
  }();
  return usable;
}

// Threads a call may use: UsableCpus(), and no more than XLA's intra-op pool has.
inline int64_t MaxThreads(xla::ffi::ThreadPool& pool) {
  return std::min(UsableCpus(), std::max<int64_t>(1, pool.num_threads()));
}

// Helper threads of our own for the kernels, which stay awake a little while between calls.
//
// A decode step calls the kernels every few microseconds, each for 5 to 50 us of work. Handing
// half of it to XLA's pool costs a wake-up of a sleeping thread (a futex, slower still in a VM)
// on most calls: small products then ran slower on two threads than on one. These helpers instead
// look for the next job for kSpin after each one (a few us of `pause`, then yielding the core
// between looks, so that XLA's own threads get it at once when they need it), so the next call of
// the same step finds them awake, and then sleep on a condition variable until a job comes: an
// idle process takes no CPU. One job runs at a time; a caller that finds the helpers busy (another
// XLA thread in a kernel) does its work alone. The caller takes chunks too and only waits for
// chunks a helper has begun, so a late or sleeping helper never holds it up.
class Workers {
 public:
  static Workers& Get() {
    static Workers* workers = new Workers(UsableCpus() - 1);  // Never destroyed: helpers are
    return *workers;                                          // detached.
  }

  // Helper threads started so far in this process: 0 before the first call that splits its work
  // and wherever UsableCpus() is 1.
  static int64_t Started() { return started().load(std::memory_order_acquire); }

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
    bool wake;
    {
      // A helper checks for a new job and goes to sleep under this lock: it either sees this
      // generation or is counted in sleeping_ and waiting, so no wake-up is lost.
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = job;
      generation_.fetch_add(1, std::memory_order_release);
      wake = sleeping_ > 0;
    }
    if (wake) wake_.notify_all();
    job->Work();
    // Chunks that helpers took: they are microseconds from done, unless the helper lost its core
    // (more threads than cores); then yield it.
    for (int looks = 0; job->done.load(std::memory_order_acquire) < job->num_chunks; ++looks) {
      if (looks < kPauses) {
        Pause();
      } else {
        std::this_thread::yield();
      }
    }
    return true;
  }

 private:
  using Clock = std::chrono::steady_clock;

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

  static std::atomic<int64_t>& started() {
    static std::atomic<int64_t> count{0};
    return count;
  }

  explicit Workers(int64_t helpers) {
    for (int64_t i = 0; i < helpers; ++i) {
      std::thread([this, i] { Loop(i); }).detach();
      started().fetch_add(1, std::memory_order_release);
    }
  }

  static void Pause() {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }

  // Returns once the generation differs from `seen` or kSpin has passed.
  void Spin(uint64_t seen) const {
    const Clock::time_point until = Clock::now() + kSpin;
    for (int looks = 0; generation_.load(std::memory_order_acquire) == seen; ++looks) {
      if (looks < kPauses) {
        Pause();
      } else if (Clock::now() < until) {
        std::this_thread::yield();
      } else {
        return;
      }
    }
  }

  void Loop(int64_t index) {
    uint64_t seen = 0;
    for (;;) {
      Spin(seen);
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        if (generation_.load(std::memory_order_acquire) == seen) {
          ++sleeping_;
          wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
          --sleeping_;
        }
        seen = generation_.load(std::memory_order_acquire);
        job = job_;
      }
      if (job != nullptr && index < job->helpers) job->Work();
    }
  }

  // Looks with `pause` before yielding (a few us on current x86 cores; the caller waits so too).
  static constexpr int kPauses = 1 << 10;
  // How long a helper looks for the next job before it sleeps: longer than the gaps between one
  // decode step's kernel calls (XLA's small ops), short enough that a process that stops calling
  // has its helpers asleep within a millisecond.
  static constexpr std::chrono::microseconds kSpin{300};
  std::mutex busy_;  // Held by the caller of the job in progress.
  std::mutex mutex_;  // Guards job_ and sleeping_, and orders changes of generation_.
  std::condition_variable wake_;
  std::shared_ptr<Job> job_;
  std::atomic<uint64_t> generation_{0};  // Jobs posted so far.
  int64_t sleeping_ = 0;  // Helpers waiting on wake_.
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
