// The distribution a sampler draws from, and one draw from it, per row, for XLA:CPU through the
// FFI: temperature, top-k, top-p (ties by id), renormalised, then an inverse-CDF draw with one
// uniform number; spsjax/sampling/processors.py defines the same law with XLA ops. Compiled for
// AVX-512, AVX2 and the baseline like the other kernels.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using RowFn = int32_t (*)(const float*, int64_t, float, int64_t, float, float, float*,
                          std::vector<float>&, std::vector<float>&, std::vector<int32_t>&);

namespace baseline {
#define SPSJAX_LANES 4
#include "sampling_kernel.inc"
#undef SPSJAX_LANES
}  // namespace baseline

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
#define SPSJAX_LANES 8
#include "sampling_kernel.inc"
#undef SPSJAX_LANES
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
namespace avx512 {
#define SPSJAX_LANES 16
#include "sampling_kernel.inc"
#undef SPSJAX_LANES
}  // namespace avx512
#pragma GCC pop_options
#endif

RowFn Kernel(int32_t isa) {
  switch (isa) {
#if defined(__x86_64__)
    case spsjax::kAvx512:
      return avx512::ProcessRow;
    case spsjax::kAvx2:
      return avx2::ProcessRow;
#endif
    default:
      return baseline::ProcessRow;
  }
}

// Below this many logits a call runs on the calling thread.
constexpr int64_t kMinParallelLogits = 1 << 14;

ffi::Error ProbabilitiesImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits,
                             ffi::Buffer<ffi::F32> uniforms, ffi::ResultBuffer<ffi::F32> probs,
                             ffi::ResultBuffer<ffi::S32> tokens, float temperature,
                             int32_t top_k, float top_p, int32_t isa) {
  const auto dims = logits.dimensions();
  if (dims.size() != 2 || uniforms.dimensions().size() != 1 ||
      uniforms.dimensions()[0] != dims[0] ||
      !(probs->dimensions() == dims) || tokens->dimensions().size() != 1 ||
      tokens->dimensions()[0] != dims[0]) {
    return ffi::Error::InvalidArgument(
        "probabilities: want logits [R, V], uniforms [R], probs [R, V], tokens [R].");
  }
  if (!(temperature >= 0.0f) || top_k < 0 || !(top_p > 0.0f && top_p <= 1.0f)) {
    return ffi::Error::InvalidArgument("probabilities: bad sampling settings.");
  }
  if (isa == spsjax::kBest) isa = spsjax::Best();
  if (!spsjax::Supported(isa)) {
    return ffi::Error::InvalidArgument("probabilities: this CPU lacks the instruction set asked.");
  }
  const int64_t R = dims[0], V = dims[1];
  if (V == 0) return ffi::Error::InvalidArgument("probabilities: empty vocabulary.");
  const RowFn kernel = Kernel(isa);
  const float* logits_data = logits.typed_data();
  const float* u_data = uniforms.typed_data();
  float* probs_data = probs->typed_data();
  int32_t* tokens_data = tokens->typed_data();
  const int64_t threads = R * V < kMinParallelLogits ? 1 : spsjax::MaxThreads(pool);
  spsjax::ParallelFor(pool, R, threads, [=](int64_t begin, int64_t end) {
    thread_local std::vector<float> x, scratch;
    thread_local std::vector<int32_t> members;
    for (int64_t r = begin; r < end; ++r) {
      tokens_data[r] = kernel(logits_data + r * V, V, temperature, top_k, top_p, u_data[r],
                              probs_data + r * V, x, scratch, members);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpsjaxProbabilities, ProbabilitiesImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("temperature")
                                  .Attr<int32_t>("top_k")
                                  .Attr<float>("top_p")
                                  .Attr<int32_t>("isa"));
