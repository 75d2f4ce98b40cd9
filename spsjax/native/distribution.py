"""The distribution a sampler draws from, and one draw from it, through the native kernel.

`probabilities_and_draw` runs `sampling.cc`: per row, temperature, top-k, top-p (ties by id),
min-p, typical-p, the epsilon and eta cutoffs and renormalisation, then the inverse-CDF draw with the given uniform number; the law is that of
`spsjax.sampling.processors` (which dispatches here on the CPU), equal up to float rounding.
Where XLA's ops take 16 sequential steps of vocabulary-wide work for top-p and two matrix products
for a draw's prefix sums, the kernel makes one pass for the softmax, buckets the probabilities for
top-p and sorts only the bucket where the mass crosses top_p.

`accept` runs the accept step of speculative sampling (`spsjax.sampling.rejection`) for every row
in one call: the acceptance tests, the residual max(0, p - q) and its draw, where XLA's ops are a
dozen vocabulary-wide fusions and two matrix products per row.
"""

import jax
import jax.numpy as jnp
import numpy as np

from spsjax.native import library


def probabilities_and_draw(logits_xV: jax.Array, uniforms_x: jax.Array, *, temperature: float,
                           top_k: int, top_p: float, min_logit: float = -np.inf,
                           typical_p: float = 1.0, epsilon_cutoff: float = 0.0,
                           eta_cutoff: float = 0.0, isa: str = 'best'
                           ) -> tuple[jax.Array, jax.Array]:
  """(float32[..., V] probabilities, int32[...] tokens); the CPU kernel only (no fallback).
  `top_k` 0 or >= V keeps every token; `min_logit` is min-p's cut on the scaled logits
  (`SamplingConfig.min_logit`, -inf: off); typical_p (1: off), epsilon_cutoff and eta_cutoff
  (0: off) as `SamplingConfig`'s."""
  lead, V = logits_xV.shape[:-1], logits_xV.shape[-1]
  logits_RxV = logits_xV.reshape(-1, V).astype(jnp.float32)
  R = logits_RxV.shape[0]
  out = (jax.ShapeDtypeStruct((R, V), jnp.float32), jax.ShapeDtypeStruct((R,), jnp.int32))
  probs_RxV, tokens_R = jax.ffi.ffi_call('spsjax_probabilities', out, vmap_method='sequential')(
      logits_RxV, uniforms_x.reshape(R).astype(jnp.float32), temperature=np.float32(temperature),
      top_k=np.int32(top_k if 0 < top_k < V else 0), top_p=np.float32(top_p),
      min_logit=np.float32(min_logit), typical_p=np.float32(typical_p),
      epsilon_cutoff=np.float32(epsilon_cutoff), eta_cutoff=np.float32(eta_cutoff), isa=np.int32(library.isa_code(isa)))
  return probs_RxV.reshape(lead + (V,)), tokens_R.reshape(lead)


def accept(p_BxKp1xV: jax.Array, q_BxKxV: jax.Array, drafts_BxK: jax.Array, num_B: jax.Array,
           u_BxK: jax.Array, u_token_B: jax.Array, *, lenience: float, isa: str = 'best'
           ) -> tuple[jax.Array, jax.Array]:
  """(int32[B] accepted drafts, int32[B] the token after them) with the given uniform numbers
  (`rejection.accept_and_resample`'s, drawn from its keys); the CPU kernel only (no fallback)."""
  B = p_BxKp1xV.shape[0]
  out = (jax.ShapeDtypeStruct((B,), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.int32))
  return jax.ffi.ffi_call('spsjax_accept', out, vmap_method='sequential')(
      p_BxKp1xV.astype(jnp.float32), q_BxKxV.astype(jnp.float32), drafts_BxK.astype(jnp.int32),
      num_B.astype(jnp.int32), u_BxK.astype(jnp.float32), u_token_B.astype(jnp.float32),
      lenience=np.float32(lenience), isa=np.int32(library.isa_code(isa)))
