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
  if top_k:
    probs_xV = _renormalise(jnp.where(_top_k_mask(logits_xV, top_k), probs_xV, 0.0))
  if sampling.top_p < 1.0:
    probs_xV = _renormalise(jnp.where(_top_p_mask(probs_xV, sampling.top_p), probs_xV, 0.0))
  return probs_xV


def _renormalise(probs_xV):
  return probs_xV / jnp.sum(probs_xV, axis=-1, keepdims=True)


def _first_ties(tied_xV, room_x):
  """Among tied tokens, the first `room` by id (ties rank by id, as in a stable sort)."""
  rank_xV = jnp.cumsum(tied_xV.astype(jnp.int32), axis=-1) - 1
  return tied_xV & (rank_xV < room_x[..., None])


def _top_k_mask(logits_xV, k: int):
  """The k most likely tokens, ties by id: those above the k-th largest logit, then tied ones."""
  kth_x = jax.lax.top_k(logits_xV, k)[0][..., -1]
  above_xV = logits_xV > kth_x[..., None]
  room_x = k - jnp.sum(above_xV, axis=-1)
  return above_xV | _first_ties(logits_xV == kth_x[..., None], room_x)


def _top_p_mask(probs_xV, top_p: float):
  """The smallest set of most likely tokens (ties by id) whose mass reaches top_p, without a sort.

  A token is kept iff the mass ranked before it is < top_p. The last kept token's probability v*
  is the largest v with mass(p >= v) >= top_p: found by bisection over the bit patterns of
  non-negative float32 (ordered like the values), 32 halvings of O(V) masked sums. Tokens above
  v* are kept; tokens at v* are kept in id order while the mass before them stays < top_p.
  (XLA's CPU sort of a vocabulary row is ~100x slower than this.)
  """
  bits_xV = jax.lax.bitcast_convert_type(probs_xV, jnp.int32)
  mass_from = lambda t_x: jnp.sum(jnp.where(bits_xV >= t_x[..., None], probs_xV, 0.0), axis=-1)

  def halve(_, bounds):
    lo_x, hi_x = bounds  # mass_from(lo) >= top_p > mass_from(hi).
    mid_x = lo_x + (hi_x - lo_x) // 2
    ok_x = mass_from(mid_x) >= top_p
    return jnp.where(ok_x, mid_x, lo_x), jnp.where(ok_x, hi_x, mid_x)

  lo_x = jnp.zeros(probs_xV.shape[:-1], jnp.int32)
  hi_x = jnp.max(bits_xV, axis=-1) + 1
  v_x, _ = jax.lax.fori_loop(0, 32, halve, (lo_x, hi_x))
  above_xV = bits_xV > v_x[..., None]
  tied_xV = bits_xV == v_x[..., None]
  mass_above_x = jnp.sum(jnp.where(above_xV, probs_xV, 0.0), axis=-1)
  v_value_x = jax.lax.bitcast_convert_type(v_x, jnp.float32)
  # Tied tokens before this one hold v* each: keep while mass_above + v* * rank < top_p.
  rank_xV = jnp.cumsum(tied_xV.astype(jnp.int32), axis=-1) - 1
  keep_tied_xV = tied_xV & (mass_above_x[..., None] + v_value_x[..., None] * rank_xV < top_p)
  return above_xV | keep_tied_xV


def sample(keys_B: jax.Array, probs_BxV: jax.Array) -> jax.Array:
  """int32[B]: one draw per row from its distribution, each row with its own key."""
  draw = lambda key, p_V: jax.random.categorical(key, jnp.log(p_V))
  return jax.vmap(draw)(keys_B, probs_BxV).astype(jnp.int32)
