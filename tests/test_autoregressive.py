"""ArS: greedy equals an argmax rollout of the reference forward; one compilation; clear errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spsjax import models
from spsjax.sampling import PAD_ID, SamplingConfig, autoregressive, autoregressive_sample

GREEDY = SamplingConfig(temperature=0.0)


@pytest.fixture(scope='module')
def model():
  config = models.TransformerConfig(vocab_size=40, d_model=32, num_layers=2, num_heads=4,
                                    num_kv_heads=2, d_ff=64, max_seq_len=48)
  return models.Model(config, models.init_params(config, jax.random.key(0)))


def argmax_rollout(model, prompt, max_new_tokens, eos_id=None):
  """Greedy decoding with the uncached reference forward only."""
  logits = jax.jit(models.logits, static_argnums=0)
  seq = list(prompt)
  out = []
  for _ in range(max_new_tokens):
    token = int(jnp.argmax(logits(model.config, model.params, jnp.asarray([seq]))[0, -1]))
    out.append(token)
    seq.append(token)
    if token == eos_id:
      break
  return out


def ragged_prompts(rng, batch, width, vocab):
  lengths = np.asarray(jax.random.randint(rng, (batch,), 1, width + 1), np.int32)
  prompts = np.array(jax.random.randint(jax.random.fold_in(rng, 1), (batch, width), 0, vocab),
                       np.int32)
  prompts[np.arange(width)[None, :] >= lengths[:, None]] = 7  # Padding holds junk ids.
  return prompts, lengths


def test_greedy_equals_argmax_rollout_with_eos(model):
  prompts, lengths = ragged_prompts(jax.random.key(1), 5, 6, 40)
  rollouts = [argmax_rollout(model, prompts[b, :lengths[b]], 10) for b in range(5)]
  # An eos that some rows reach mid-way: the third token of row 0.
  eos_id = rollouts[0][2]
  out = autoregressive_sample(model, prompts, lengths, jax.random.key(0), max_new_tokens=10,
                              sampling=GREEDY, eos_id=eos_id)
  stopped = 0
  for b in range(5):
    expected = argmax_rollout(model, prompts[b, :lengths[b]], 10, eos_id=eos_id)
    stopped += len(expected) < 10
    n = int(out.num_generated[b])
    assert n == len(expected)
    np.testing.assert_array_equal(out.tokens[b, :n], expected)
    assert (np.asarray(out.tokens[b, n:]) == PAD_ID).all()
  assert stopped >= 1


def test_rows_are_independent(model):
  prompts = np.tile(np.arange(1, 5, dtype=np.int32), (6, 1))
  lengths = np.full((6,), 4, np.int32)
  out = autoregressive_sample(model, prompts, lengths, jax.random.key(3), max_new_tokens=8)
  rows = {tuple(np.asarray(r).tolist()) for r in out.tokens}
  assert len(rows) > 1  # Identical prompts, independent draws.
  # A row's draws depend on its key only: changing another row's prompt leaves it unchanged.
  prompts2 = prompts.copy()
  prompts2[1:] = 9
  out2 = autoregressive_sample(model, prompts2, lengths, jax.random.key(3), max_new_tokens=8)
  np.testing.assert_array_equal(out.tokens[0], out2.tokens[0])


def test_one_compilation_per_bucket(model):
  sampling = SamplingConfig(temperature=0.8, top_p=0.9)
  run = lambda prompts, lengths, seed: autoregressive_sample(
      model, prompts, lengths, jax.random.key(seed), max_new_tokens=6, sampling=sampling)
  prompts, lengths = ragged_prompts(jax.random.key(4), 4, 5, 40)
  run(prompts, lengths, 0)
  before = autoregressive.trace_count
  for seed in range(1, 4):
    prompts, lengths = ragged_prompts(jax.random.key(seed + 10), 4, 5, 40)
    run(prompts, lengths, seed)
  assert autoregressive.trace_count == before


@pytest.mark.parametrize('change, match', [
    (dict(lengths=[0, 3]), 'prompt length'),
    (dict(lengths=[3, 6]), 'prompt length'),
    (dict(max_new_tokens=45), 'max_seq_len'),
    (dict(max_new_tokens=0), 'max_new_tokens'),
    (dict(prompts=[[1, 2, 40, 0, 0], [1, 2, 3, 4, 5]]), 'vocab'),
    (dict(prompts=[[1, -2, 3, 0, 0], [1, 2, 3, 4, 5]]), 'vocab'),
    (dict(eos_id=40), 'eos_id'),
])
def test_bad_input_raises(model, change, match):
  args = dict(prompts=[[1, 2, 3, 0, 0], [1, 2, 3, 4, 5]], lengths=[3, 5], max_new_tokens=4,
              eos_id=None)
  args.update(change)
  with pytest.raises(ValueError, match=match):
    autoregressive_sample(model, np.asarray(args['prompts'], np.int32),
                          np.asarray(args['lengths'], np.int32), jax.random.key(0),
                          max_new_tokens=args['max_new_tokens'], eos_id=args['eos_id'])


def test_batch_not_divisible_by_data_axis(model):
  from spsjax import sharding  # pylint: disable=g-import-not-at-top
  mesh = sharding.make_mesh(data=2, model=1, devices=jax.devices()[:2])
  with pytest.raises(ValueError, match='data axis'):
    autoregressive_sample(model, np.ones((3, 2), np.int32), np.full((3,), 2, np.int32),
                          jax.random.key(0), max_new_tokens=2, mesh=mesh)
