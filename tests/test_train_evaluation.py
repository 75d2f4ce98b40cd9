"""Held-out evaluation: `evaluate_pair` and `evaluate_model` against losses and alphas computed
here, in float64 numpy, from the reference logits."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spsjax import models
from spsjax.sampling import SamplingConfig
from spsjax.train import evaluation
from tests import forwards

V = 40
SETTINGS = {'greedy': SamplingConfig(temperature=0.0), 't1': SamplingConfig(),
            't0.7_top_k_3': SamplingConfig(temperature=0.7, top_k=3)}


def _random_model(seed, vocab_size=V, **kw):
  """Gaussian weights drawn by numpy (no `init_params` to compile); far-from-uniform laws."""
  config = models.TransformerConfig(vocab_size=vocab_size, max_seq_len=16, num_heads=2, d_ff=32,
                                    **kw)
  shapes = jax.eval_shape(functools.partial(models.init_params, config), jax.random.key(0))
  rng = np.random.default_rng(seed)
  return models.Model(config, jax.tree.map(
      lambda s: jnp.asarray(rng.normal(0.0, 0.5, s.shape), s.dtype), shapes))


@pytest.fixture(scope='module', name='pair')
def fixture_pair():
  target = _random_model(0, d_model=32, num_layers=2)
  draft = _random_model(1, d_model=16, num_layers=1)
  rng = np.random.default_rng(2)
  batches = [rng.integers(0, V, size=(3, 9)).astype(np.int32) for _ in range(2)]
  return target, draft, batches


def _laws(logits, sampling):
  """float64 numpy `probabilities` for these settings: argmax one-hot, or a softmax at the
  temperature over the top k (no ties in random float logits)."""
  logits = np.asarray(logits, np.float64)
  if sampling.greedy:
    return np.eye(logits.shape[-1])[np.argmax(logits, -1)]
  z = logits / sampling.temperature
  if sampling.top_k:
    kth = np.sort(z, axis=-1)[..., -sampling.top_k][..., None]
    z = np.where(z >= kth, z, -np.inf)
  e = np.exp(z - z.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _expected(target, draft, batches):
  """Mean over batches of the mean over positions: cross entropies and sum_x min(p, q)."""
  per_batch = []
  for batch in batches:
    row = {}
    laws = {}
    for name, model in (('target', target), ('draft', draft)):
      logits = np.asarray(forwards.full_logits(model.config, model.params,
                                               jnp.asarray(batch[:, :-1])), np.float64)
      shifted = logits - logits.max(-1, keepdims=True)
      log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
      row[f'{name}_loss'] = -np.take_along_axis(log_probs, batch[:, 1:, None], -1).mean()
      laws[name] = {s: _laws(logits, sampling) for s, sampling in SETTINGS.items()}
    for s in SETTINGS:
      row[f'alpha_{s}'] = np.minimum(laws['target'][s], laws['draft'][s]).sum(-1).mean()
    per_batch.append(row)
  return {key: np.mean([row[key] for row in per_batch]) for key in per_batch[0]}


def test_evaluate_pair_matches_the_sums(pair):
  target, draft, batches = pair
  got = evaluation.evaluate_pair(target, draft, batches, SETTINGS)
  want = _expected(target, draft, batches)
  assert set(got) == set(want)
  for key in want:
    assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
  # Non-vacuous: two different models, so every alpha is strictly between 0 and 1, and the
  # settings give different alphas.
  alphas = [got[f'alpha_{s}'] for s in SETTINGS]
  assert all(0.05 < a < 0.95 for a in alphas) and len(set(alphas)) == len(alphas), alphas
  model = evaluation.evaluate_model(target, batches)
  assert model['loss'] == pytest.approx(want['target_loss'], rel=1e-5)
  assert model['perplexity'] == pytest.approx(np.exp(want['target_loss']), rel=1e-5)


def test_a_model_paired_with_itself(pair):
  target, _, batches = pair
  got = evaluation.evaluate_pair(target, target, batches, SETTINGS)
  assert got['draft_loss'] == got['target_loss']
  for s in SETTINGS:
    assert got[f'alpha_{s}'] == pytest.approx(1.0, abs=1e-6), s


def test_bad_pairs_and_no_batches_raise(pair):
  target, draft, batches = pair
  wide = _random_model(3, vocab_size=V + 1, d_model=16, num_layers=1)
  with pytest.raises(ValueError, match='vocab_size'):
    evaluation.evaluate_pair(target, wide, batches, SETTINGS)
  with pytest.raises(ValueError, match='No batches'):
    evaluation.evaluate_pair(target, draft, [], SETTINGS)
