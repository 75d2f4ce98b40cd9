"""Full forwards (no cache) of one sequence at a time, the tests' references: the sequence padded to
a fixed width, so one compiled program serves every length. The forwards are causal, so the
positions of the sequence never see the padding; called eagerly on each length, the same forward
compiled every op anew per length (hundreds of small programs per test)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from spsjax import models

WIDTH = 32  # Positions of a padded sequence (at most the model's max_seq_len).


@functools.partial(jax.jit, static_argnums=(0, 1))
def _forward(fn, config, params, tokens_1xW):
  return fn(config, params, tokens_1xW)


def _padded_forward(fn, model: models.Model, seq) -> np.ndarray:
  width = min(WIDTH, model.config.max_seq_len)
  if len(seq) > width:
    raise ValueError(f'A sequence of {len(seq)} tokens is longer than {width}.')
  tokens = np.zeros((1, width), np.int32)
  tokens[0, :len(seq)] = seq
  return np.asarray(_forward(fn, model.config, model.params, jnp.asarray(tokens)))[0, :len(seq)]


def features(model: models.Model, seq, taps=True) -> np.ndarray:
  """[len(seq), D]: `models.features` of the tokens `seq` (at `taps`: [len(seq), n D])."""
  return _padded_forward(models.features if taps is True else _features_at(tuple(taps)), model,
                         seq)


@functools.lru_cache(maxsize=None)
def _features_at(taps):
  """`models.features` at `taps`, one function per taps (one compiled program each)."""
  return lambda config, params, tokens_BxT: models.features(config, params, tokens_BxT, taps)


def logits(model: models.Model, seq) -> np.ndarray:
  """float32[len(seq), V]: `models.logits` of the tokens `seq`."""
  return _padded_forward(models.logits, model, seq)


# `models.logits(config, params, tokens_BxT)` of a batch through `_forward`'s one jitted program
# per config and shape: eagerly, each of its ops compiles a program of its own.
full_logits = functools.partial(_forward, models.logits)
