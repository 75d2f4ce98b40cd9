"""The explicit, functional KV cache: passed into every cached model call and returned by it.

Layout per layer: keys and values `[B, S, N_kv, H]` (batch, cache slot, kv head, head dim) and one
`lengths: int32[B]` shared by all layers: row b holds exactly `lengths[b]` valid positions, 0 to
lengths[b] - 1. Slots at or past `lengths[b]` may hold stale values; attention never reads them,
because a query at position t only sees keys at positions <= t and every call writes its own
positions before it reads. So rolling a row back is moving its length: nothing is copied or recomputed.
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
  k: tuple[jax.Array, ...]  # Per layer [B, S, N_kv, H].
  v: tuple[jax.Array, ...]  # Per layer [B, S, N_kv, H].
  lengths: jax.Array  # int32[B]: valid positions per row.

  @property
  def batch(self) -> int:
    return self.lengths.shape[0]

  @property
  def capacity(self) -> int:
    return self.k[0].shape[1]

  def with_lengths(self, lengths_B: jax.Array) -> 'KVCache':
    """Rolls rows back (or forward over already written slots) by setting their lengths."""
    return self.replace(lengths=lengths_B.astype(jnp.int32))


def shape(config: TransformerConfig, batch: int, capacity: int) -> tuple[int, int, int, int]:
  return (batch, capacity, config.kv_heads, config.dims_per_head)


def init_cache(config: TransformerConfig, batch: int, capacity: int) -> KVCache:
  """An empty cache (all lengths 0) with room for `capacity` positions per row."""
  zeros = lambda: jnp.zeros(shape(config, batch, capacity), config.jnp_dtype)
  return KVCache(
      k=tuple(zeros() for _ in range(config.num_layers)),
      v=tuple(zeros() for _ in range(config.num_layers)),
      lengths=jnp.zeros((batch,), jnp.int32))


def shardings(cache: KVCache, mesh: Mesh,
              rules: sharding.Rules = sharding.DEFAULT_RULES) -> KVCache:
  """A tree of NamedShardings for `cache` (concrete or from `jax.eval_shape`).

  Keys and values are sharded by kv heads like the attention weights, rows by the data axis.
  """
  kv = sharding.named(LOGICAL_AXES, cache.k[0].shape, mesh, rules)
  lengths = sharding.named(('cache_batch',), cache.lengths.shape, mesh, rules)
  return KVCache(k=(kv,) * len(cache.k), v=(kv,) * len(cache.v), lengths=lengths)


def constrain(cache: KVCache, mesh: Mesh | None,
              rules: sharding.Rules = sharding.DEFAULT_RULES) -> KVCache:
  """Pins a cache built inside a jitted program to its layout (no-op without a mesh)."""
  if mesh is None:
    return cache
  return jax.lax.with_sharding_constraint(cache, shardings(cache, mesh, rules))

