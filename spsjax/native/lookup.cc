// Rows of an embedding table, for XLA:CPU through the FFI: out[r] = table[clip(ids[r], 0, V - 1)].
//
// XLA:CPU emits this gather as a loop fusion that it splits over its thread pool from a few rows
// on; in a decode loop whose products run on the native kernels' own threads the pool is asleep,
// and waking it cost 40 us of a 5-row lookup that takes 1 us here, on the calling thread.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error TakeRowsImpl(ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::S32> ids,
                        ffi::ResultBuffer<ffi::F32> out) {
  const auto t_dims = table.dimensions();
  const auto o_dims = out->dimensions();
  if (t_dims.size() != 2 || ids.dimensions().size() != 1 || o_dims.size() != 2 ||
      o_dims[0] != ids.dimensions()[0] || o_dims[1] != t_dims[1] || t_dims[0] < 1) {
    return ffi::Error::InvalidArgument("take_rows: want table [V, D], ids [R], out [R, D].");
  }
  const int64_t V = t_dims[0], D = t_dims[1], R = o_dims[0];
  const float* t = table.typed_data();
  const int32_t* id = ids.typed_data();
  float* o = out->typed_data();
  for (int64_t r = 0; r < R; ++r) {
    const int64_t v = std::clamp<int64_t>(id[r], 0, V - 1);
    std::memcpy(o + r * D, t + v * D, sizeof(float) * D);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpsjaxTakeRows, TakeRowsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
