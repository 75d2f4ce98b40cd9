"""A decoding step with the layers scanned: a step variant (`bench.variants`), not a model option.

The models unroll their layers (`Transformer` calls each `Block` in turn), so every program
compiles each layer again; on a GPU a program of a 16-layer model takes seconds to compile, and a
run of many shapes spends most of its time compiling (`experiments/accelerator_check.py`).
`scanned_extend` computes the same `extend` with the model's own `Block` applied by `lax.scan`
over the layers' parameters and caches stacked on a leading axis; its logits are the unrolled
model's up to rounding. `scanned_program` is its loop of one-position steps, as
`decode.extend_program` is the model's.

Only XLA's path of rotary models without learned positions whose layers all attend alike (the
native CPU kernels read packed per-layer weights; `global_layers` differ from the others).
Stacking copies the parameters once, outside the timed programs.
"""

import jax
import jax.numpy as jnp

from spsjax import models
from spsjax.models import transformer


def stack_layers(config: models.TransformerConfig, params) -> tuple[dict, dict]:
  """(the layers' parameters stacked on a leading axis of num_layers, the other parameters)."""
  layers = [params[f'layer_{i}'] for i in range(config.num_layers)]
  others = {name: p for name, p in params.items() if not name.startswith('layer_')}
  return jax.tree.map(lambda *xs: jnp.stack(xs), *layers), others


def scanned_extend(config, others, stacked, k_LxBxSxKxH, v_LxBxSxKxH, lengths_B, tokens_BxT):
  """`models.extend` with the layers scanned: (float32[B, T, V], keys, values), the caches
  stacked like the layers."""
  if config.global_layers:
    raise ValueError('Scanned layers compute alike: a model with global_layers '
                     f'{config.global_layers} among sliding ones runs unrolled.')
  T = tokens_BxT.shape[1]
  positions_BxT = lengths_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]

  def layer(x_BxTxD, inputs):
    params, k_BxSxKxH, v_BxSxKxH = inputs
    x_BxTxD, kv = transformer.Block(config).apply(
        {'params': params}, x_BxTxD, positions_BxT, (k_BxSxKxH, v_BxSxKxH, lengths_B))
    return x_BxTxD, kv

  x_BxTxD = transformer.embed(config, others['embedding'], tokens_BxT)
  x_BxTxD, (k_LxBxSxKxH, v_LxBxSxKxH) = jax.lax.scan(layer, x_BxTxD,
                                                     (stacked, k_LxBxSxKxH, v_LxBxSxKxH))
  return transformer.output_logits(config, others, x_BxTxD), k_LxBxSxKxH, v_LxBxSxKxH


def _scanned_steps(config, steps, others, stacked, k, v, tokens_BxT, lengths_B):
  """`steps` scanned extends in one program, as `decode._extend_steps` runs the unrolled one."""

  def one(_, carry):
    k, v, checksum_B = carry
    logits_BxTxV, k, v = scanned_extend(config, others, stacked, k, v, lengths_B, tokens_BxT)
    return k, v, checksum_B + logits_BxTxV[:, -1, 0]

  return jax.lax.fori_loop(0, steps, one, (k, v, jnp.zeros(tokens_BxT.shape[:1], jnp.float32)))


scanned_program = jax.jit(_scanned_steps, static_argnums=(0, 1), donate_argnums=(4, 5))
