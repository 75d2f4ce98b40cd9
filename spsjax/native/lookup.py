"""Rows of an embedding table (the token lookup of a model placed for CPU decoding).

`take_rows(table, ids)` is `jnp.take(table, ids, axis=0)` for ids in [0, V); ids outside are
clipped into it (a tokenizer never produces one; `jnp.take` would give NaN rows). On the CPU the
native copy (`lookup.cc`) runs on the calling thread: XLA:CPU splits its gather over a thread pool
that sits asleep in a decode loop whose products run on the kernels' own threads, and waking it
costs more than the copy.
"""

import jax
import jax.numpy as jnp

from spsjax.native import library


def _xla(table_VxD, ids):
  return jnp.take(table_VxD, ids, axis=0, mode='clip')


def _kernel(table_VxD, ids):
  out = jax.ShapeDtypeStruct((ids.size, table_VxD.shape[1]), jnp.float32)
  rows = jax.ffi.ffi_call('spsjax_take_rows', out, vmap_method='sequential')(
      table_VxD, ids.reshape(-1).astype(jnp.int32))
  return rows.reshape(ids.shape + table_VxD.shape[1:])


def take_rows(table_VxD: jax.Array, ids: jax.Array, *, use_kernel: bool | None = None) -> jax.Array:
  """`table[ids]`: [*ids.shape, D] (module docstring); the kernel for float32 tables on the CPU
  wherever the library is built (`use_kernel=False`: XLA's gather)."""
  if use_kernel is None:
    use_kernel = library.available() and table_VxD.dtype == jnp.float32
  if not use_kernel:
    return _xla(table_VxD, ids)
  return library.on_cpu((table_VxD, ids), lambda ops: _kernel(*ops), lambda ops: _xla(*ops))
