// Attention of a few new positions over the KV cache, for XLA:CPU through the FFI.
//
// For each (row b, kv head k): the T * G queries of this call (T new positions, G query heads per
// kv head) attend to the slots [0, starts[b] + T) of that row's keys and values (cache layout
// [B, S, K, H]), each query only up to its own position starts[b] + t. Unlike XLA's dots over the
// whole cache, it reads only the slots in use and never transposes the cache. Compiled for AVX-512, AVX2 and the baseline like
// packed_matmul.cc.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using HeadFn = void (*)(const float*, const float*, const float*, int64_t, int64_t, int64_t,
                        int64_t, int64_t, int64_t, float, float*, float*);

#define SPSJAX_KERNEL_FILE "decode_attention_kernel.inc"
#include "variants.inc"
#undef SPSJAX_KERNEL_FILE

HeadFn Kernel(int32_t isa) { return SPSJAX_BY_ISA(isa, AttendHead); }

bool SameDims(ffi::Span<const int64_t> a, ffi::Span<const int64_t> b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
}

// Below this many multiply-adds a call runs on the calling thread.
constexpr int64_t kMinParallelWork = 1 << 15;

ffi::Error DecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                               ffi::Buffer<ffi::F32> keys, ffi::Buffer<ffi::F32> values,
                               ffi::Buffer<ffi::S32> starts, ffi::ResultBuffer<ffi::F32> out,
                               float scale, int32_t isa) {
  const auto q_dims = q.dimensions();
  const auto k_dims = keys.dimensions();
  if (q_dims.size() != 5 || k_dims.size() != 4 || !SameDims(values.dimensions(), k_dims) ||
      starts.dimensions().size() != 1 || !SameDims(out->dimensions(), q_dims)) {
    return ffi::Error::InvalidArgument(
        "decode_attention: want q [B, T, K, G, H], keys and values [B, S, K, H], starts [B], "
        "out like q.");
  }
  const int64_t B = q_dims[0], T = q_dims[1], K = q_dims[2], G = q_dims[3], H = q_dims[4];
  const int64_t S = k_dims[1], J = T * G;
  if (k_dims[0] != B || k_dims[2] != K || k_dims[3] != H || starts.dimensions()[0] != B) {
    return ffi::Error::InvalidArgument("decode_attention: shapes do not agree.");
  }
  if (!spsjax::Resolve(&isa)) {
    return ffi::Error::InvalidArgument(
        "decode_attention: this CPU lacks the instruction set asked.");
  }
  const int32_t* starts_data = starts.typed_data();
  for (int64_t b = 0; b < B; ++b) {
    if (starts_data[b] < 0 || starts_data[b] + T > S) {
      return ffi::Error::InvalidArgument("decode_attention: a row's positions exceed the cache.");
    }
  }
  const HeadFn kernel = Kernel(isa);
  const float* q_data = q.typed_data();
  const float* k_data = keys.typed_data();
  const float* v_data = values.typed_data();
  float* out_data = out->typed_data();
  const int64_t work = B * K * J * S * H;
  const int64_t threads = work < kMinParallelWork ? 1 : spsjax::MaxThreads(pool);
  spsjax::ParallelFor(pool, B * K, threads, [=](int64_t begin, int64_t end) {
    // One (row, kv head)'s queries are G consecutive rows of H at each of the T positions:
    // gathered into [J, H] (j = t * G + g) for the kernel, and its outputs scattered back.
    thread_local std::vector<float> scores, q_rows, out_rows;
    q_rows.resize(J * H);
    out_rows.resize(J * H);
    for (int64_t bk = begin; bk < end; ++bk) {
      const int64_t b = bk / K, k = bk % K;
      const int64_t n = std::min<int64_t>(S, starts_data[b] + T);
      if (static_cast<int64_t>(scores.size()) < J * n) scores.resize(J * n);
      for (int64_t t = 0; t < T; ++t) {
        const float* src = q_data + ((b * T + t) * K + k) * G * H;
        std::copy(src, src + G * H, q_rows.data() + t * G * H);
      }
      const int64_t offset = (b * S * K + k) * H;  // Slot 0 of row b, head k.
      kernel(q_rows.data(), k_data + offset, v_data + offset, K * H, J, G, H, S,
             starts_data[b], scale, scores.data(), out_rows.data());
      for (int64_t t = 0; t < T; ++t) {
        std::copy(out_rows.data() + t * G * H, out_rows.data() + (t + 1) * G * H,
                  out_data + ((b * T + t) * K + k) * G * H);
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpsjaxDecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("isa"));
