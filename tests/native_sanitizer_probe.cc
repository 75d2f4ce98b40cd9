// Deliberate errors for the negative controls of tests/test_native_sanitized.py: linked into the
// sanitizer build of the native kernels only, each FFI handler here makes one error that a live
// AddressSanitizer or UndefinedBehaviorSanitizer must report when XLA calls it from Python.

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// y[i] = x[i] for every i <= n: one float past the end of y's n (XLA's result buffer).
ffi::Error OverflowImpl(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  const int64_t n = static_cast<int64_t>(y->element_count());
  const float* in = x.typed_data();
  float* out = y->typed_data();
  for (int64_t i = 0; i <= n; ++i) out[i] = in[i % n];
  return ffi::Error::Success();
}

// y[0] = x[0] + x[1] in int32, which overflows for the inputs the test gives.
ffi::Error SignedOverflowImpl(ffi::Buffer<ffi::S32> x, ffi::ResultBuffer<ffi::S32> y) {
  const int32_t* in = x.typed_data();
  y->typed_data()[0] = in[0] + in[1];
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpsjaxProbeOverflow, OverflowImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpsjaxProbeSignedOverflow, SignedOverflowImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
