"""What scanning the layers would change: a probe, not a model option.

The models unroll their layers (`Transformer` calls each `Block` in turn), so every program
compiles each layer again; on a GPU a program of a 16-layer model takes seconds to compile, and a
run of many shapes spends most of its time compiling (`experiments/accelerator_check.py`). The
probe computes the same one-step `extend` with the model's own `Block` applied by `lax.scan` over
the layers' parameters and caches stacked on a leading axis, and compiles and times it beside the
model's unrolled `extend`, both as `decode.extend_seconds` times a step (a jitted loop of `steps`
calls, the cache donated). Its logits are the unrolled model's up to rounding (`max_logit_diff`).

Only XLA's path of rotary models without learned positions (the native CPU kernels read packed
per-layer weights). Stacking copies the parameters once, outside the timed programs.
"""

import dataclasses
import time

import jax
import jax.numpy as jnp

from spsjax import models
from spsjax.bench import decode, timing
from spsjax.models import transformer


@dataclasses.dataclass(frozen=True)
class LayerScan:
  """Seconds: XLA's compile of each program, and the median step inside its loop."""
  compile_unrolled: float
  compile_scanned: float
  step_unrolled: float
  step_scanned: float
  max_logit_diff: float  # Largest |scanned - unrolled| logit of the first step.


def stack_layers(config: models.TransformerConfig, params) -> tuple[dict, dict]:
  """(the layers' parameters stacked on a leading axis of num_layers, the other parameters)."""
  layers = [params[f'layer_{i}'] for i in range(config.num_layers)]
  others = {name: p for name, p in params.items() if not name.startswith('layer_')}
  return jax.tree.map(lambda *xs: jnp.stack(xs), *layers), others


def scanned_extend(config, others, stacked, k_LxBxSxKxH, v_LxBxSxKxH, lengths_B, tokens_BxT):
  """`models.extend` with the layers scanned: (float32[B, T, V], keys, values), the caches
  stacked like the layers."""
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


_scanned_program = jax.jit(_scanned_steps, static_argnums=(0, 1), donate_argnums=(4, 5))


def _compiled(jitted, *args):
  """(the compiled program, seconds to lower and compile it)."""
  start = time.perf_counter()
  compiled = jitted.lower(*args).compile()
  return compiled, time.perf_counter() - start


def probe(model: models.Model, capacity: int, *, batch: int = 1, steps: int = 4,
          repeats: int = 5) -> LayerScan:
  """Compiles and times one-position extends of `model` at `batch` rows, unrolled and scanned, on
  a cache of `capacity` slots (lengths capacity - 1). `steps` is the loops' length; a length no
  other measurement compiled times the unrolled program's compile afresh."""
  config = model.config
  if config.kernels != 'xla' or config.position != 'rope':
    raise ValueError('The layer-scan probe runs XLA\'s path of rotary models; this one has '
                     f'kernels {config.kernels!r}, positions {config.position!r}.')
  params = model.params
  stacked, others = stack_layers(config, params)
  tokens_BxT = jnp.ones((batch, 1), jnp.int32)
  lengths_B = jnp.full((batch,), capacity - 1, jnp.int32)
  fresh = lambda: models.init_cache(config, batch, capacity)
  def stacked_cache():
    cache = fresh()
    return jnp.stack(cache.k), jnp.stack(cache.v)

  unrolled, compile_unrolled = _compiled(decode.extend_program, config, steps, params, fresh(),
                                         tokens_BxT, lengths_B)
  scanned, compile_scanned = _compiled(_scanned_program, config, steps, others, stacked,
                                       *stacked_cache(), tokens_BxT, lengths_B)
  # One step of each on fresh caches, for their logits (two more programs, compiled after the
  # timed compiles).
  first = jax.jit(models.extend, static_argnums=0)(
      config, params, fresh().with_lengths(lengths_B), tokens_BxT)[0]
  again = jax.jit(scanned_extend, static_argnums=0)(
      config, others, stacked, *stacked_cache(), lengths_B, tokens_BxT)[0]
  state = {'unrolled': fresh(), 'scanned': stacked_cache()}

  def run_unrolled():
    state['unrolled'], checksum_B = unrolled(params, state['unrolled'], tokens_BxT, lengths_B)
    return checksum_B

  def run_scanned():
    k, v, checksum_B = scanned(others, stacked, *state['scanned'], tokens_BxT, lengths_B)
    state['scanned'] = (k, v)
    return checksum_B

  seconds = timing.medians({'unrolled': run_unrolled, 'scanned': run_scanned}, repeats=repeats)
  return LayerScan(compile_unrolled=compile_unrolled, compile_scanned=compile_scanned,
                   step_unrolled=seconds['unrolled'] / steps,
                   step_scanned=seconds['scanned'] / steps,
                   max_logit_diff=float(jnp.max(jnp.abs(first - again))))

