"""Logit processors: the one function that turns logits into the distribution actually sampled.

Every sampler (ArS, and both the draft and the target in SpS) calls `probabilities`, so a draft and a
target with the same `SamplingConfig` are processed identically. Order: temperature, then top-k,
then top-p on what top-k kept, then renormalise. Temperature 0 is greedy: a one-hot on the argmax.
Output is float32 whatever the model dtype.
"""

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """temperature 0: greedy; top_k 0: off; top_p 1.0: off. Hashable, so it is a static jit arg."""
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if not self.temperature >= 0:  # Also rejects NaN.
      raise ValueError(f'temperature must be >= 0 (0 is greedy), got {self.temperature}.')
    if int(self.top_k) != self.top_k or self.top_k < 0:
      raise ValueError(f'top_k must be an integer >= 0 (0 is off), got {self.top_k}.')
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f'top_p must be in (0, 1] (1 is off), got {self.top_p}.')

  @property
  def greedy(self) -> bool:
    return self.temperature == 0


def probabilities(logits_xV: jax.Array, sampling: SamplingConfig) -> jax.Array:
  """float32[..., V]: the distribution a sampler draws from under `sampling`."""
  logits_xV = logits_xV.astype(jnp.float32)
  V = logits_xV.shape[-1]
  if sampling.greedy:
    return jax.nn.one_hot(jnp.argmax(logits_xV, axis=-1), V, dtype=jnp.float32)
  logits_xV = logits_xV / sampling.temperature
  probs_xV = jax.nn.softmax(logits_xV, axis=-1)
  top_k = sampling.top_k if 0 < sampling.top_k < V else 0
  if top_k == 0 and sampling.top_p == 1.0:
    return probs_xV

  # Rank tokens once (descending, ties by id), decide what to keep in rank order, map back.
  order_xV = jnp.argsort(-logits_xV, axis=-1, stable=True)
  sorted_xV = jnp.take_along_axis(probs_xV, order_xV, axis=-1)
  keep_sorted_xV = jnp.ones_like(sorted_xV, dtype=bool)
  if top_k:
    keep_sorted_xV = jnp.broadcast_to(jnp.arange(V) < top_k, sorted_xV.shape)
    sorted_xV = jnp.where(keep_sorted_xV, sorted_xV, 0.0)
    sorted_xV = sorted_xV / jnp.sum(sorted_xV, axis=-1, keepdims=True)
  if sampling.top_p < 1.0:
    # Smallest prefix whose mass reaches top_p: keep a token while the mass before it is < top_p.
    mass_before_xV = jnp.cumsum(sorted_xV, axis=-1) - sorted_xV
    keep_sorted_xV = keep_sorted_xV & (mass_before_xV < sampling.top_p)
  inverse_xV = jnp.argsort(order_xV, axis=-1)
  keep_xV = jnp.take_along_axis(jnp.broadcast_to(keep_sorted_xV, order_xV.shape), inverse_xV,
                                axis=-1)
  probs_xV = jnp.where(keep_xV, probs_xV, 0.0)
  return probs_xV / jnp.sum(probs_xV, axis=-1, keepdims=True)


def sample(keys_B: jax.Array, probs_BxV: jax.Array) -> jax.Array:
  """int32[B]: one draw per row from its distribution, each row with its own key."""
  draw = lambda key, p_V: jax.random.categorical(key, jnp.log(p_V))
  return jax.vmap(draw)(keys_B, probs_BxV).astype(jnp.int32)
