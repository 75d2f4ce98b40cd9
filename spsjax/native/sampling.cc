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

#define SPSJAX_KERNEL_FILE "sampling_kernel.inc"
#include "variants.inc"
#undef SPSJAX_KERNEL_FILE

RowFn Kernel(int32_t isa) { return SPSJAX_BY_ISA(isa, ProcessRow); }

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
  if (!spsjax::Resolve(&isa)) {
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
