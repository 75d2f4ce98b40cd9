"""Attention of a few new positions over the KV cache through the native kernel, or XLA's ops.

`decode_attention(q, keys, values, starts)` computes, for every row b, kv head k and new position
t, softmax(q k^T / sqrt(H)) v over the cache slots [0, starts[b] + t] (the causal mask of a cached
call), the same numbers as the einsum-softmax-einsum of `spsjax.models.transformer` up to float
reassociation and an exp accurate to ~2e-7. The kernel (`decode_attention.cc`) reads only the
slots in use, where XLA's dots read (and on XLA:CPU transpose) the whole cache every call.
"""

import jax
import jax.numpy as jnp
import numpy as np

from spsjax.native import library

# Query rows per (row, kv head), T * G, up to which the kernel runs; its scores for one (row, kv
# head) take T * G * S floats. Prefills run it too: for `reference_target` a 128-token prefill
# took 23 ms with it and 35 ms with XLA's dots (which transpose the cache), 512 tokens 109 ms and
# 165 ms.
MAX_KERNEL_QUERIES = 4096


def reference(q_BxTxKxGxH, keys_BxSxKxH, values_BxSxKxH, starts_B):
  """XLA ops: the masked attention of `spsjax.models.transformer`, float32."""
  S, H = keys_BxSxKxH.shape[1], keys_BxSxKxH.shape[3]
  T = q_BxTxKxGxH.shape[1]
  positions_BxT = starts_B[:, None] + jnp.arange(T)[None, :]
  mask_BxTxS = jnp.arange(S)[None, None, :] <= positions_BxT[:, :, None]
  scores = jnp.einsum('BTKGH,BSKH->BKGTS', q_BxTxKxGxH, keys_BxSxKxH,
                      preferred_element_type=jnp.float32) * H**-0.5
  scores = jnp.where(mask_BxTxS[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(values_BxSxKxH.dtype)
  return jnp.einsum('BKGTS,BSKH->BTKGH', probs, values_BxSxKxH)


def _kernel(q_BxTxKxGxH, keys_BxSxKxH, values_BxSxKxH, starts_B, isa):
  H = q_BxTxKxGxH.shape[-1]
  out = jax.ShapeDtypeStruct(q_BxTxKxGxH.shape, jnp.float32)
  return jax.ffi.ffi_call('spsjax_decode_attention', out, vmap_method='sequential')(
      q_BxTxKxGxH.astype(jnp.float32), keys_BxSxKxH, values_BxSxKxH, starts_B.astype(jnp.int32),
      scale=np.float32(H**-0.5), isa=np.int32(library.isa_code(isa)))


def use_kernel(q_BxTxKxGxH, keys_BxSxKxH) -> bool:
  """Whether `decode_attention` would run the kernel for these operands (on a CPU)."""
  _, T, _, G, _ = q_BxTxKxGxH.shape
  return (library.available() and keys_BxSxKxH.dtype == jnp.float32
          and T * G <= MAX_KERNEL_QUERIES)


def decode_attention(q_BxTxKxGxH: jax.Array, keys_BxSxKxH: jax.Array, values_BxSxKxH: jax.Array,
                     starts_B: jax.Array, *, isa: str = 'best') -> jax.Array:
  """[B, T, K, G, H] attention outputs (module docstring); the caller keeps starts + T <= S."""
  if not use_kernel(q_BxTxKxGxH, keys_BxSxKxH):
    return reference(q_BxTxKxGxH, keys_BxSxKxH, values_BxSxKxH, starts_B)
  operands = (q_BxTxKxGxH, keys_BxSxKxH, values_BxSxKxH, starts_B)
  return library.on_cpu(operands, lambda ops: _kernel(*ops, isa),
                        lambda ops: reference(*ops))
