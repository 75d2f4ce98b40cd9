// Few-row float32 matrix products y[R, F] = x[R, D] @ W[D, F] with W packed in panels of 16 output
// columns ([ceil(F / 16), D, 16], see packed.py), for XLA:CPU through the FFI.
//
// XLA's CPU dot costs 2-4x as much for 5 rows as for 1 at decoder sizes; this kernel streams each
// panel once per call, keeping every row's 16 accumulators in registers, so 1 to 8 rows cost about
// the same: the bandwidth of reading W. Panels are shared among XLA's intra-op threads.
//
// The kernel is compiled three times (AVX-512, AVX2 + FMA, and the compiler's baseline) from
// packed_matmul_kernel.inc and the best one this CPU runs is chosen at call time, so one build
// serves any x86-64 (or, baseline only, any other) CPU.

#include <algorithm>
#include <cstdint>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kPanel = 16;

using PanelsFn = void (*)(const float*, int64_t, int64_t, const float*, int64_t, float*, int64_t,
                          int64_t);

#define SPSJAX_KERNEL_FILE "packed_matmul_kernel.inc"
#include "variants.inc"
#undef SPSJAX_KERNEL_FILE

PanelsFn Kernel(int32_t isa) { return SPSJAX_BY_ISA(isa, Panels); }

// Below this many weight floats a call runs on the calling thread: waking a pool thread costs more.
constexpr int64_t kMinParallelWeights = 1 << 16;

ffi::Error PackedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                            ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y, int32_t isa) {
  const auto x_dims = x.dimensions();
  const auto w_dims = w.dimensions();
  const auto y_dims = y->dimensions();
  if (x_dims.size() != 2 || w_dims.size() != 3 || y_dims.size() != 2) {
    return ffi::Error::InvalidArgument("packed_matmul: want x [R, D], w [P, D, 16], y [R, F].");
  }
  const int64_t rows = x_dims[0], d_in = x_dims[1], d_out = y_dims[1];
  const int64_t num_panels = (d_out + kPanel - 1) / kPanel;
  if (w_dims[0] != num_panels || w_dims[1] != d_in || w_dims[2] != kPanel || y_dims[0] != rows) {
    return ffi::Error::InvalidArgument("packed_matmul: shapes of x, w and y do not agree.");
  }
  if (!spsjax::Resolve(&isa)) {
    return ffi::Error::InvalidArgument("packed_matmul: this CPU lacks the instruction set asked.");
  }
  const PanelsFn kernel = Kernel(isa);
  const float* x_data = x.typed_data();
  const float* w_data = w.typed_data();
  float* y_data = y->typed_data();
  const int64_t threads =
      num_panels * d_in * kPanel < kMinParallelWeights ? 1 : spsjax::MaxThreads(pool);
  spsjax::ParallelFor(pool, num_panels, threads, [=](int64_t p0, int64_t p1) {
    kernel(x_data, rows, d_in, w_data, d_out, y_data, p0, p1);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpsjaxPackedMatmul, PackedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("isa"));

extern "C" {
// For the Python side (ctypes): whether this CPU runs `isa`, and the best one it runs.
int spsjax_isa_supported(int isa) { return spsjax::Supported(isa) ? 1 : 0; }
int spsjax_best_isa() { return spsjax::Best(); }
}
