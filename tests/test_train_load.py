"""Loading a family (`load.load_family`) from checkpoints as the trainer writes them: the saved
parameters and tokenizer come back, placed for decoding or sharded on a mesh, and a draft with
another tokenizer or a missing member is refused."""

import dataclasses
import os

import jax
import numpy as np
import pytest

from spsjax import models, sharding
from spsjax.data import tokenizer
from spsjax.sampling import SamplingConfig, autoregressive_sample
from spsjax.train import load, trainer
from tests import data_helpers, forwards, train_helpers


def _save_run(workdir: str, model_config: models.TransformerConfig, seed: int,
              tokenizer_bytes: bytes) -> trainer.TrainState:
  return train_helpers.save_untrained(workdir, model_config, seed, tokenizer_bytes, 3)


@pytest.fixture(scope='module', name='family')
def fixture_family(tmp_path_factory):
  """<root>/{target, draft, stranger}: a pair with one tokenizer, and a draft with another."""
  root = str(tmp_path_factory.mktemp('family'))
  tok = data_helpers.small_tokenizer()
  other_tok = tokenizer.Tokenizer.train(data_helpers.texts('train')[:20], 512)
  assert other_tok.to_bytes() != tok.to_bytes()
  base = train_helpers.CONFIG.model
  target_config = dataclasses.replace(base, num_layers=2, num_kv_heads=1)
  draft_config = dataclasses.replace(base, d_model=16, num_heads=2, d_ff=32)
  saved = {'target': _save_run(os.path.join(root, 'target'), target_config, 0, tok.to_bytes()),
           'draft': _save_run(os.path.join(root, 'draft'), draft_config, 1, tok.to_bytes())}
  stranger_config = dataclasses.replace(draft_config, vocab_size=other_tok.vocab_size)
  _save_run(os.path.join(root, 'stranger'), stranger_config, 2, other_tok.to_bytes())
  return root, tok, saved


def _assert_params_equal(got, want):
  got_leaves = jax.tree_util.tree_leaves_with_path(got)
  want_leaves = jax.tree_util.tree_leaves_with_path(want)
  assert [p for p, _ in got_leaves] == [p for p, _ in want_leaves]
  for (path, x), (_, y) in zip(got_leaves, want_leaves):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


def test_load_family_gives_the_saved_models_placed_for_decoding(family):
  root, tok, saved = family
  target, drafts, loaded_tok, meta = load.load_family(root, 'target', ['draft'])
  assert loaded_tok.to_bytes() == tok.to_bytes() and list(drafts) == ['draft']
  assert meta['optimizer'] == dataclasses.asdict(train_helpers.CONFIG.optimizer)
  for model, name in ((target, 'target'), (drafts['draft'], 'draft')):
    # Packed for the native kernels where they run here, and unpacked the very saved values.
    assert models.is_packed(model) == (models.packable(models.unpack(model)) is None), name
    _assert_params_equal(models.unpack(model).params, saved[name].params)
  assert target.config.num_layers == 2 and drafts['draft'].config.d_model == 16
  # Drafts may be placed with bfloat16 weights; the target stays float32.
  target_bf, drafts_bf, _, _ = load.load_family(root, 'target', ['draft'],
                                                draft_weights='bfloat16')
  if models.is_packed(target):
    assert models.packed_dtype(target_bf) == 'float32'
    assert models.packed_dtype(drafts_bf['draft']) == 'bfloat16'
  with pytest.raises(ValueError, match='draft_weights'):
    load.load_family(root, 'target', ['draft'], draft_weights='float16')
  # The loaded target samples as the saved one does (greedy, a few tokens).
  prompts, lengths = np.array([[5, 6, 7], [8, 9, 0]], np.int32), np.array([3, 2], np.int32)
  # The loaded config on XLA's kernels (the saved parameters are not packed).
  saved_target = models.Model(dataclasses.replace(target.config, kernels='xla'),
                              saved['target'].params)
  want = autoregressive_sample(saved_target, prompts, lengths, jax.random.key(0),
                               max_new_tokens=4, sampling=SamplingConfig(temperature=0.0))
  got = autoregressive_sample(target, prompts, lengths, jax.random.key(0), max_new_tokens=4,
                              sampling=SamplingConfig(temperature=0.0))
  np.testing.assert_array_equal(got.tokens, want.tokens)


def test_load_family_on_a_mesh_is_sharded_by_the_rules(family):
  root, _, saved = family
  mesh = sharding.make_mesh(2, 4)
  target, drafts, _, _ = load.load_family(root, 'target', ['draft'], mesh=mesh)
  for model, name in ((target, 'target'), (drafts['draft'], 'draft')):
    assert not models.is_packed(model), name
    _assert_params_equal(model.params, saved[name].params)
    shardings = models.param_shardings(model.config, mesh)
    for x, want in zip(jax.tree.leaves(model.params), jax.tree.leaves(shardings)):
      assert x.sharding.is_equivalent_to(want, x.ndim), (name, x.sharding, want)


def test_load_family_refuses_another_tokenizer_and_missing_members(family):
  root, _, _ = family
  with pytest.raises(ValueError, match='different tokenizers'):
    load.load_family(root, 'target', ['draft', 'stranger'])
  with pytest.raises(FileNotFoundError):
    load.load_family(root, 'target', ['nowhere'])
  with pytest.raises(FileNotFoundError):
    load.load_family(root, 'nowhere', ['draft'])


def test_the_random_draft_is_useless_and_loads_beside_a_trained_target(family):
  """`random`: no checkpoint, the target's first-layer shape, near one-hot laws that put little
  mass where the target's are (alpha = sum min(p, q) well below a plain random draft's)."""
  root, _, _ = family
  target, drafts, _, _ = load.load_family(root, 'target', ['draft', load.RANDOM_DRAFT])
  useless = models.unpack(drafts[load.RANDOM_DRAFT])
  assert useless.config.num_layers == 1 and useless.config.d_model == target.config.d_model
  tokens = np.array([[5, 6, 7, 8, 9, 10, 11, 12]], np.int32)
  q = jax.nn.softmax(forwards.full_logits(useless.config, useless.params, tokens), -1)
  assert float(np.mean(np.max(q, -1))) > 0.5  # Sharp: a flat law would have 1 / V.
  unpacked = models.unpack(target)
  p = jax.nn.softmax(forwards.full_logits(unpacked.config, unpacked.params, tokens), -1)
  alpha = float(np.mean(np.sum(np.minimum(p, q), -1)))
  assert alpha < 2.0 / target.config.vocab_size ** 0.5, alpha
  mesh = sharding.make_mesh(2, 4)
  _, on_mesh, _, _ = load.load_family(root, 'target', [load.RANDOM_DRAFT], mesh=mesh)
  _assert_params_equal(on_mesh[load.RANDOM_DRAFT].params, useless.params)
