// The distribution a sampler draws from, and one draw from it, per row, for XLA:CPU through the
// FFI: temperature, top-k, top-p (ties by id), min-p, typical-p, the epsilon and eta cutoffs,
// renormalised, then an inverse-CDF draw with one
// uniform number; spsjax/sampling/processors.py defines the same law with XLA ops. Also the accept
// step of speculative sampling (spsjax/sampling/rejection.py) for a batch of rows in one call.
// Compiled for AVX-512, AVX2 and the baseline like the other kernels.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using RowFn = int32_t (*)(const float*, int64_t, float, int64_t, float, float, float, float,
                          float, float, float*, std::vector<float>&, std::vector<float>&,
                          std::vector<int32_t>&);

#define SPSJAX_KERNEL_FILE "sampling_kernel.inc"
#include "variants.inc"
#undef SPSJAX_KERNEL_FILE

RowFn Kernel(int32_t isa) { return SPSJAX_BY_ISA(isa, ProcessRow); }

using AcceptFn = int32_t (*)(const float*, const float*, const int32_t*, int64_t, int64_t,
                             const float*, float, float, int64_t, float*, std::vector<float>&,
                             int32_t*);
AcceptFn AcceptKernel(int32_t isa) { return SPSJAX_BY_ISA(isa, AcceptRow); }

// Below this many logits a call runs on the calling thread.
constexpr int64_t kMinParallelLogits = 1 << 14;

ffi::Error ProbabilitiesImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits,
                             ffi::Buffer<ffi::F32> uniforms, ffi::ResultBuffer<ffi::F32> probs,
                             ffi::ResultBuffer<ffi::S32> tokens, float temperature,
                             int32_t top_k, float top_p, float min_logit, float typical_p,
                             float epsilon_cutoff, float eta_cutoff, int32_t isa) {
  const auto dims = logits.dimensions();
  if (dims.size() != 2 || uniforms.dimensions().size() != 1 ||
      uniforms.dimensions()[0] != dims[0] ||
      !(probs->dimensions() == dims) || tokens->dimensions().size() != 1 ||
      tokens->dimensions()[0] != dims[0]) {
    return ffi::Error::InvalidArgument(
        "probabilities: want logits [R, V], uniforms [R], probs [R, V], tokens [R].");
  }
  // min_logit: log(min_p) <= 0, or -inf (off); NaN is refused.
  if (!(temperature >= 0.0f) || top_k < 0 || !(top_p > 0.0f && top_p <= 1.0f) ||
      !(min_logit <= 0.0f) || !(typical_p > 0.0f && typical_p <= 1.0f) ||
      !(epsilon_cutoff >= 0.0f && epsilon_cutoff < 1.0f) ||
      !(eta_cutoff >= 0.0f && eta_cutoff < 1.0f)) {
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
      tokens_data[r] = kernel(logits_data + r * V, V, temperature, top_k, top_p, min_logit,
                              typical_p, epsilon_cutoff, eta_cutoff, u_data[r], probs_data + r * V,
                              x, scratch, members);
    }
  });
  return ffi::Error::Success();
}

// Modified rejection sampling for every row (AcceptRow): p [B, k + 1, V], q [B, k, V], the drafts
// [B, k], the number each row proposed [B], the accept uniforms [B, k] and the token's [B]; out
// the accepted count [B] and the token drawn after them [B].
ffi::Error AcceptImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> p, ffi::Buffer<ffi::F32> q,
                      ffi::Buffer<ffi::S32> drafts, ffi::Buffer<ffi::S32> num,
                      ffi::Buffer<ffi::F32> u, ffi::Buffer<ffi::F32> u_token,
                      ffi::ResultBuffer<ffi::S32> accepted, ffi::ResultBuffer<ffi::S32> tokens,
                      float lenience, int32_t isa) {
  const auto pd = p.dimensions(), qd = q.dimensions();
  if (pd.size() != 3 || qd.size() != 3 || qd[0] != pd[0] || qd[1] + 1 != pd[1] ||
      qd[2] != pd[2] || drafts.dimensions().size() != 2 || drafts.dimensions()[0] != pd[0] ||
      drafts.dimensions()[1] != qd[1] || num.element_count() != static_cast<size_t>(pd[0]) ||
      u.element_count() != static_cast<size_t>(pd[0] * qd[1]) ||
      u_token.element_count() != static_cast<size_t>(pd[0]) ||
      accepted->element_count() != static_cast<size_t>(pd[0]) ||
      tokens->element_count() != static_cast<size_t>(pd[0])) {
    return ffi::Error::InvalidArgument(
        "accept: want p [B, k + 1, V], q [B, k, V], drafts [B, k], num [B], u [B, k], "
        "u_token [B], accepted [B], tokens [B].");
  }
  if (!(lenience > 0.0f && lenience <= 1.0f)) {
    return ffi::Error::InvalidArgument("accept: lenience must be in (0, 1].");
  }
  if (!spsjax::Resolve(&isa)) {
    return ffi::Error::InvalidArgument("accept: this CPU lacks the instruction set asked.");
  }
  const int64_t B = pd[0], k = qd[1], V = pd[2];
  const int32_t* drafts_data = drafts.typed_data();
  for (int64_t i = 0; i < B * k; ++i) {
    if (drafts_data[i] < 0 || drafts_data[i] >= V) {
      return ffi::Error::InvalidArgument("accept: a draft token is outside the vocabulary.");
    }
  }
  const AcceptFn kernel = AcceptKernel(isa);
  const float* p_data = p.typed_data();
  const float* q_data = q.typed_data();
  const int32_t* num_data = num.typed_data();
  const float* u_data = u.typed_data();
  const float* ut_data = u_token.typed_data();
  int32_t* accepted_data = accepted->typed_data();
  int32_t* tokens_data = tokens->typed_data();
  const int64_t threads = B * V < kMinParallelLogits ? 1 : spsjax::MaxThreads(pool);
  spsjax::ParallelFor(pool, B, threads, [=](int64_t begin, int64_t end) {
    thread_local std::vector<float> residual, blocks;
    residual.resize(V);
    for (int64_t b = begin; b < end; ++b) {
      accepted_data[b] = kernel(p_data + b * (k + 1) * V, q_data + b * k * V, drafts_data + b * k,
                                k, num_data[b], u_data + b * k, ut_data[b], lenience, V,
                                residual.data(), blocks, tokens_data + b);
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
                                  .Attr<float>("min_logit")
                                  .Attr<float>("typical_p")
                                  .Attr<float>("epsilon_cutoff")
                                  .Attr<float>("eta_cutoff")
                                  .Attr<int32_t>("isa"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpsjaxAccept, AcceptImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // p
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::S32>>()  // drafts
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num
                                  .Arg<ffi::Buffer<ffi::F32>>()  // u
                                  .Arg<ffi::Buffer<ffi::F32>>()  // u_token
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("lenience")
                                  .Attr<int32_t>("isa"));
