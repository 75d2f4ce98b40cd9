// Few-row float32 matrix products y[R, F] = f(x)[R, D] @ W[D, F] (+ residual[R, F]) with W packed
// in panels of 16 output columns ([ceil(F / 16), D, 16], see packed.py), for XLA:CPU through the
// FFI. W is stored in float32, in bfloat16 (half the bytes to stream; each weight widened
// exactly to float32 as it is loaded, the arithmetic float32 as for float32 weights) or in int8
// with a float32 scale per output column (a quarter of the bytes; the column's sum is scaled).
// w8a8 weights (int8's, stored as uint8 + 128 in groups of 4 depths) multiply the input rows
// quantized to int8 (`QuantizeRows`) in exact int32 sums: AVX-512 VNNI or AVX2 (w8a8_kernels.inc),
// or the portable `IntPanels`.
// The prologue f is the identity, an RMSNorm (x [R, D], scale [D]) or a gated SiLU (x [R, 2D]:
// gate then input); both run before the product, into a scratch copy. With counts [B] (a prefill
// of right-padded prompts, R = B * T) only the first counts[b] rows of each group of T are
// computed; the others, padding, come out as their residual (or 0) at no cost.
//
// XLA's CPU dot costs 2-4x as much for 5 rows as for 1 at decoder sizes; this kernel streams each
// panel once per call, keeping every row's 16 accumulators in registers, so 1 to 8 rows cost about
// the same: the bandwidth of reading W. Panels are shared among XLA's intra-op threads. AVX-512's
// tiles of 9 rows or more read their rows transposed. From 17 rows on (prefills, batches scoring
// several positions) AVX-512 takes the wide path, bound by arithmetic: tiles of 12 rows against
// two panels (packed_matmul_kernel.inc); `SPSJAX_NATIVE_WIDE_ROWS` sets another threshold (0:
// off), for A/B measurements.
//
// The kernel is compiled three times (AVX-512, AVX2 + FMA, and the compiler's baseline) from
// packed_matmul_kernel.inc and the best one this CPU runs is chosen at call time, so one build
// serves any x86-64 (or, baseline only, any other) CPU.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>  // The int8 weights' widening (packed_matmul_kernel.inc).
#endif

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kPanel = 16;

// Both paths' kernels: (x, x transposed, rows, d_in, w, d_out, y, first and end panel or panel
// pair, residual, int8 scales).
template <typename W>
using PanelsFn = void (*)(const float*, const float*, int64_t, int64_t, const W*, int64_t,
                          float*, int64_t, int64_t, const float*, const float*);
using TransposeFn = void (*)(const float*, int64_t, int64_t, int64_t, int64_t, float*);
using TransposeGroupsFn = bool (*)(const float*, int64_t, int64_t, float*);
using NormFn = void (*)(const float*, int64_t, int64_t, const float*, float, float*);
using GateFn = void (*)(const float*, int64_t, int64_t, float*);
// w8a8: (x, rows, d_in, d4, xq, sums, scales) and (xq, sums, x scales, rows, d4, w, d_out, y, first
// and end panel, residual, column scales).
using QuantizeFn = void (*)(const float*, int64_t, int64_t, int64_t, int8_t*, int32_t*, float*);
using IntPanelsFn = void (*)(const int8_t*, const int32_t*, const float*, int64_t, int64_t,
                             const uint8_t*, int64_t, float*, int64_t, int64_t, const float*,
                             const float*);

// What happens to the input rows before the product (packed.py names them the same way).
enum Prologue : int32_t { kNone = 0, kRmsNorm = 1, kSiluGate = 2 };

#define SPSJAX_KERNEL_FILE "packed_matmul_kernel.inc"
#include "variants.inc"
#undef SPSJAX_KERNEL_FILE

template <typename W>
PanelsFn<W> Kernel(int32_t isa) { return SPSJAX_BY_ISA(isa, Panels<W>); }
template <typename W>
PanelsFn<W> WideKernel(int32_t isa) { return SPSJAX_BY_ISA(isa, WidePanels<W>); }
TransposeFn TransposeKernel(int32_t isa) { return SPSJAX_BY_ISA(isa, TransposeTiles); }
TransposeGroupsFn TransposeGroupsKernel(int32_t isa) {
  return SPSJAX_BY_ISA(isa, TransposeGroups);
}
NormFn NormKernel(int32_t isa) { return SPSJAX_BY_ISA(isa, RmsNormRows); }
GateFn GateKernel(int32_t isa) { return SPSJAX_BY_ISA(isa, SiluGateRows); }

#if defined(__x86_64__)
#include "w8a8_kernels.inc"
#endif

// The w8a8 panel kernel for an instruction set: AVX-512 takes VNNI where the CPU has it, else
// AVX2's (w8a8_kernels.inc); the baseline the portable one. Their integer sums are the same.
IntPanelsFn IntKernel(int32_t isa) {
#if defined(__x86_64__)
  if (isa == spsjax::kAvx512) {
    static const bool vnni = __builtin_cpu_supports("avx512vnni") &&
                             __builtin_cpu_supports("avx512bw");
    return vnni ? VnniPanels : Avx2IntPanels;
  }
  if (isa == spsjax::kAvx2) return Avx2IntPanels;
#endif
  return baseline::IntPanels;
}
QuantizeFn QuantizeKernel(int32_t isa) { return SPSJAX_BY_ISA(isa, QuantizeRows); }

// Below this many weight floats a call runs on the calling thread: waking a pool thread costs more.
constexpr int64_t kMinParallelWeights = 1 << 16;
// Below this many input floats the prologue (norm, gate) runs on the calling thread.
constexpr int64_t kMinParallelPrologue = 1 << 16;
// w8a8's int32 sums stay exact up to this many depths (255 * 127 * 65536 < 2^31).
constexpr int64_t kMaxIntDepth = 65536;

// Rows from which AVX-512 takes the wide path (`WidePanels`: two panels per tile, the inputs
// transposed). Fewer rows are bound by reading the weights, which one pass over each panel does
// best: at 16 rows (batch 8 scoring 2 positions) reference_target's products took 15-25% less
// time in one pass of a transposed 16-row tile than in the wide path's two 8-row tiles (Zen 4).
constexpr int64_t kWideMinRows = 17;

bool UseWide(int32_t isa, int64_t rows) {
  static const int64_t min_rows = [] {  // SPSJAX_NATIVE_WIDE_ROWS: another threshold, 0: off.
    const char* env = std::getenv("SPSJAX_NATIVE_WIDE_ROWS");
    return env == nullptr ? kWideMinRows : std::atoll(env);
  }();
  return min_rows > 0 && isa == spsjax::kAvx512 && rows >= min_rows;
}

// Calls of at most this many rows whose computed rows form several runs (a decoding call with
// idle rows) compute them gathered into one block (`PackedMatmulImpl`).
constexpr int64_t kMaxGatheredRows = 64;

// The rows a call computes: all of them, or each of the B row groups' first counts[b] of its
// T = rows / B rows, the rest being padding (a prefill of right-padded prompts) or idle (a decoding
// row that has stopped: counts[b] = 0). Runs(r0, r1) visits the computed rows in [r0, r1) as
// contiguous runs (first row, number of rows), as few as it can: a group computed whole joins
// the next group's run.
struct RowRuns {
  int64_t rows, group;  // group: rows per batch row, T.
  const int32_t* counts;  // null: every row.

  template <typename Fn>
  void Runs(int64_t r0, int64_t r1, Fn&& fn) const {
    if (r1 <= r0) return;  // Also no rows at all (group 0).
    if (counts == nullptr) {
      fn(r0, r1 - r0);
      return;
    }
    int64_t run_start = r0, run_end = r0;  // The run being gathered.
    for (int64_t b = r0 / group; b * group < r1; ++b) {
      const int64_t start = std::max(r0, b * group);
      const int64_t end = std::min(r1, b * group + std::clamp<int64_t>(counts[b], 0, group));
      if (end <= start) continue;
      if (start != run_end) {
        if (run_end > run_start) fn(run_start, run_end - run_start);
        run_start = start;
      }
      run_end = end;
    }
    if (run_end > run_start) fn(run_start, run_end - run_start);
  }
};

// Runs the kernel for weights stored as W over the panels, shared among the threads (on the wide
// path, over pairs of panels, after the tiles' inputs are transposed into `xt`), for the rows of
// `runs` only: each thread takes its panels through every run, so skipped rows cost nothing. `xt`
// ([rows, d_in] floats) is allocated on first use and not cleared: the kernels read only the rows
// transposed into it.
template <typename W>
void RunPanels(ffi::ThreadPool& pool, int32_t isa, int64_t threads, const float* x,
               const RowRuns& runs, int64_t d_in, const void* w, int64_t d_out, float* y,
               int64_t num_panels, const float* residual, const float* scales,
               std::unique_ptr<float[]>& xt) {
  const W* w_data = static_cast<const W*>(w);
  const auto offset = [](const float* a, int64_t r, int64_t width) {
    return a == nullptr ? nullptr : a + r * width;
  };
  const auto scratch = [&] {
    if (xt == nullptr) xt.reset(new float[runs.rows * d_in]);
    return xt.get();
  };
  // The narrow path over some runs: their groups of many rows transposed first (on the calling
  // thread: at most 16 rows a run but where the wide path is off), then each thread takes its
  // panels through every run.
  const auto narrow = [&](int64_t r_begin, int64_t r_end) {
    const float* xt_data = nullptr;
    if (SPSJAX_BY_ISA(isa, kTransposedRows) <= r_end - r_begin) {
      float* buffer = scratch();
      bool any = false;
      runs.Runs(r_begin, r_end, [&](int64_t r0, int64_t n) {
        any |= TransposeGroupsKernel(isa)(x + r0 * d_in, n, d_in, buffer + r0 * d_in);
      });
      if (any) xt_data = buffer;
    }
    const PanelsFn<W> kernel = Kernel<W>(isa);
    spsjax::ParallelFor(pool, num_panels, threads, [=](int64_t p0, int64_t p1) {
      runs.Runs(r_begin, r_end, [&](int64_t r0, int64_t n) {
        kernel(x + r0 * d_in, offset(xt_data, r0, d_in), n, d_in, w_data, d_out,
               y + r0 * d_out, p0, p1, offset(residual, r0, d_out), scales);
      });
    });
  };
  if (!UseWide(isa, runs.rows)) {
    narrow(0, runs.rows);
    return;
  }
  runs.Runs(0, runs.rows, [&](int64_t r0, int64_t rows) {  // The wide path: run by run.
    if (!UseWide(isa, rows)) {
      narrow(r0, r0 + rows);
      return;
    }
    const float* xr = x + r0 * d_in;
    float* yr = y + r0 * d_out;
    const float* rr = offset(residual, r0, d_out);
    float* xt_data = scratch() + r0 * d_in;
    const TransposeFn transpose = TransposeKernel(isa);
    const int64_t tiles = SPSJAX_BY_ISA(isa, WideTiles)(rows);
    spsjax::ParallelFor(pool, tiles, rows * d_in < kMinParallelWeights ? 1 : threads,
                        [=](int64_t t0, int64_t t1) { transpose(xr, rows, d_in, t0, t1, xt_data); });
    const PanelsFn<W> kernel = WideKernel<W>(isa);
    spsjax::ParallelFor(pool, (num_panels + 1) / 2, threads, [=](int64_t u0, int64_t u1) {
      kernel(xr, xt_data, rows, d_in, w_data, d_out, yr, u0, u1, rr, scales);
    });
  });
}

// w8a8 weights: the rows of `runs` quantized (`QuantizeRows`, over the threads when they are
// many), then each thread takes its panels through every run, as `RunPanels`.
void RunQuantizedPanels(ffi::ThreadPool& pool, int32_t isa, int64_t threads, const float* x,
                        const RowRuns& runs, int64_t d_in, const uint8_t* w, int64_t d_out,
                        float* y, int64_t num_panels, const float* residual,
                        const float* w_scales) {
  const int64_t d4 = (d_in + 3) / 4 * 4;
  std::vector<int8_t> xq(runs.rows * d4);
  std::vector<int32_t> sums(runs.rows);
  std::vector<float> x_scales(runs.rows);
  int8_t* xq_data = xq.data();
  int32_t* sums_data = sums.data();
  float* x_scales_data = x_scales.data();
  const QuantizeFn quantize = QuantizeKernel(isa);
  const int64_t quantize_threads = runs.rows * d_in < kMinParallelPrologue ? 1 : threads;
  spsjax::ParallelFor(pool, runs.rows, quantize_threads, [=](int64_t r0, int64_t r1) {
    runs.Runs(r0, r1, [&](int64_t s, int64_t n) {
      quantize(x + s * d_in, n, d_in, d4, xq_data + s * d4, sums_data + s, x_scales_data + s);
    });
  });
  const IntPanelsFn kernel = IntKernel(isa);
  spsjax::ParallelFor(pool, num_panels, threads, [=](int64_t p0, int64_t p1) {
    runs.Runs(0, runs.rows, [&](int64_t r0, int64_t n) {
      kernel(xq_data + r0 * d4, sums_data + r0, x_scales_data + r0, n, d4, w, d_out,
             y + r0 * d_out, p0, p1, residual == nullptr ? nullptr : residual + r0 * d_out,
             w_scales);
    });
  });
}

ffi::Error PackedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                            ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> residual,
                            ffi::AnyBuffer w, ffi::Buffer<ffi::F32> w_scales,
                            ffi::Buffer<ffi::S32> counts, ffi::ResultBuffer<ffi::F32> y,
                            int32_t isa, int32_t prologue,
                            float eps) {
  const auto x_dims = x.dimensions();
  const auto w_dims = w.dimensions();
  const auto y_dims = y->dimensions();
  if (x_dims.size() != 2 || w_dims.size() != 3 || y_dims.size() != 2) {
    return ffi::Error::InvalidArgument(
        "packed_matmul: want x [R, D], w [P, D, 16] (w8a8: [P, ceil(D / 4), 64]), y [R, F].");
  }
  const ffi::DataType w_type = w.element_type();
  const bool w8a8 = w_type == ffi::DataType::U8;
  // w8a8 panels hold groups of 4 depths: D comes from x.
  const int64_t rows = x_dims[0], d_out = y_dims[1];
  const int64_t d_in = w8a8 ? (prologue == kSiluGate ? x_dims[1] / 2 : x_dims[1]) : w_dims[1];
  const int64_t num_panels = (d_out + kPanel - 1) / kPanel;
  const int64_t x_width = prologue == kSiluGate ? 2 * d_in : d_in;
  const bool w_fits = w8a8 ? w_dims[1] == (d_in + 3) / 4 && w_dims[2] == 4 * kPanel
                           : w_dims[2] == kPanel;
  if (w_dims[0] != num_panels || x_dims[1] != x_width || !w_fits || y_dims[0] != rows) {
    return ffi::Error::InvalidArgument("packed_matmul: shapes of x, w and y do not agree.");
  }
  if (w8a8 && d_in > kMaxIntDepth) {
    return ffi::Error::InvalidArgument("packed_matmul: w8a8 takes at most 65536 input depths.");
  }
  if (prologue < kNone || prologue > kSiluGate) {
    return ffi::Error::InvalidArgument("packed_matmul: unknown prologue.");
  }
  if (prologue == kRmsNorm && static_cast<int64_t>(scale.element_count()) != d_in) {
    return ffi::Error::InvalidArgument("packed_matmul: the norm scale must have D elements.");
  }
  const bool add_residual = residual.element_count() != 0;
  if (add_residual && static_cast<int64_t>(residual.element_count()) != rows * d_out) {
    return ffi::Error::InvalidArgument("packed_matmul: the residual must be [R, F] like y.");
  }
  if (w_type != ffi::DataType::F32 && w_type != ffi::DataType::BF16 &&
      w_type != ffi::DataType::S8 && !w8a8) {
    return ffi::Error::InvalidArgument(
        "packed_matmul: weights must be float32, bfloat16, int8 or uint8 (w8a8).");
  }
  const bool scaled = w_type == ffi::DataType::S8 || w8a8;
  if (scaled != (w_scales.element_count() != 0) ||
      (scaled && static_cast<int64_t>(w_scales.element_count()) != num_panels * kPanel)) {
    return ffi::Error::InvalidArgument(
        "packed_matmul: int8 and w8a8 weights take one scale per panel column, others none.");
  }
  const int64_t groups = counts.element_count();
  if (groups != 0 && rows % groups != 0) {
    return ffi::Error::InvalidArgument(
        "packed_matmul: counts must have one entry per group of rows (B for [B * T] rows).");
  }
  if (!spsjax::Resolve(&isa)) {
    return ffi::Error::InvalidArgument("packed_matmul: this CPU lacks the instruction set asked.");
  }
  const RowRuns runs{rows, groups == 0 ? rows : rows / groups,
                     groups == 0 ? nullptr : counts.typed_data()};
  const float* x_data = x.typed_data();
  const int64_t threads =
      num_panels * d_in * kPanel < kMinParallelWeights ? 1 : spsjax::MaxThreads(pool);
  std::vector<float> scratch;
  if (prologue != kNone) {
    // Over the threads when the rows are many (a prefill: a 2048-row gate took ~3 ms alone).
    scratch.resize(rows * d_in);
    float* out = scratch.data();
    const int64_t prologue_threads = rows * d_in < kMinParallelPrologue ? 1 : threads;
    if (prologue == kRmsNorm) {
      const NormFn norm = NormKernel(isa);
      const float* norm_scale = scale.typed_data();
      spsjax::ParallelFor(pool, rows, prologue_threads, [=](int64_t r0, int64_t r1) {
        runs.Runs(r0, r1, [&](int64_t s, int64_t n) {
          norm(x_data + s * d_in, n, d_in, norm_scale, eps, out + s * d_in);
        });
      });
    } else {
      const GateFn gate = GateKernel(isa);
      spsjax::ParallelFor(pool, rows, prologue_threads, [=](int64_t r0, int64_t r1) {
        runs.Runs(r0, r1, [&](int64_t s, int64_t n) {
          gate(x_data + s * 2 * d_in, n, d_in, out + s * d_in);
        });
      });
    }
    x_data = out;
  }
  const float* residual_data = add_residual ? residual.typed_data() : nullptr;
  float* y_data = y->typed_data();
  const float* scales = scaled ? w_scales.typed_data() : nullptr;
  const void* w_data = w.untyped_data();
  // Skipped rows come out as their residual, or zeros: finite, so that nothing downstream (XLA's
  // attention multiplies masked probabilities, zeros, by values) turns them into NaNs.
  if (runs.counts != nullptr) {
    for (int64_t b = 0; b < groups; ++b) {
      const int64_t used = std::clamp<int64_t>(runs.counts[b], 0, runs.group);
      const int64_t r0 = b * runs.group + used, n = runs.group - used;
      if (residual_data != nullptr) {
        std::copy(residual_data + r0 * d_out, residual_data + (r0 + n) * d_out,
                  y_data + r0 * d_out);
      } else {
        std::fill(y_data + r0 * d_out, y_data + (r0 + n) * d_out, 0.0f);
      }
    }
  }
  std::unique_ptr<float[]> transposed;  // Inputs transposed for the tiles that read them so.
  const auto run = [&](const float* xs, const RowRuns& rr, float* ys, const float* res) {
    if (w_type == ffi::DataType::F32) {
      RunPanels<float>(pool, isa, threads, xs, rr, d_in, w_data, d_out, ys, num_panels, res,
                       scales, transposed);
    } else if (w_type == ffi::DataType::BF16) {
      RunPanels<uint16_t>(pool, isa, threads, xs, rr, d_in, w_data, d_out, ys, num_panels, res,
                          scales, transposed);
    } else if (w_type == ffi::DataType::S8) {
      RunPanels<int8_t>(pool, isa, threads, xs, rr, d_in, w_data, d_out, ys, num_panels, res,
                        scales, transposed);
    } else {
      RunQuantizedPanels(pool, isa, threads, xs, rr, d_in, static_cast<const uint8_t*>(w_data),
                         d_out, ys, num_panels, res, scales);
    }
  };
  // A decoding call with idle rows (a few rows, in several runs): the rows computed are gathered
  // into one block, so that the panels take as few passes as the rows need (a batch of 8 at 2
  // positions with 2 rows idle: 12 rows in two passes, not three runs of up to 6), then scattered
  // back. Prefills (long runs) keep their runs.
  std::vector<std::pair<int64_t, int64_t>> pieces;
  int64_t computed = 0;
  if (runs.counts != nullptr && rows <= kMaxGatheredRows) {
    runs.Runs(0, rows, [&](int64_t s, int64_t n) {
      pieces.emplace_back(s, n);
      computed += n;
    });
  }
  if (pieces.size() < 2) {
    run(x_data, runs, y_data, residual_data);
    return ffi::Error::Success();
  }
  std::vector<float> x_rows(computed * d_in), y_rows(computed * d_out),
      res_rows(residual_data == nullptr ? 0 : computed * d_out);
  int64_t at = 0;
  for (const auto& [s, n] : pieces) {
    std::copy(x_data + s * d_in, x_data + (s + n) * d_in, x_rows.data() + at * d_in);
    if (residual_data != nullptr) {
      std::copy(residual_data + s * d_out, residual_data + (s + n) * d_out,
                res_rows.data() + at * d_out);
    }
    at += n;
  }
  run(x_rows.data(), RowRuns{computed, computed, nullptr}, y_rows.data(),
      residual_data == nullptr ? nullptr : res_rows.data());
  at = 0;
  for (const auto& [s, n] : pieces) {
    std::copy(y_rows.data() + at * d_out, y_rows.data() + (at + n) * d_out, y_data + s * d_out);
    at += n;
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpsjaxPackedMatmul, PackedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // norm scale, or empty
                                  .Arg<ffi::Buffer<ffi::F32>>()  // residual, or empty
                                  .Arg<ffi::AnyBuffer>()  // w: float32, bfloat16, int8, uint8
                                  .Arg<ffi::Buffer<ffi::F32>>()  // int8, w8a8: column scales
                                  .Arg<ffi::Buffer<ffi::S32>>()  // counts [B], or empty: all rows
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("isa")
                                  .Attr<int32_t>("prologue")
                                  .Attr<float>("eps"));

extern "C" {
// For the Python side (ctypes): whether this CPU runs `isa`, and the best one it runs.
int spsjax_isa_supported(int isa) { return spsjax::Supported(isa) ? 1 : 0; }
int spsjax_best_isa() { return spsjax::Best(); }
// Threads a kernel call may use (parallel.h, UsableCpus), and helper threads started so far.
int spsjax_native_threads() { return static_cast<int>(spsjax::UsableCpus()); }
int spsjax_native_helpers() { return static_cast<int>(spsjax::Workers::Started()); }
// The XLA FFI API version of the headers the handlers were compiled against (major * 1000 +
// minor): an XLA older than that refuses them (library.py checks before registering).
int spsjax_ffi_api_version() { return XLA_FFI_API_MAJOR * 1000 + XLA_FFI_API_MINOR; }
// For tests: the CPU quota found under `root` for the cgroups listed in `proc_cgroup` (the text of
// /proc/self/cgroup), 0 if none (parallel.h, CgroupCpuLimit).
int spsjax_cgroup_cpu_limit(const char* root, const char* proc_cgroup) {
  return static_cast<int>(spsjax::CgroupCpuLimit(root, proc_cgroup));
}
}
