"""Draft tokens beside a draft: more children of one tree node, drawn so that each one's law
given the ones before it is known (what `rejection.accept_tree` needs to stay exact).

`draw` takes a row's draft law q and its first child (already drawn from q) and returns `count`
more, each from q without the children before it, renormalised: sampling without replacement,
one after another by inverse CDF in blocks (`processors.draw_in_blocks`, one uniform number
each, O(V): the Gumbel top-k trick's noise and top-k over the vocabulary cost 3-140x more on
a CPU).
Under a greedy draft (q a point mass, nothing left to sample) they are instead the draft logits'
next best, as point masses. Tokens the law has no mass left for are marked not proposed.
"""

import flax.struct
import jax
import jax.numpy as jnp

from spsjax.sampling.processors import draw_in_blocks, typed_keys


@flax.struct.dataclass
class Siblings:
  """Per row: `count` tokens [R, A], the law each was drawn from given the first child and the
  ones before it [R, A, V], and whether each was proposed [R, A]."""
  tokens_RxA: jax.Array
  q_RxAxV: jax.Array
  valid_RxA: jax.Array


def first_of_slots(first: Siblings, k: int) -> Siblings:
  """[R, k, ...] per-slot siblings with slot 0's set (the others zeros, not proposed)."""
  return jax.tree.map(lambda x: jnp.zeros((x.shape[0], k) + x.shape[1:], x.dtype).at[:, 0].set(x),
                      first)


def set_slot(slots: Siblings, i, one: Siblings) -> Siblings:
  """Per-slot siblings with slot i's (a traced index) set."""
  return jax.tree.map(lambda all_, x: all_.at[:, i].set(x), slots, one)


def stack_slots(each: list[Siblings]) -> Siblings:
  """Per-slot siblings [R, k, ...] from each slot's."""
  return jax.tree.map(lambda *xs: jnp.stack(xs, axis=1), *each)


def keys_apart(keys: jax.Array) -> jax.Array:
  """Keys (any shape) for the siblings of the children drawn with `keys`: their own streams,
  independent of the first child's draw."""
  keys = typed_keys(keys)
  flat = jax.vmap(lambda key: jax.random.fold_in(key, 1))(keys.reshape(-1))
  return flat.reshape(keys.shape)


def draw(keys_R: jax.Array, logits_RxV: jax.Array, q_RxV: jax.Array, first_R: jax.Array,
         count: int, *, greedy: bool) -> Siblings:
  """`count` children after `first_R` per row (module docstring); `keys_R`: one key per row,
  apart from the one `first_R` was drawn with (`keys_apart`)."""
  V = q_RxV.shape[-1]
  ids_V = jnp.arange(V, dtype=jnp.int32)
  others_RxV = ids_V[None, :] != first_R[:, None]
  if greedy:
    scores_RxV = jnp.where(others_RxV, logits_RxV.astype(jnp.float32), -jnp.inf)
    top_RxA, tokens_RxA = jax.lax.top_k(scores_RxV, count)
    return Siblings(tokens_RxA.astype(jnp.int32), jax.nn.one_hot(tokens_RxA, V, dtype=jnp.float32),
                    top_RxA > -jnp.inf)
  rest_RxV = jnp.where(others_RxV, q_RxV.astype(jnp.float32), 0.0)
  uniforms_RxA = jax.vmap(lambda key: jax.random.uniform(key, (count,), jnp.float32))(keys_R)
  tokens, laws, valid = [], [], []
  for j in range(count):  # Each from what the ones before it left.
    mass_Rx1 = jnp.sum(rest_RxV, axis=1, keepdims=True)
    laws.append(rest_RxV / jnp.where(mass_Rx1 > 0, mass_Rx1, 1.0))
    valid.append(mass_Rx1[:, 0] > 0)
    tokens.append(jax.vmap(draw_in_blocks)(uniforms_RxA[:, j], rest_RxV))
    rest_RxV = jnp.where(ids_V[None, :] == tokens[-1][:, None], 0.0, rest_RxV)
  return Siblings(jnp.stack(tokens, axis=1), jnp.stack(laws, axis=1), jnp.stack(valid, axis=1))
