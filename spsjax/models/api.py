"""The functional model API: parameters, the reference forward, and cache prefill/extension.

`logits` (no cache) is the reference that every cached path is tested against. `extend` appends T
tokens to every row at that row's own offset `cache.lengths[b]` and returns the logits of those T
positions with the cache advanced by T; `prefill` is `extend` on an empty cache followed by setting
each row's length to its prompt length.
"""

import dataclasses
import functools

from absl import logging
import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from spsjax import native, sharding
from spsjax.models import kv_cache
from spsjax.models.config import TransformerConfig
from spsjax.models.token_tree import RowTrees, TokenTree
from spsjax.models.transformer import Transformer


@flax.struct.dataclass
class Model:
  """A frozen (config, params) pair; a pytree whose config is static."""
  config: TransformerConfig = flax.struct.field(pytree_node=False)
  params: dict


def _boxed_init(config: TransformerConfig, rng: jax.Array):
  tokens = jnp.zeros((1, 1), jnp.int32)
  return Transformer(config).init(rng, tokens, tokens)['params']


@functools.lru_cache(maxsize=64)
def param_shardings(config: TransformerConfig, mesh: Mesh,
                    rules: sharding.Rules = sharding.DEFAULT_RULES):
  """NamedShardings for the parameter tree, from its logical axis names (computed once per
  config, mesh and rules: samplers ask for them on every call)."""
  unfit = unsharded_dims(config, mesh, rules)
  if unfit:
    logging.warning('The mesh does not divide %s: replicated on that axis (their work is repeated '
                    'on every shard of it).', ', '.join(
                        f'{name} ({size}, {axis}={n})' for name, (size, axis, n) in unfit.items()))
  # The config is bound, not passed: eval_shape would trace it as an array argument.
  abstract = jax.eval_shape(functools.partial(_boxed_init, config), jax.random.key(0))
  return sharding.tree_shardings(abstract, mesh, rules)


def unsharded_dims(config: TransformerConfig, mesh: Mesh,
                   rules: sharding.Rules = sharding.DEFAULT_RULES) -> dict:
  """The model's split dimensions (heads, kv heads, d_ff, vocabulary) that `mesh` cannot split
  and replicates: {logical name: (size, mesh axis, axis size)} (`sharding.replicated_dims`).
  `param_shardings` says so in one log line."""
  return sharding.replicated_dims(dict(heads=config.num_heads, kv_heads=config.kv_heads,
                                       mlp=config.d_ff, vocab=config.vocab_size), mesh, rules)


def param_shapes(config: TransformerConfig) -> dict:
  """The parameter tree of `init_params` as jax.ShapeDtypeStructs (nothing is computed)."""
  return jax.eval_shape(lambda key: init_params(config, key), jax.random.key(0))


@functools.lru_cache(maxsize=64)
def _random_params_program(config: TransformerConfig, mesh: Mesh | None, rules: sharding.Rules):
  """`init_params`' jitted program, one per config and placement: a fresh function per call
  would trace and compile the whole initialisation again (seconds: every leaf's draw)."""
  def random_params(key):  # The name of its program in compile logs.
    return nn.unbox(_boxed_init(config, key))

  if mesh is None:
    return jax.jit(random_params)
  return jax.jit(random_params, out_shardings=param_shardings(config, mesh, rules))


def init_params(config: TransformerConfig, rng: jax.Array, *, mesh: Mesh | None = None,
                rules: sharding.Rules = sharding.DEFAULT_RULES) -> dict:
  """Random parameters; with `mesh`, created already sharded (no full copy on one device)."""
  return _random_params_program(config, mesh, rules)(rng)


def truncated_params(config: TransformerConfig, params, to: TransformerConfig) -> dict:
  """`params` of a `config` model cut to the model `to`: its embedding, first `to.num_layers`
  layers and final norm (a layer-truncated copy of a target, the starting point of a draft).

  `to` must equal `config` but for a smaller `num_layers`: anything else (another width, heads,
  vocabulary) has no parameters to copy, and is an error rather than a silent partial copy.
  """
  if not 1 <= to.num_layers <= config.num_layers or dataclasses.replace(
      config, num_layers=to.num_layers) != to:
    raise ValueError(f'A truncated copy needs the same model with at most {config.num_layers} '
                     f'layers; {to} is not one of {config}.')
  kept = {f'layer_{i}' for i in range(to.num_layers)}
  out = {k: v for k, v in params.items() if not k.startswith('layer_') or k in kept}
  return out


def num_params(params) -> int:
  """Parameters of the model, packed or not (a packed copy of a tied table is not counted, nor
  are integer leaves: a head's draft vocabulary's token ids)."""
  leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, native.PackedWeight))
  return sum(0 if getattr(x, 'tied_to', None) or not isinstance(x, native.PackedWeight)
             and jnp.issubdtype(x.dtype, jnp.integer) else x.size for x in leaves)


def logits(config: TransformerConfig, params, tokens_BxT: jax.Array) -> jax.Array:
  """Full causal forward with no cache: float32[B, T, V]. The reference for every cached path."""
  T = tokens_BxT.shape[1]
  positions_BxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), tokens_BxT.shape)
  out, _ = Transformer(config).apply({'params': params}, tokens_BxT, positions_BxT)
  return out


def features(config: TransformerConfig, params, tokens_BxT: jax.Array,
             taps: bool | tuple[int, ...] = True) -> jax.Array:
  """Full causal forward with no cache: the last layer's output before the final norm, [B, T, D]
  in the model's dtype, or the residual stream at `taps` side by side, [B, T, len(taps) D]
  (`Transformer`'s `features`; the reference for `extend_with_features`)."""
  T = tokens_BxT.shape[1]
  positions_BxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), tokens_BxT.shape)
  return Transformer(config).apply({'params': params}, tokens_BxT, positions_BxT,
                                   features=taps)[2]


def extend_with_features(config: TransformerConfig, params, cache: kv_cache.KVCache,
                         tokens_BxT: jax.Array, logits_at_BxL: jax.Array | None = None,
                         counts_B: jax.Array | None = None,
                         tree: TokenTree | RowTrees | None = None,
                         taps: bool | tuple[int, ...] = True
                         ) -> tuple[jax.Array, jax.Array, kv_cache.KVCache]:
  """`extend`, also returning the positions' hidden states from the same forward: (float32[B, T,
  V] logits, [B, T, D] features: the last layer's output before the final norm, or with `taps`
  the residual stream there, [B, T, len(taps) D] (`features`), cache). With
  `logits_at` the logits are [B, L, V], the features still every position's; where `counts_B`
  marks padding both are unspecified. `tree`: a whole token tree, root first (`extend`'s)."""
  out, cache, features_BxTxD = _extend(config, params, cache, tokens_BxT, logits_at_BxL,
                                       counts_B, tree, 0, features=taps)
  return out, features_BxTxD, cache


def extend(config: TransformerConfig, params, cache: kv_cache.KVCache, tokens_BxT: jax.Array,
           logits_at_BxL: jax.Array | None = None, counts_B: jax.Array | None = None,
           tree: TokenTree | RowTrees | None = None, first_node: int = 0
           ) -> tuple[jax.Array, kv_cache.KVCache]:
  """Appends T tokens to each row at its own offset: (float32[B, T, V], cache with lengths + T).

  `logits_at_BxL` (int32 indices into T): return only those positions' logits, [B, L, V], and
  skip the output layer for the others (a decoder needs the last one or few).
  `counts_B`: only row b's first counts[b] tokens are real (right padding; 0 for a row that
  decodes no more): the others' logits and cache slots are unspecified, and a model packed for
  CPU decoding skips their work.
  `tree`: the T tokens are a token tree's nodes `first_node` .. first_node + T - 1 (all of them,
  the root first, by default; a `TokenTree` shared by the rows, or `RowTrees`, each row's own),
  its root at the cache's length: node m is written at slot
  lengths + m, at position lengths + its depth, and attends to the cache before the root and to
  its ancestors (`token_tree`; in a packed model by the attention kernel, but in its windowed
  layers; a call on part of a tree reads the nodes earlier calls wrote, and needs full caches, no
  rings). The returned lengths are lengths + first_node +
  T: the caller keeps a path (`kv_cache.keep_path`) and sets the lengths.
  The caller guarantees lengths + T <= cache capacity (a write past the end would be clamped).
  """
  out, cache, _ = _extend(config, params, cache, tokens_BxT, logits_at_BxL, counts_B, tree,
                          first_node)
  return out, cache


def call_positions(cache: kv_cache.KVCache, T: int, tree: TokenTree | RowTrees | None = None,
                   first_node: int = 0):
  """(cache with lengths at the call's first slot, positions [B, T], the `TreeMask` or None) of a
  cached call on T tokens: positions lengths + t; on a tree's nodes first_node .. + T - 1 (its
  root at slot lengths), slots lengths + node and positions lengths + depth (`extend`)."""
  if tree is None and first_node:
    raise ValueError(f'first_node={first_node} is a node of a tree: pass the tree.')
  if tree is None:
    return cache, cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :], None
  mask = tree.mask(first_node, T)
  offsets_BxT = jnp.broadcast_to(mask.depths_xM[..., first_node:first_node + T],
                                 (cache.lengths.shape[0], T))  # Shared, or each row's.
  positions_BxT = cache.lengths[:, None] + offsets_BxT
  return cache.with_lengths(cache.lengths + first_node), positions_BxT, mask


def _extend(config, params, cache, tokens_BxT, logits_at_BxL, counts_B, tree, first_node,
            features=False):
  """`extend` (and with `features` the hidden states too, else None): (out, cache, features)."""
  T = tokens_BxT.shape[1]
  cache, positions_BxT, mask = call_positions(cache, T, tree, first_node)
  out, (k, v), *hidden = Transformer(config).apply(
      {'params': params}, tokens_BxT, positions_BxT, cache, logits_at_BxL, counts_B, tree=mask,
      features=features)
  return (out, kv_cache.KVCache(k=k, v=v, lengths=cache.lengths + T),
          hidden[0] if hidden else None)


def tree_logits(config: TransformerConfig, params, tokens_BxT: jax.Array,
                tree: TokenTree) -> jax.Array:
  """No cache: a token tree's root (at position 0) and nodes, each seeing its ancestors:
  float32[B, N + 1, V]; node t's logits are `logits` of its root-to-node path at its last
  position (the reference for `extend`'s `tree`)."""
  mask = tree.mask(0, tokens_BxT.shape[1])
  positions_BxT = jnp.broadcast_to(mask.depths_xM, tokens_BxT.shape)
  out, _ = Transformer(config).apply({'params': params}, tokens_BxT, positions_BxT, tree=mask)
  return out


def prefill(config: TransformerConfig, params, prompts_BxP: jax.Array, prompt_lengths_B: jax.Array,
            capacity: int, *, last_only: bool = False,
            with_features: bool | tuple[int, ...] = False, rollback: int | None = None):
  """Fills a fresh cache with right-padded prompts: (float32[B, P, V], cache at prompt lengths).

  `rollback`: the most positions a row will write past its length and then drop by rolling
  back (`kv_cache.init_cache`: sliding-window layers then hold rings); None, every position.
  `last_only`: logits of each row's last prompt token only, float32[B, 1, V].
  `with_features`: (logits, features [B, P, D] at every prompt position, cache), from the same
  forward (`extend_with_features`; taps given: the residual stream there, [B, P, len(taps) D]).
  Padding positions sit at or past each row's length, so nothing reads their cache slots; their
  logits (and features) are unspecified. A model packed for CPU decoding skips them (half of a
  batch-8 prefill's work on Table 1's tasks).
  """
  cache = kv_cache.init_cache(config, prompts_BxP.shape[0], capacity, rollback)
  at_Bx1 = (prompt_lengths_B - 1)[:, None].astype(jnp.int32) if last_only else None
  counts_B = prompt_lengths_B.astype(jnp.int32)
  if with_features:
    out, features_BxPxD, cache = extend_with_features(config, params, cache, prompts_BxP, at_Bx1,
                                                      counts_B, taps=with_features)
    return out, features_BxPxD, cache.with_lengths(prompt_lengths_B)
  out, cache = extend(config, params, cache, prompts_BxP, at_Bx1, counts_B)
  return out, cache.with_lengths(prompt_lengths_B)
