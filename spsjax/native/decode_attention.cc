// Cached attention of a few new positions, for XLA:CPU through the FFI: rotary embedding, the KV
// cache write and the attention over the cache in one call.
//
// Inputs: this call's projections qkv [B, T, N + 2K, H] (N query heads, then K key and K value
// heads, before the rotary embedding), the caches keys and values [B, S, K, H] and starts [B].
// Row b's new positions are starts[b] + t. For each (row b, kv head k) the kernel rotates the T
// keys and the T * G queries of that head group (G = N / K, query head n = k G + g), writes the
// keys and values into slots starts[b] + t, and lets the queries attend to the slots [0,
// starts[b] + T), each only up to its own position. With counts [B] (a prefill of right-padded
// prompts) row b takes its first counts[b] positions only: the padding is neither written nor
// attended from, and its outputs are zeros. With window > 0 a query sees only the last `window`
// slots up to its own (a sliding window: the slots before are not read); with softcap > 0 its
// scores x become softcap tanh(x / softcap) before the softmax. With a token tree (each row's:
// depths [B, W] and allowed [B, T, W], W >= T; window 0) the T positions are nodes W - T .. W - 1
// of a tree whose root sits at slot root = starts[b] - (W - T): node w at slot root + w and
// position root + depths[b, w] (its rotation's angle); query t sees the slots before the root, its
// own, and the tree's slots root + w (w < W - T + t) where allowed[b, t, w] is nonzero (its
// ancestors'). The caches come back as outputs
// aliased to the inputs (the call writes T slots in place; if XLA gave distinct buffers the cache
// is copied first). Unlike XLA's dots over the whole cache, it reads only the slots in use and
// never transposes the cache; unlike separate XLA ops for the rotation and the writes, it costs
// one dispatch. Compiled for AVX-512, AVX2 and the baseline like packed_matmul.cc.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// A token tree's mask for a block of queries: the tree's slot root + w is seen by the query at
// slot start + t (t from the block's first) iff allowed[t * ld + w] (w below its own node); no
// tree: allowed null.
struct TreeRows {
  const uint8_t* allowed;
  int64_t ld;
  int64_t root;
};

// AttendHead (one kv head) and AttendRow (all of a row's): (q, keys, values, slot stride, J, G, H,
// S, start, window, softcap, tree, scores, out).
using AttendFn = void (*)(const float*, const float*, const float*, int64_t, int64_t, int64_t,
                          int64_t, int64_t, int64_t, int64_t, float, TreeRows, float*, float*);

#define SPSJAX_KERNEL_FILE "decode_attention_kernel.inc"
#include "variants.inc"
#undef SPSJAX_KERNEL_FILE

AttendFn HeadKernel(int32_t isa) { return SPSJAX_BY_ISA(isa, AttendHead); }
AttendFn RowKernel(int32_t isa) { return SPSJAX_BY_ISA(isa, AttendRow); }

bool SameDims(ffi::Span<const int64_t> a, ffi::Span<const int64_t> b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
}

// Below this many multiply-adds a call runs on the calling thread.
constexpr int64_t kMinParallelWork = 1 << 15;

// Floats a thread's scratch buffer keeps between calls (1 MiB): a decode step's buffers fit and
// are reused by the next call; a long prefill's (megabytes per thread) are freed after it.
constexpr size_t kKeepFloats = size_t{1} << 18;

// The model's rotary embedding (half-split) of a head's first 2 half dims, times `rotated`:
// out[i] = (x[i] cos - x[i + half] sin) rotated, out[i + half] = (x[i + half] cos + x[i] sin)
// rotated, with the angles' cos and sin given for i < half; the dims from 2 half to H pass, times
// `passed` (GPT-NeoX rotates a part of each head, GPT-2 none). Queries take the attention's
// 1 / sqrt(H) here (in both), so scores come out scaled; YaRN's and LongRoPE's attention factor
// multiplies the rotated dims only (of queries and keys), as transformers' cos and sin do.
void Rotate(const float* x, const float* cos_h, const float* sin_h, int64_t half, int64_t H,
            float rotated, float passed, float* out) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    out[i] = (x1 * cos_h[i] - x2 * sin_h[i]) * rotated;
    out[i + half] = (x2 * cos_h[i] + x1 * sin_h[i]) * rotated;
  }
  for (int64_t i = 2 * half; i < H; ++i) out[i] = x[i] * passed;
}

ffi::Error CachedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> qkv,
                               ffi::Buffer<ffi::F32> keys_in, ffi::Buffer<ffi::F32> values_in,
                               ffi::Buffer<ffi::S32> starts, ffi::Buffer<ffi::S32> counts,
                               ffi::Buffer<ffi::F32> freqs, ffi::Buffer<ffi::S32> tree_depths,
                               ffi::Buffer<ffi::U8> tree_allowed, ffi::ResultBuffer<ffi::F32> out,
                               ffi::ResultBuffer<ffi::F32> keys, ffi::ResultBuffer<ffi::F32> values,
                               float scale, float rope_scale, int64_t window, float softcap,
                               int32_t isa) {
  const auto x_dims = qkv.dimensions();
  const auto k_dims = keys_in.dimensions();
  if (x_dims.size() != 4 || k_dims.size() != 4 || !SameDims(values_in.dimensions(), k_dims) ||
      !SameDims(keys->dimensions(), k_dims) || !SameDims(values->dimensions(), k_dims) ||
      starts.dimensions().size() != 1 || out->dimensions().size() != 5) {
    return ffi::Error::InvalidArgument(
        "cached_attention: want qkv [B, T, N + 2K, H], keys and values [B, S, K, H], starts "
        "[B], out [B, T, K, N / K, H].");
  }
  const int64_t B = x_dims[0], T = x_dims[1], M = x_dims[2], H = x_dims[3];
  const int64_t S = k_dims[1], K = k_dims[2], N = M - 2 * K;
  if (k_dims[0] != B || k_dims[3] != H || starts.dimensions()[0] != B || N < K || N % K != 0 ||
      H % 2 != 0) {
    return ffi::Error::InvalidArgument("cached_attention: shapes do not agree.");
  }
  // Rotated pairs per head: freqs holds one frequency a pair (H / 2 for a whole head).
  const int64_t G = N / K, J = T * G, half = static_cast<int64_t>(freqs.element_count());
  const int64_t want_out[5] = {B, T, K, G, H};
  if (!std::equal(want_out, want_out + 5, out->dimensions().begin())) {
    return ffi::Error::InvalidArgument("cached_attention: out must be [B, T, K, N / K, H].");
  }
  if (!spsjax::Resolve(&isa)) {
    return ffi::Error::InvalidArgument(
        "cached_attention: this CPU lacks the instruction set asked.");
  }
  if (counts.element_count() != 0 && static_cast<int64_t>(counts.element_count()) != B) {
    return ffi::Error::InvalidArgument("cached_attention: counts must be [B] or empty.");
  }
  const int32_t* counts_data = counts.element_count() == 0 ? nullptr : counts.typed_data();
  if (window < 0 || !(softcap >= 0.0f)) {
    return ffi::Error::InvalidArgument("cached_attention: want window >= 0 and softcap >= 0.");
  }
  if (2 * half > H) {
    return ffi::Error::InvalidArgument("cached_attention: freqs must be [R / 2], R <= H.");
  }
  // A tree, each row's: W nodes up to this call's last, the first W - T written before
  // (tree_first); depths [B, W], allowed [B, T, W].
  const bool tree = tree_allowed.element_count() != 0;
  const auto a_dims = tree_allowed.dimensions();
  const auto d_dims = tree_depths.dimensions();
  const int64_t W = tree && a_dims.size() == 3 ? a_dims[2] : 0, tree_first = tree ? W - T : 0;
  if (tree && (a_dims.size() != 3 || a_dims[0] != B || a_dims[1] != T || W < T ||
               d_dims.size() != 2 || d_dims[0] != B || d_dims[1] != W)) {
    return ffi::Error::InvalidArgument(
        "cached_attention: a tree wants depths [B, W] and allowed [B, T, W], W >= T.");
  }
  if (tree && window > 0) {
    return ffi::Error::InvalidArgument("cached_attention: a tree takes no window.");
  }
  const int32_t* depths_data = tree ? tree_depths.typed_data() : nullptr;
  const uint8_t* allowed_data = tree ? tree_allowed.typed_data() : nullptr;
  const int32_t* starts_data = starts.typed_data();
  for (int64_t b = 0; b < B; ++b) {
    if (starts_data[b] < tree_first || starts_data[b] + T > S) {
      return ffi::Error::InvalidArgument("cached_attention: a row's positions exceed the cache.");
    }
  }
  float* k_data = keys->typed_data();
  float* v_data = values->typed_data();
  const size_t cache_bytes = sizeof(float) * B * S * K * H;
  if (k_data != keys_in.typed_data()) std::memcpy(k_data, keys_in.typed_data(), cache_bytes);
  if (v_data != values_in.typed_data()) std::memcpy(v_data, values_in.typed_data(), cache_bytes);
  // The model's angles in float32: position * freqs[i] (its rotary frequencies, rescaled or not).
  const float* x_data = qkv.typed_data();
  float* out_data = out->typed_data();
  const float* freq = freqs.typed_data();
  const int64_t work = B * K * J * S * H;
  const int64_t threads = work < kMinParallelWork ? 1 : spsjax::MaxThreads(pool);
  // A task is a row's group of `heads` kv heads. A few positions (a decode step, an SpS score),
  // where whole rows give no thread more kv heads than single heads would (a batch of 8 on 2
  // threads, not of 1 or 3): whole rows (`AttendRow`), which read each row's cache in address
  // order (a batch-8 step of reference_target at 384 slots on a 2-core Zen 4: 0.84-1.05x the
  // time, median 0.94). Else (a prefill, or too few rows) one kv head (`AttendHead`).
  const bool whole_rows = T <= baseline::kQueryBlock && K > 1 &&
                          (B + threads - 1) / threads * K <= (B * K + threads - 1) / threads;
  const int64_t heads = whole_rows ? K : 1;
  const AttendFn kernel = whole_rows ? RowKernel(isa) : HeadKernel(isa);
  spsjax::ParallelFor(pool, B * K / heads, threads, [=](int64_t begin, int64_t end) {
    // Head k's queries are its G consecutive query heads at each of the `used` positions: rotated
    // into q_rows [heads, used * G, H] (j = t * G + g) for the kernel, and its outputs [heads,
    // used * G, H] scattered back.
    // `scores` holds heads * min(T, kQueryBlock) * G * n floats (AttendHead: one block of
    // positions).
    thread_local std::vector<float> scores, q_rows, out_rows, cos_t, sin_t;
    q_rows.resize(heads * J * H);
    out_rows.resize(heads * J * H);
    cos_t.resize(T * half);
    sin_t.resize(T * half);
    int64_t angles_row = -1;  // The row whose cos_t / sin_t these are: its K heads share them.
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task * heads / K, k0 = task * heads % K, start = starts_data[b];
      const int64_t n = start + T;
      // Positions past counts[b] (padding) are neither written nor attended from; their outputs
      // are zeros.
      const int64_t used =
          counts_data == nullptr ? T : std::clamp<int64_t>(counts_data[b], 0, T);
      const int64_t queries = used * G;  // Per kv head.
      const int64_t block_queries = heads * std::min(T, baseline::kQueryBlock) * G;
      if (static_cast<int64_t>(scores.size()) < block_queries * n) {
        scores.resize(block_queries * n);
      }
      for (int64_t t = 0; t < used && angles_row != b; ++t) {
        const float position = static_cast<float>(
            tree ? start - tree_first + depths_data[b * W + tree_first + t] : start + t);
        for (int64_t i = 0; i < half; ++i) {
          const float angle = position * freq[i];
          cos_t[t * half + i] = std::cos(angle);
          sin_t[t * half + i] = std::sin(angle);
        }
      }
      angles_row = b;
      for (int64_t t = 0; t < used; ++t) {
        const float* x = x_data + (b * T + t) * M * H;
        const float* c = cos_t.data() + t * half;
        const float* s = sin_t.data() + t * half;
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t k = k0 + h;
          const int64_t slot = ((b * S + start + t) * K + k) * H;
          Rotate(x + (N + k) * H, c, s, half, H, rope_scale, 1.0f, k_data + slot);
          std::copy(x + (N + K + k) * H, x + (N + K + k + 1) * H, v_data + slot);
          for (int64_t g = 0; g < G; ++g) {
            Rotate(x + (k * G + g) * H, c, s, half, H, scale * rope_scale, scale,
                   q_rows.data() + (h * queries + t * G + g) * H);
          }
        }
      }
      const int64_t offset = (b * S * K + k0) * H;  // Slot 0 of row b, head k0.
      if (used > 0) {
        const TreeRows rows{tree ? allowed_data + b * T * W : nullptr, W, start - tree_first};
        kernel(q_rows.data(), k_data + offset, v_data + offset, K * H, queries, G, H, S, start,
               window, softcap, rows, scores.data(), out_rows.data());
      }
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t t = 0; t < T; ++t) {
          float* dst = out_data + ((b * T + t) * K + k0 + h) * G * H;
          if (t < used) {
            const float* src = out_rows.data() + (h * queries + t * G) * H;
            std::copy(src, src + G * H, dst);
          } else {
            std::fill(dst, dst + G * H, 0.0f);
          }
        }
      }
    }
    for (std::vector<float>* buffer : {&scores, &q_rows, &out_rows, &cos_t, &sin_t}) {
      if (buffer->capacity() > kKeepFloats) std::vector<float>().swap(*buffer);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpsjaxCachedAttention, CachedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // starts [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // counts [B], or empty
                                  .Arg<ffi::Buffer<ffi::F32>>()  // freqs [R / 2]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // tree depths [B, W], or empty
                                  .Arg<ffi::Buffer<ffi::U8>>()   // tree allowed [B, T, W], or empty
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("rope_scale")
                                  .Attr<int64_t>("window")
                                  .Attr<float>("softcap")
                                  .Attr<int32_t>("isa"));
