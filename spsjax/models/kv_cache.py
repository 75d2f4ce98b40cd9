"""The explicit, functional KV cache: passed into every cached model call and returned by it.

Layout per layer: keys and values `[B, S, N_kv, H]` (batch, cache slot, kv head, head dim) and one
`lengths: int32[B]` shared by all layers: row b holds exactly `lengths[b]` valid positions, 0 to
lengths[b] - 1. Slots at or past `lengths[b]` may hold stale values; attention never reads them,
because a query at position t only sees keys at positions <= t and every call writes its own
positions before it reads. So rolling a row back is moving its length: nothing is copied or recomputed.

A sliding-window layer on XLA's path may hold a ring instead (`init_cache`'s `rollback`): S =
window - 1 + rollback slots (at least 1), position p in slot p mod S: before a call the ring holds
the window - 1 positions its first query sees besides its own, and `rollback` more. A call
attends over the ring as it was (each slot's position from the row's length, `ring_positions`)
and its own new keys, then writes the new positions that are real (a row's first counts[b]) and
among the last S of them (`ring_write`).
Dropping r <= rollback written positions by rolling a row back leaves their slots, read by the
length now, at positions `window` or more before any query made before they are written again:
masked, as stale slots are in a full cache.
The native CPU kernels index slots by position: a packed model's cache holds every position.
"""

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from spsjax import sharding
from spsjax.models.config import TransformerConfig

LOGICAL_AXES = ('cache_batch', 'cache_sequence', 'cache_heads', 'cache_head_dim')


@flax.struct.dataclass
class KVCache:
  k: tuple[jax.Array, ...]  # Per layer [B, S, N_kv, H] (S: the layer's slots).
  v: tuple[jax.Array, ...]  # Per layer [B, S, N_kv, H].
  lengths: jax.Array  # int32[B]: valid positions per row.

  @property
  def batch(self) -> int:
    return self.lengths.shape[0]

  def with_lengths(self, lengths_B: jax.Array) -> 'KVCache':
    """Rolls rows back (or forward over already written slots) by setting their lengths."""
    return self.replace(lengths=lengths_B.astype(jnp.int32))


def shape(config: TransformerConfig, batch: int, capacity: int) -> tuple[int, int, int, int]:
  return (batch, capacity, config.kv_heads, config.dims_per_head)


def slots(config: TransformerConfig, layer: int, capacity: int, rollback: int | None) -> int:
  """Slots of `layer` in a cache for `capacity` positions (module docstring): a ring of window -
  1 + rollback (at least 1) for a sliding-window layer on XLA's path when `rollback` is given
  (and that is smaller), else `capacity`."""
  window = config.window(layer)
  if rollback is None or window is None or config.kernels == 'native':
    return capacity
  if rollback < 0:
    raise ValueError(f'rollback must be >= 0, got {rollback}.')
  return min(capacity, max(1, window - 1 + rollback))


def init_cache(config: TransformerConfig, batch: int, capacity: int,
               rollback: int | None = None) -> KVCache:
  """An empty cache (all lengths 0) with room for `capacity` positions per row. `rollback`: the
  most positions a row writes past its length and then drops by rolling back (SpS: at most k of
  the k + 1 it scores); with it, sliding-window layers hold rings of window - 1 + rollback
  slots (`slots`). None: every layer holds every position, whatever the rollbacks."""
  zeros = lambda layer: jnp.zeros(shape(config, batch, slots(config, layer, capacity, rollback)),
                                  config.jnp_dtype)
  return KVCache(
      k=tuple(zeros(i) for i in range(config.num_layers)),
      v=tuple(zeros(i) for i in range(config.num_layers)),
      lengths=jnp.zeros((batch,), jnp.int32))


# The position of a ring slot that holds none: after every query, so causally masked.
_NO_POSITION = jnp.iinfo(jnp.int32).max


def ring_positions(starts_B: jax.Array, num_slots: int) -> jax.Array:
  """int32[B, S]: the position each ring slot holds for a row of length `starts` (the latest p <
  start with p = slot mod S), or a position after every query where there is none."""
  slot_S = jnp.arange(num_slots, dtype=jnp.int32)
  last_B1 = starts_B[:, None].astype(jnp.int32) - 1
  position_BxS = last_B1 - jnp.mod(last_B1 - slot_S[None, :], num_slots)
  return jnp.where(position_BxS >= 0, position_BxS, _NO_POSITION)


def ring_write(ring_BxSxKxH: jax.Array, new_BxTxKxH: jax.Array, starts_B: jax.Array,
               counts_B: jax.Array | None = None) -> jax.Array:
  """The ring after a call writes T positions at `starts`: only each row's first counts[b]
  (default all T) are written (padding would overwrite real positions), and of those only the
  last S (an earlier one's slot would be written twice)."""
  B, T = new_BxTxKxH.shape[:2]
  S = ring_BxSxKxH.shape[1]
  t_T = jnp.arange(T, dtype=jnp.int32)
  counts_B1 = (jnp.full((B, 1), T, jnp.int32) if counts_B is None
               else counts_B[:, None].astype(jnp.int32))
  written_BxT = (t_T[None, :] < counts_B1) & (t_T[None, :] >= counts_B1 - S)
  slot_BxT = jnp.where(written_BxT, jnp.mod(starts_B[:, None] + t_T[None, :], S), S)
  rows_BxT = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
  return ring_BxSxKxH.at[rows_BxT, slot_BxT].set(new_BxTxKxH.astype(ring_BxSxKxH.dtype),
                                                 mode='drop')


def keep_path(cache: KVCache, starts_B: jax.Array, path_BxD: jax.Array) -> KVCache:
  """After a call on a token tree written at slots starts + node (`models.extend`'s `tree`):
  each row's root-to-node path moved to the slots of its positions, node path[b, d] to slot
  starts[b] + d (modulo a ring's slots), in every layer. `path_BxD[b, d]` (d from 0, the root)
  is the row's node at depth d, or d itself past the row's path (nothing moves there). Lengths
  are the caller's to set; every source slot is read before any is written."""
  D = path_BxD.shape[1]

  def move(layer_BxSxKxH):
    S = layer_BxSxKxH.shape[1]
    dst_BxD = jnp.mod(starts_B[:, None] + jnp.arange(D, dtype=jnp.int32)[None, :], S)
    src_BxD = jnp.mod(starts_B[:, None] + path_BxD.astype(jnp.int32), S)
    moved_BxDxKxH = jnp.take_along_axis(layer_BxSxKxH, src_BxD[:, :, None, None], axis=1)
    rows_BxD = jnp.broadcast_to(jnp.arange(layer_BxSxKxH.shape[0])[:, None], dst_BxD.shape)
    return layer_BxSxKxH.at[rows_BxD, dst_BxD].set(moved_BxDxKxH)

  return cache.replace(k=tuple(move(x) for x in cache.k), v=tuple(move(x) for x in cache.v))


def shardings(cache: KVCache, mesh: Mesh,
              rules: sharding.Rules = sharding.DEFAULT_RULES) -> KVCache:
  """A tree of NamedShardings for `cache` (concrete or from `jax.eval_shape`).

  Keys and values are sharded by kv heads like the attention weights, rows by the data axis.
  """
  kv = tuple(sharding.named(LOGICAL_AXES, k.shape, mesh, rules) for k in cache.k)
  lengths = sharding.named(('cache_batch',), cache.lengths.shape, mesh, rules)
  return KVCache(k=kv, v=kv, lengths=lengths)


def constrain(cache: KVCache, mesh: Mesh | None,
              rules: sharding.Rules = sharding.DEFAULT_RULES) -> KVCache:
  """Pins a cache built inside a jitted program to its layout (no-op without a mesh)."""
  if mesh is None:
    return cache
  return jax.lax.with_sharding_constraint(cache, shardings(cache, mesh, rules))

