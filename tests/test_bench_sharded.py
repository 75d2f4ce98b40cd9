"""The experiments' library on a mesh of 8 fake CPU devices: a short Table 1 with the `model` axis 4
gives the unsharded greedy completions, the sweep, costs, profile, decode timing and held-out
evaluation run sharded, and nothing re-places the parameters inside a timed call."""

import jax
import numpy as np
import pytest

from spsjax import models, sampling, sharding
from spsjax.bench import decode, speedup, sweep
from spsjax.eval import tasks
from spsjax.sampling import common
from spsjax.train import evaluation
from tests import data_helpers


@pytest.fixture(scope='module', name='family')
def fixture_family():
  tok = data_helpers.small_tokenizer()
  make = lambda seed, **kw: (lambda c: models.Model(c, models.init_params(
      c, jax.random.key(seed))))(models.TransformerConfig(
          vocab_size=tok.vocab_size, max_seq_len=64, num_heads=4, num_kv_heads=4, d_ff=64, **kw))
  return make(0, d_model=32, num_layers=2), make(1, d_model=32, num_layers=1), tok


def _on(mesh, *models_):
  return [common.place_params(m, mesh) for m in models_]


def test_short_table1_on_a_mesh_matches_unsharded(family, tmp_path, monkeypatch):
  target, draft, tok = family
  task = tasks.Task('docstrings', ('def add(a, b):\n    """', 'def f():\n    """', 'x = 1\n',
                                     'class A:\n    """'),
                      ('Add two numbers.', 'Do f.', 'Set x.', 'An A.'), max_new_tokens=6)
  greedy = sampling.SamplingConfig(temperature=0.0)
  expected = speedup.run_rows(target, draft, tok, task, 'greedy', greedy, batch=2, k=3, seed=0)
  mesh = sharding.make_mesh(2, 4)
  target_m, draft_m = _on(mesh, target, draft)
  # Placed once: the samplers must not move the parameters again inside timed calls.
  monkeypatch.setattr(sharding, 'put', _refusing(sharding.put, target_m, draft_m))
  rows = speedup.run_rows(target_m, draft_m, tok, task, 'greedy', greedy, batch=2, k=3, seed=0,
                          mesh=mesh)
  for got, want in zip(rows, expected):
    assert got.completions == want.completions  # Greedy: the same tokens sharded or not.
    assert got.values == want.values and got.timing['calls'] == 2
  assert rows[1].alpha_model == pytest.approx(expected[1].alpha_model, abs=1e-4)
  with pytest.raises(ValueError, match='not divisible'):
    speedup.run_rows(target_m, draft_m, tok, task, 'greedy', greedy, batch=3, k=3, seed=0,
                     mesh=mesh)
  costs = decode.measure_costs(target_m, draft_m, 3, batch=2, capacity=32, repeats=2, mesh=mesh)
  assert costs.c > 0 and costs.s > 0
  profile = speedup.profile_row(target_m, draft_m, tok, task, greedy, 2, 3, 0, str(tmp_path),
                                mesh=mesh)
  assert profile.loops >= 1 and 0 < profile.draft + profile.score < profile.loop


def _refusing(put, *placed_models):
  """`sharding.put` that fails the test when asked to move a parameter of `placed_models`."""
  params = {id(x) for m in placed_models for x in jax.tree.leaves(m.params)}

  def guarded(tree, shardings):
    if any(id(x) in params for x in jax.tree.leaves(tree)):
      pytest.fail('parameters re-placed inside a call')
    return put(tree, shardings)

  return guarded


def test_sweep_decode_and_evaluation_on_a_mesh(family):
  target, draft, tok = family
  mesh = sharding.make_mesh(1, 4, jax.devices()[:4])
  target_m, draft_m = _on(mesh, target, draft)
  prompts, lengths = np.array([[5, 6, 7], [8, 9, 10]], np.int32), np.array([3, 2], np.int32)
  greedy = sampling.SamplingConfig(temperature=0.0)
  point = sweep.run_point('2', target_m, draft_m, 'd', prompts, lengths, k=2,
                          sampling_config=greedy, max_new_tokens=8, seed=0, mesh=mesh)
  unsharded = sweep.run_point('2', target, draft, 'd', prompts, lengths, k=2,
                              sampling_config=greedy, max_new_tokens=8, seed=0)
  assert point.k == 2 and point.loop_seconds > 0
  # Greedy: the same drafts are accepted sharded or not.
  assert (point.tokens_per_loop, point.acceptance_rate) == (unsharded.tokens_per_loop,
                                                            unsharded.acceptance_rate)
  result = decode.measure_decode(target_m, prompt_len=4, max_new_tokens=6, block=3, repeats=2,
                                 ars_repeats=1, mesh=mesh)
  assert result.path == 'xla' and result.step > 0 and result.block_step > 0
  batches = [np.asarray(jax.random.randint(jax.random.key(i), (2, 9), 0, tok.vocab_size),
                        np.int32) for i in range(2)]
  settings = {'greedy': greedy, 't1': sampling.SamplingConfig(temperature=1.0)}
  want = evaluation.evaluate_pair(target, draft, batches, settings)
  got = evaluation.evaluate_pair(target_m, draft_m, batches, settings, mesh=mesh)
  assert got == pytest.approx(want, rel=1e-4)
  assert evaluation.evaluate_model(target_m, batches, mesh=mesh)['loss'] == pytest.approx(
      want['target_loss'], rel=1e-4)
