"""The distribution a sampler draws from, and one draw from it, through the native kernel.

`probabilities_and_draw` runs `sampling.cc`: per row, temperature, top-k, top-p (ties by id) and
renormalisation, then the inverse-CDF draw with the given uniform number; the law is that of
`spsjax.sampling.processors` (which dispatches here on the CPU), equal up to float rounding.
Where XLA's ops take 16 sequential steps of vocabulary-wide work for top-p and two matrix products
for a draw's prefix sums, the kernel makes one pass for the softmax, buckets the probabilities for
top-p and sorts only the bucket where the mass crosses top_p.
"""

import jax
import jax.numpy as jnp
import numpy as np

from spsjax.native import library


def probabilities_and_draw(logits_xV: jax.Array, uniforms_x: jax.Array, *, temperature: float,
                           top_k: int, top_p: float, isa: str = 'best'
                           ) -> tuple[jax.Array, jax.Array]:
  """(float32[..., V] probabilities, int32[...] tokens); the CPU kernel only (no fallback)."""
  lead, V = logits_xV.shape[:-1], logits_xV.shape[-1]
  logits_RxV = logits_xV.reshape(-1, V).astype(jnp.float32)
  R = logits_RxV.shape[0]
  out = (jax.ShapeDtypeStruct((R, V), jnp.float32), jax.ShapeDtypeStruct((R,), jnp.int32))
  probs_RxV, tokens_R = jax.ffi.ffi_call('spsjax_probabilities', out, vmap_method='sequential')(
      logits_RxV, uniforms_x.reshape(R).astype(jnp.float32), temperature=np.float32(temperature),
      top_k=np.int32(top_k), top_p=np.float32(top_p), isa=np.int32(library.isa_code(isa)))
  return probs_RxV.reshape(lead + (V,)), tokens_R.reshape(lead)
