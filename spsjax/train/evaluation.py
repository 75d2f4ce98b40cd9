"""Held-out evaluation: a model's loss, and a target/draft pair's expected acceptance alpha.

alpha = E[sum_x min(p(x), q(x))] over held-out positions (Leviathan et al.), where p and q are the
target's and the draft's next-token laws after the sampling processors (`probabilities`), so it is
the acceptance rate speculative sampling would see under those settings, and with k and the cost
ratio c it predicts the speedup. Both laws are computed on the same batches, in one forward each.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from spsjax import models, sharding
from spsjax.models import feature_head
from spsjax.sampling import SamplingConfig, probabilities
from spsjax.sampling.rejection import acceptance_probability
from spsjax.train import losses


def _loss(config, params, batch_BxL1):
  return losses.next_token(functools.partial(models.logits, config, params), batch_BxL1)


@functools.partial(jax.jit, static_argnums=0)
def _model_step(config, params, batch_BxL1):
  return _loss(config, params, batch_BxL1)[1]


@functools.partial(jax.jit, static_argnums=0)
def _pair_step(settings, target: models.Model, draft: models.Model, batch_BxL1):
  """(target loss, draft loss, mean beta per sampling setting) on one batch. A head over the
  target's features (`feature_head.next_token_logits`) has no law at position 0: it counts
  from position 1."""
  p_logits, target_loss = _loss(target.config, target.params, batch_BxL1)
  first = 1 if feature_head.is_head(draft) else 0
  q_logits = feature_head.next_token_logits(draft, target, batch_BxL1[:, :-1])[:, first:]
  targets_BxL = batch_BxL1[:, 1 + first:]
  draft_loss = losses.cross_entropy(q_logits, targets_BxL, jnp.ones(targets_BxL.shape, bool))
  betas = [jnp.mean(acceptance_probability(probabilities(p_logits[:, first:], s),
                                           probabilities(q_logits, s)))
           for s in settings]
  return target_loss, draft_loss, jnp.stack(betas)


def _placed(batch_BxL1, mesh: Mesh | None) -> jax.Array:
  """A batch on the default device, or on `mesh` with its rows on the `data` axis."""
  if mesh is None:
    return jnp.asarray(batch_BxL1)
  sharding.check_batch(batch_BxL1.shape[0], mesh)
  return sharding.put(batch_BxL1, sharding.named(('batch', 'length'), batch_BxL1.shape, mesh))


def evaluate_model(model: models.Model, batches, mesh: Mesh | None = None) -> dict:
  """Mean held-out loss and perplexity over `batches` (int32[B, L + 1] host arrays, the same on
  every process); on `mesh` the model must be placed on it (as `load_family` does)."""
  values = [_model_step(model.config, model.params, _placed(b, mesh)) for b in batches]
  loss = float(np.mean(jax.device_get(values)))
  return dict(loss=loss, perplexity=losses.perplexity(loss))


def evaluate_pair(target: models.Model, draft: models.Model, batches,
                  sampling_settings: dict[str, SamplingConfig], mesh: Mesh | None = None) -> dict:
  """Held-out loss of both models and alpha under each named sampling setting (batches and mesh
  as for `evaluate_model`).

  Returns {'target_loss', 'draft_loss', 'alpha_<name>' for each setting}.
  """
  if target.config.vocab_size != draft.config.vocab_size:
    raise ValueError(f'Target vocab_size ({target.config.vocab_size}) differs from the draft\'s '
                     f'({draft.config.vocab_size}).')
  names, settings = zip(*sampling_settings.items())
  values = jax.device_get([_pair_step(settings, target, draft, _placed(b, mesh))
                           for b in batches])
  if not values:
    raise ValueError('No batches to evaluate on.')
  result = dict(target_loss=float(np.mean([v[0] for v in values])),
                draft_loss=float(np.mean([v[1] for v in values])))
  alphas = np.mean([v[2] for v in values], axis=0)
  result.update({f'alpha_{name}': float(a) for name, a in zip(names, alphas)})
  return result
