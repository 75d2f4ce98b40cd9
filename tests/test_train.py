"""Training: the loss falls, checkpoints restore bit-exactly (data position included), a run killed
with SIGKILL resumes without losing more than a save interval or seeing a batch twice, distillation,
and bad configs fail at start with a message that names the problem."""

import dataclasses
import functools
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spsjax import models, sampling, sharding
from spsjax.data import python_code
from spsjax.sampling import drafter_config
from spsjax.train import checkpoint, experiment, head_losses, load, losses, trainer
from tests import data_helpers, forwards, train_helpers, xla_env

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope='module', name='finished')
def fixture_finished(tmp_path_factory):
  """An uninterrupted 20-step run: (workdir, final state, metrics)."""
  workdir = str(tmp_path_factory.mktemp('train') / 'run')
  state, metrics = train_helpers.run(workdir)
  return workdir, state, metrics


def _leaves_equal(a, b) -> bool:
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y))
                                    for x, y in zip(la, lb))


def test_twenty_steps_lower_the_held_out_loss(finished):
  _, state, metrics = finished
  config = train_helpers.CONFIG
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ('data', 'model'))
  initial = trainer.evaluate(config, trainer.init_state(config, mesh).params,
                             train_helpers.held_out(data_helpers.small_tokenizer())(), mesh)
  assert int(state.step) == train_helpers.STEPS
  assert metrics['eval_loss'] < initial['eval_loss'] - 0.3, (metrics, initial)
  assert metrics['tokens_per_second'] > 0 and 0 < metrics['mfu'] < 1, metrics


def test_checkpoint_restores_bit_exactly_with_the_data_position(finished):
  workdir, state, _ = finished
  mngr = checkpoint.manager(workdir, create=False)
  assert mngr.all_steps() == [5, 10, 15, 20]
  restored, data_state, meta = checkpoint.restore(mngr, checkpoint.abstract_like(state))
  mngr.close()
  assert _leaves_equal(restored, state)
  assert data_state['batch_in_epoch'] == train_helpers.STEPS and data_state['epoch'] == 0
  tok = data_helpers.small_tokenizer()
  model, loaded_tok, _ = load.load_model(workdir)
  assert model.config == train_helpers.CONFIG.model and loaded_tok.to_bytes() == tok.to_bytes()
  assert _leaves_equal(model.params, state.params)
  assert meta['optimizer']['total_steps'] == train_helpers.STEPS
  # The saved position resumes the stream where the run stopped.
  fresh = train_helpers.RecordedBatches(
      experiment.pipeline.PackedBatches(data_helpers.texts('train'), tok, train_helpers.BATCH,
                                        train_helpers.SEQ_LEN), workdir + '.probe', workdir, None)
  reference = [next(fresh) for _ in range(train_helpers.STEPS + 1)][-1]
  fresh.set_state(data_state)
  assert np.array_equal(next(fresh), reference)


def test_loading_for_sampling_reads_only_the_parameters(finished, monkeypatch):
  """`load_model` restores the parameters alone (sharded on a mesh if given) and does not import
  the training code: a checkpoint whose optimizer state cannot be rebuilt still loads."""
  workdir, state, _ = finished
  code = ('import sys; import spsjax.train.load; '
          'print(sorted(m for m in ("optax", "spsjax.train.optimizer", "spsjax.train.trainer") '
          'if m in sys.modules))')
  out = subprocess.run([sys.executable, '-c', code], cwd=_REPO, capture_output=True, text=True,
                       check=True)
  assert out.stdout.strip() == '[]', out.stdout
  # Any attempt to read or rebuild the optimizer state fails loudly.
  monkeypatch.setattr(checkpoint, 'restore', lambda *a, **k: pytest.fail('full state restored'))
  mesh = jax.make_mesh((2, 4), ('data', 'model'), devices=jax.devices()[:8],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  model, _, meta = load.load_model(workdir, mesh=mesh)
  assert _leaves_equal(model.params, state.params)
  assert meta['optimizer']['total_steps'] == train_helpers.STEPS  # Meta is still read.
  expected = models.param_shardings(model.config, mesh)
  for leaf, want in zip(jax.tree.leaves(model.params), jax.tree.leaves(expected)):
    assert leaf.sharding.is_equivalent_to(want, leaf.ndim)


def test_killed_run_resumes_exactly(finished, tmp_path):
  finished_dir, state, _ = finished
  workdir = str(tmp_path / 'run')
  script = (f'import sys; sys.path.insert(0, {_REPO!r}); from tests import train_helpers; '
            f'train_helpers.run({workdir!r}, kill_at=13)')
  killed = subprocess.run([sys.executable, '-c', script], env=data_helpers.subprocess_env(),
                          capture_output=True, text=True, timeout=300, check=False)
  assert killed.returncode == -9, killed.stderr[-3000:]
  saved = sorted(int(d) for d in os.listdir(workdir) if d.isdigit())
  assert saved and max(saved) >= 13 - train_helpers.SAVE_EVERY  # At most one interval lost.
  first_run = train_helpers.seen(workdir)
  assert len(first_run) == 13

  resumed, _ = train_helpers.run(workdir)  # The same command again.
  uninterrupted = train_helpers.seen(finished_dir)
  # The resumed run picks up the stream at the last checkpoint: the model saw each batch once.
  assert train_helpers.seen(workdir)[13:] == uninterrupted[max(saved):]
  assert first_run == uninterrupted[:13]
  assert _leaves_equal(resumed.params, state.params)
  assert int(resumed.step) == train_helpers.STEPS


def _off_the_mesh(state, config, mesh) -> list[str]:
  """The leaves of `state` that do not live where they should on `mesh`: every leaf on all of its
  devices, scalars replicated, parameters by their logical names."""
  params = models.param_shardings(config.model, mesh)
  wrong = []
  for path, leaf in jax.tree_util.tree_leaves_with_path(state):
    name = jax.tree_util.keystr(path)
    if leaf.sharding.device_set != set(mesh.devices.flat) or (
        leaf.ndim == 0 and not leaf.sharding.is_fully_replicated):
      wrong.append(f'{name}: {leaf.sharding}')
  for path, leaf, want in zip(*zip(*jax.tree_util.tree_leaves_with_path(state.params)),
                              jax.tree.leaves(params)):
    if not leaf.sharding.is_equivalent_to(want, leaf.ndim):
      wrong.append(f'params{jax.tree_util.keystr(path)}: {leaf.sharding}, not {want}')
  return wrong


# A shorter run whose heads, MLP and vocabulary all split 4 ways.
MESH_CONFIG = dataclasses.replace(
    train_helpers.CONFIG, save_every=3, eval_every=10,
    model=dataclasses.replace(train_helpers.CONFIG.model, num_heads=4),
    optimizer=dataclasses.replace(train_helpers.CONFIG.optimizer, total_steps=10))


def test_killed_run_resumes_exactly_on_a_2x4_mesh(tmp_path):
  """Data and model parallel (2 x 4 of the 8 fake devices): a run killed after its step-6 save
  resumes to the uninterrupted run's bits, and the state lives on the mesh from start to finish
  (fresh, stepped, restored)."""
  mesh = sharding.make_mesh(2, 4, jax.devices()[:8])
  finished_dir, workdir = str(tmp_path / 'finished'), str(tmp_path / 'run')
  state, _ = train_helpers.run(finished_dir, config=MESH_CONFIG, mesh=mesh)
  script = (f'import sys; sys.path.insert(0, {_REPO!r}); from spsjax import sharding; '
            f'from tests import test_train, train_helpers; '
            f'train_helpers.run({workdir!r}, kill_at=8, config=test_train.MESH_CONFIG, '
            f'mesh=sharding.make_mesh(2, 4))')
  env = dict(data_helpers.subprocess_env(), XLA_FLAGS=xla_env.flags(devices=8))
  killed = subprocess.run([sys.executable, '-c', script], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
  assert killed.returncode == -9, killed.stderr[-3000:]
  assert max(int(d) for d in os.listdir(workdir) if d.isdigit()) == 6

  resumed, _ = train_helpers.run(workdir, config=MESH_CONFIG, mesh=mesh)  # The same command.
  assert train_helpers.seen(workdir)[8:] == train_helpers.seen(finished_dir)[6:]
  assert _leaves_equal(resumed, state) and int(resumed.step) == 10
  mngr = checkpoint.manager(workdir, create=False)
  restored, _, _ = checkpoint.restore(mngr, checkpoint.abstract_like(state), step=6)
  mngr.close()
  assert int(restored.step) == 6
  for tree in (trainer.init_state(MESH_CONFIG, mesh), state, restored, resumed):
    assert not _off_the_mesh(tree, MESH_CONFIG, mesh)


@pytest.mark.parametrize('kind', losses.DIVERGENCES)
def test_distillation_loss_is_zero_for_the_same_model(kind):
  config = train_helpers.CONFIG.model
  params = models.init_params(config, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, config.vocab_size)
  logits = forwards.full_logits(config, params, tokens)
  mask = jnp.ones(tokens.shape, bool)
  loss = lambda s, t: losses.distillation(s, t, mask, kind=kind)
  assert float(loss(logits, logits)) == pytest.approx(0.0, abs=1e-6)
  other = forwards.full_logits(config, models.init_params(config, jax.random.key(2)), tokens)
  assert float(loss(logits, other)) > 1e-3
  # No gradient reaches the teacher, and the student's vanishes at the teacher (TV's subgradient
  # at 0 is 0 too).
  grad = jax.grad(loss, argnums=(0, 1))(logits, logits)
  assert float(jnp.abs(grad[0]).max()) < 1e-6 and float(jnp.abs(grad[1]).max()) == 0.0


def test_divergences_against_their_formulas():
  p = np.array([0.5, 0.3, 0.2, 0.0])
  q = np.array([0.25, 0.25, 0.25, 0.25])
  want = dict(forward_kl=sum(pi * np.log(pi / qi) for pi, qi in zip(p, q) if pi > 0),
              tv=1.0 - np.minimum(p, q).sum())  # 1 - beta: SpS's rejection probability.
  log = lambda x: jnp.log(jnp.asarray(x, jnp.float32))[None, None]
  for kind in ('forward_kl', 'tv'):
    got = losses.distillation(log(q), log(p), jnp.ones((1, 1), bool), kind=kind)
    assert float(got) == pytest.approx(want[kind], rel=1e-5), kind
  # Reverse KL is infinite where the student has mass the teacher has not; on full supports:
  p2 = np.array([0.5, 0.3, 0.15, 0.05])
  got = losses.distillation(log(q), log(p2), jnp.ones((1, 1), bool), kind='reverse_kl')
  assert float(got) == pytest.approx(float(np.sum(q * np.log(q / p2))), rel=1e-5)
  with pytest.raises(ValueError, match='Unknown divergence'):
    losses.distillation(log(q), log(p), jnp.ones((1, 1), bool), kind='js')


def test_distillation_settings_are_checked():
  for bad, match in ((dict(distill_divergence='kl'), 'distill_divergence must be one of'),
                     (dict(distill_data='web'), 'distill_data must be one of'),
                     (dict(distill_data='student', distill_prompt_len=0), 'distill_prompt_len'),
                     (dict(distill_data='teacher', distill_prompt_len=train_helpers.SEQ_LEN),
                      'distill_prompt_len'),
                     (dict(distill_rows=train_helpers.BATCH + 1), 'distill_rows')):
    with pytest.raises(ValueError, match=match):
      dataclasses.replace(train_helpers.CONFIG, **bad)


def _experiment(root, **overrides):
  exp = experiment.Experiment(
      train=train_helpers.CONFIG,
      data=experiment.DataConfig(config=python_code.SMALL.name, data_dir=data_helpers.data_dir()),
      root=str(root), name='draft')
  return dataclasses.replace(exp, **overrides)


def test_bad_configs_fail_at_start(finished, tmp_path):
  with pytest.raises(ValueError, match="Unknown dataset 'no_such_data'"):
    experiment.run(_experiment(tmp_path, data=experiment.DataConfig(name='no_such_data',
                                                                    text_field='text')))
  with pytest.raises(FileNotFoundError, match='Teacher checkpoint directory .*target'):
    experiment.run(_experiment(tmp_path, teacher='target'))
  with pytest.raises(FileNotFoundError, match='does not exist'):
    load.load_model(str(tmp_path / 'nowhere'))
  with pytest.raises(ValueError, match='need a teacher'):
    experiment.run(_experiment(tmp_path, train=dataclasses.replace(train_helpers.CONFIG,
                                                                   distill_weight=0.5)))
  # Resuming a finished run under another schedule (more steps) would mix two schedules.
  longer = dataclasses.replace(train_helpers.CONFIG, optimizer=dataclasses.replace(
      train_helpers.CONFIG.optimizer, total_steps=train_helpers.STEPS * 2))
  resumed = str(tmp_path / 'resumed')
  shutil.copytree(finished[0], resumed)
  with pytest.raises(ValueError, match='optimizer settings .*another number of steps'):
    train_helpers.run(resumed, config=longer)
  # A family whose tokenizer has another vocabulary than the draft's config.
  data_helpers.small_tokenizer().save(str(tmp_path / experiment.TOKENIZER_FILE))
  small_draft = dataclasses.replace(
      train_helpers.CONFIG, model=dataclasses.replace(train_helpers.CONFIG.model, vocab_size=512))
  with pytest.raises(ValueError, match='vocab_size 1024.*asks for 512'):
    experiment.run(_experiment(tmp_path, train=small_draft))
  # A teacher trained with another tokenizer than the family's: target/draft vocabulary mismatch.
  other = tmp_path / 'other'
  other.mkdir()
  experiment.family_tokenizer(str(other / experiment.TOKENIZER_FILE),
                              lambda: data_helpers.texts('validation'), data_helpers.SMALL_VOCAB)
  os.symlink(finished[0], other / 'target')
  with pytest.raises(ValueError, match='another tokenizer'):
    experiment.run(_experiment(other, teacher='target', train=dataclasses.replace(
        train_helpers.CONFIG, distill_weight=1.0)))


def test_distill_rows_bound_the_teacher_to_the_first_rows():
  """With distill_rows=2 the divergence is the first two rows' (the teacher sees only them); the
  LM loss keeps the whole batch."""
  config = dataclasses.replace(train_helpers.CONFIG, distill_weight=0.5, distill_rows=2)
  student = models.init_params(config.model, jax.random.key(0))
  teacher = models.Model(config.model, models.init_params(config.model, jax.random.key(1)))
  batch = jax.random.randint(jax.random.key(2), (4, 17), 0, config.model.vocab_size)
  seen = []
  real_logits = models.logits

  def logits(model_config, params, tokens):
    seen.append(tokens.shape[0])
    return real_logits(model_config, params, tokens)

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(trainer.models, 'logits', logits)
    _, metrics = trainer._loss(config, student, teacher, batch)  # pylint: disable=protected-access
  assert seen == [4, 2]  # The student on the batch, the teacher on two rows.
  want = losses.distillation(real_logits(config.model, student, batch[:2, :-1]),
                             real_logits(teacher.config, teacher.params, batch[:2, :-1]),
                             jnp.ones((2, 16), bool))
  assert float(metrics['distill']) == pytest.approx(float(want), rel=1e-5)
  _, lm = losses.next_token(functools.partial(real_logits, config.model, student), batch)
  assert float(metrics['lm_loss']) == pytest.approx(float(lm), rel=1e-6)


@pytest.mark.parametrize('kind,data', [('forward_kl', 'corpus'), ('reverse_kl', 'student'),
                                       ('tv', 'teacher')])
def test_distillation_moves_the_student_towards_the_teacher(finished, tmp_path, kind, data):
  finished_dir, _, _ = finished
  teacher, _, _ = load.load_model(finished_dir)
  config = dataclasses.replace(
      train_helpers.CONFIG, distill_weight=1.0, seed=1, distill_divergence=kind,
      distill_data=data, distill_prompt_len=8,
      model=dataclasses.replace(train_helpers.CONFIG.model, d_model=16),
      optimizer=dataclasses.replace(train_helpers.CONFIG.optimizer, total_steps=10))
  batch = jnp.asarray(next(train_helpers.held_out(data_helpers.small_tokenizer())()))
  mask = jnp.ones(batch[:, 1:].shape, bool)
  teacher_logits = forwards.full_logits(teacher.config, teacher.params, batch[:, :-1])

  def divergence(params):  # Measured on held-out corpus text, whatever the training data.
    return float(losses.distillation(forwards.full_logits(config.model, params, batch[:, :-1]),
                                     teacher_logits, mask, kind=kind))

  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ('data', 'model'))
  initial = trainer.init_state(config, mesh).params
  before = divergence(initial)
  if data != 'corpus':  # The on-policy batch: the rows' prompts, then sampled tokens.
    on_policy = trainer._on_policy  # pylint: disable=protected-access
    sequences = on_policy(config, initial, teacher, batch, jax.random.key(0), mesh)
    assert sequences.shape == batch.shape
    np.testing.assert_array_equal(sequences[:, :8], batch[:, :8])
    assert not np.array_equal(sequences[:, 8:], batch[:, 8:])
    assert int(sequences.min()) >= 0 and int(sequences.max()) < config.model.vocab_size
  tok = data_helpers.small_tokenizer()
  state, metrics = trainer.train(
      config, workdir=str(tmp_path / 'student'), train_batches=experiment.pipeline.PackedBatches(
          data_helpers.texts('train'), tok, train_helpers.BATCH, train_helpers.SEQ_LEN),
      eval_batches=train_helpers.held_out(tok), tokenizer_bytes=tok.to_bytes(), mesh=mesh,
      teacher=teacher)
  assert 'distill' in metrics and metrics['loss'] == pytest.approx(metrics['distill'])
  assert divergence(state.params) < before - (0.02 if kind == 'tv' else 0.1), kind


def test_a_checkpoint_that_predates_a_model_option_resumes():
  """Options added to TransformerConfig later (with their defaults) do not strand a checkpoint:
  its meta lacks them and means the defaults; any field that differs still refuses."""
  config = train_helpers.CONFIG.model
  meta = checkpoint.encode_meta(config, b'tokenizer', {})
  newer = ('qkv_bias', 'dense_bias', 'norm', 'position', 'rope_scaling')
  old = dict(meta, model={k: v for k, v in meta['model'].items() if k not in newer})
  assert checkpoint.same_model(old, config) and checkpoint.same_model(meta, config)
  assert not checkpoint.same_model(old, dataclasses.replace(config, norm='layer'))
  assert not checkpoint.same_model(meta, dataclasses.replace(config, d_ff=config.d_ff * 2))
  scaled = dataclasses.replace(config, rope_scaling=models.RopeScaling('llama3', 8.0))
  assert not checkpoint.same_model(meta, scaled)
  as_json = json.loads(json.dumps(checkpoint.encode_meta(scaled, b'tokenizer', {})))
  assert checkpoint.decode_meta(as_json)[0] == scaled and checkpoint.same_model(as_json, scaled)


def test_a_checkpoint_meta_leaves_out_the_kernels():
  """How a placed copy computes (`kernels`, which `models.pack` sets; `single_row`) is no part of
  the model a checkpoint describes."""
  config = train_helpers.CONFIG.model
  placed = dataclasses.replace(config, kernels='native', single_row='padded')
  meta = checkpoint.encode_meta(placed, b'tokenizer', {})
  assert 'kernels' not in meta['model'] and 'single_row' not in meta['model']
  assert checkpoint.same_model(meta, config) and checkpoint.same_model(meta, placed)


def test_a_draft_can_start_from_the_teachers_first_layers(finished, tmp_path):
  """init_from_teacher: the first step starts from the teacher's parameters (copies: the step
  donates its state, the teacher stays usable); a model that is no truncation is refused."""
  teacher, _, _ = load.load_model(finished[0])
  config = dataclasses.replace(
      train_helpers.CONFIG, init_from_teacher=True,
      optimizer=dataclasses.replace(train_helpers.CONFIG.optimizer, total_steps=2,
                                    learning_rate=1e-7, warmup_steps=1))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ('data', 'model'))
  tok = data_helpers.small_tokenizer()
  run = functools.partial(
      trainer.train, train_batches=experiment.pipeline.PackedBatches(
          data_helpers.texts('train'), tok, train_helpers.BATCH, train_helpers.SEQ_LEN),
      eval_batches=train_helpers.held_out(tok), tokenizer_bytes=tok.to_bytes(), mesh=mesh)
  state, _ = run(config, workdir=str(tmp_path / 'trunc'), teacher=teacher)
  gaps = [float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(state.params),
                                                       jax.tree.leaves(teacher.params))]
  assert max(gaps) < 1e-4, gaps
  random_init = trainer.init_state(config, mesh).params
  assert max(float(jnp.abs(a - b).max()) for a, b in zip(
      jax.tree.leaves(random_init), jax.tree.leaves(teacher.params))) > 0.1
  assert np.isfinite(np.asarray(forwards.full_logits(teacher.config, teacher.params,
                                                     jnp.zeros((1, 2), jnp.int32)))).all()
  with pytest.raises(ValueError, match='need a teacher'):
    run(config, workdir=str(tmp_path / 'alone'))
  wider = dataclasses.replace(config, model=dataclasses.replace(config.model, d_model=48))
  with pytest.raises(ValueError, match='truncated copy'):
    run(wider, workdir=str(tmp_path / 'wider'), teacher=teacher)


def test_a_heads_loss_in_its_draft_vocabulary_weighs_its_runs():
  """A head drafting 10 of 40 tokens: its KL is to the target's law restricted to them and
  renormalized, its logits its own over them (numpy from its `in_draft_vocab` forward);
  `lm_loss` the cross-entropy on the corpus tokens in it, `coverage` their share; with one
  own-step run the KLs weigh 1 and decay."""
  config = models.TransformerConfig(vocab_size=40, d_model=16, num_layers=2, num_heads=2,
                                    d_ff=32, max_seq_len=32)
  target = models.Model(config, models.init_params(config, jax.random.key(0)))
  vocab = np.arange(0, 40, 4)
  head_config = models.feature_head.head_config(config, 1, (), len(vocab))
  head = models.Model(head_config, models.feature_head.init_head('feature', head_config,
                                                                jax.random.key(1)))
  head = models.feature_head.with_draft_vocab(head, vocab)
  batch = jnp.asarray(np.random.default_rng(0).integers(0, 40, size=(2, 10)), jnp.int32)
  loss = lambda steps, decay=1.0: head_losses.head_loss(
      'feature', head, target, batch, feature_weight=0.0, own_steps=steps,
      own_step_decay=decay)[1]
  one = loss(0)
  f = models.features(config, target.params, batch[:, :-1])
  q, _ = models.feature_head.feature_head_forward(head, target, f[:, :-1], batch[:, 1:-1],
                                                  in_draft_vocab=True)
  log_q = np.asarray(jax.nn.log_softmax(q))
  log_p = np.asarray(jax.nn.log_softmax(models.logits(config, target.params, batch[:, :-1])[
      :, 1:, vocab]))
  np.testing.assert_allclose(one['distill'], np.mean(np.sum(np.exp(log_p) * (log_p - log_q), -1)),
                             rtol=1e-5)
  corpus = np.asarray(batch[:, 2:])
  inside = np.isin(corpus, vocab)
  assert 0 < inside.sum() < inside.size
  nll = -np.take_along_axis(log_q, (corpus // 4)[..., None], -1)[..., 0]
  np.testing.assert_allclose(one['lm_loss'], nll[inside].mean(), rtol=1e-5)
  np.testing.assert_allclose(one['coverage'], inside.mean())
  kl0, kl1 = float(one['distill']), 2 * float(loss(1)['distill']) - float(one['distill'])
  np.testing.assert_allclose(loss(1, 0.5)['distill'], (kl0 + 0.5 * kl1) / 1.5, rtol=1e-5)


def test_an_mlp_speculators_stage_i_trains_on_the_corpus_tokens_before_its_own():
  """Stage i at pair t (features f_t) reads x_{t+1} .. x_{t+1+i} and is scored against the
  target's law of x_{t+2+i}: the KL per stage over the pairs where it exists, averaged over
  the stages (each stage's law from its own `mlp_speculator` call, numpy KL)."""
  config = models.TransformerConfig(vocab_size=40, d_model=16, num_layers=2, num_heads=2,
                                    d_ff=32, max_seq_len=32)
  target = models.Model(config, models.init_params(config, jax.random.key(0)))
  head_config = models.feature_head.head_config(config, 3)
  head = models.Model(head_config, models.feature_head.init_head('mlp', head_config,
                                                                jax.random.key(1)))
  batch = np.random.default_rng(0).integers(0, 40, size=(1, 8)).astype(np.int32)
  got = head_losses.head_loss('mlp', head, target, jnp.asarray(batch), feature_weight=0.0)[1]
  inputs = batch[:, :-1]
  L = inputs.shape[1]
  f = np.asarray(models.features(config, target.params, jnp.asarray(inputs)))
  log_p = np.asarray(jax.nn.log_softmax(models.logits(config, target.params,
                                                      jnp.asarray(inputs))))
  per_stage, speculator = [], jax.jit(models.feature_head.mlp_speculator)
  for i in range(3):
    kls = []
    for b in range(1):
      for t in range(L - 1 - i):
        logits, _ = speculator(head, target, jnp.asarray(f[b, t][None]),
                               jnp.asarray(inputs[b, t + 1:t + 2 + i][None]))
        log_q = np.asarray(jax.nn.log_softmax(logits[0, i]))
        p = np.exp(log_p[b, t + 1 + i])
        kls.append(np.sum(p * (log_p[b, t + 1 + i] - log_q)))
    per_stage.append(np.mean(kls))
  np.testing.assert_allclose(got['distill'], np.mean(per_stage), rtol=1e-4)


def test_a_falcon_heads_pair_t_trains_on_the_law_m_positions_on():
  """A Falcon head of 3 drafts a pass: pair t (in training's aligned blocks of 3,
  `feature_head.block_ends`) is scored against the target's law of x_{t+4}, KL(p_{t+3} || q_t),
  over the pairs where it exists; lm_loss is each such pair's cross-entropy on x_{t+4} (numpy,
  from the head's own forward)."""
  config = models.TransformerConfig(vocab_size=40, d_model=16, num_layers=2, num_heads=2,
                                    d_ff=32, max_seq_len=32)
  target = models.Model(config, models.init_params(config, jax.random.key(0)))
  head_config = models.feature_head.head_config(config, 1, drafts_per_pass=3)
  head = models.Model(head_config, models.feature_head.init_head('falcon', head_config,
                                                                jax.random.key(1)))
  batch = np.random.default_rng(0).integers(0, 40, size=(2, 11)).astype(np.int32)
  got = head_losses.head_loss('falcon', head, target, jnp.asarray(batch), feature_weight=0.0)[1]
  inputs = jnp.asarray(batch[:, :-1])
  f = models.features(config, target.params, inputs)
  log_p = np.asarray(jax.nn.log_softmax(models.logits(config, target.params, inputs)))
  q, _ = models.feature_head.feature_head_forward(
      head, target, f[:, :-1], inputs[:, 1:],
      sees_T=jnp.asarray([2, 2, 2, 5, 5, 5, 8, 8, 8], jnp.int32))
  log_q = np.asarray(jax.nn.log_softmax(q))[:, :7]  # Pairs t <= 6: p_{t+3} within the batch.
  p = np.exp(log_p[:, 3:])
  np.testing.assert_allclose(got['distill'], np.mean(np.sum(p * (log_p[:, 3:] - log_q), -1)),
                             rtol=1e-5)
  nll = -np.take_along_axis(log_q, batch[:, 4:, None], -1)
  np.testing.assert_allclose(got['lm_loss'], nll.mean(), rtol=1e-5)


@pytest.mark.parametrize('taps', [(), (0, 1, 2)])
def test_own_step_runs_see_what_drafting_sees(taps):
  """`head_losses.own_steps_tree`: run j's pair at position s, on the tree of runs 0 .. j, gives
  the prediction drafting gives after the head read the target's pairs 0 .. s - j (a cached
  call) and then its own predictions with the tokens, one step at a time (`extend_head`), for
  a head of the target's last output and one of its taps."""
  config = models.TransformerConfig(vocab_size=40, d_model=16, num_layers=2, num_heads=2,
                                    d_ff=32, max_seq_len=32)
  target = models.Model(config, models.init_params(config, jax.random.key(0)))
  head_config = models.feature_head.head_config(config, 1, taps)
  head = models.Model(head_config, models.feature_head.init_head('feature', head_config,
                                                                jax.random.key(1)))
  T, runs, F = 5, 3, 16 * max(len(taps), 1)
  rng = np.random.default_rng(0)
  features_1xTxF = jnp.asarray(rng.normal(size=(1, T, F)), jnp.float32)
  tokens_1xT = jnp.asarray(rng.integers(0, 40, size=(1, T)), jnp.int32)
  streams = [models.feature_head.stream(head, features_1xTxF)]
  tokens, predicted = [tokens_1xT], []  # predicted[j]: run j's, positions j .. T - 1.
  for run in range(runs):
    tree, firsts = head_losses.own_steps_tree(T, run + 1)
    _, out_1xNxD = models.feature_head.feature_head_forward(
        head, target, jnp.concatenate(streams, 1), jnp.concatenate(tokens, 1), tree)
    predicted.append(np.asarray(out_1xNxD[0, firsts[run]:]))
    streams.append(jnp.asarray(predicted[-1][None, :T - run - 1]))
    tokens.append(tokens_1xT[:, run + 1:])
  assert tree.num_nodes + 1 == T + (T - 1) + (T - 2) and firsts == (0, T, 2 * T - 1)
  for run in range(runs):
    for s in range(run, T):
      cache = models.init_cache(head_config, 1, T + runs)
      _, out_1xLxD, cache = models.feature_head.extend_head(
          head, target, cache, features_1xTxF[:, :s - run + 1], tokens_1xT[:, :s - run + 1])
      for step in range(1, run + 1):  # Its own prediction at the position before, the token.
        position = s - run + step
        _, out_1xLxD, cache = models.feature_head.extend_head(
            head, target, cache, out_1xLxD[:, -1:], tokens_1xT[:, position:position + 1])
      np.testing.assert_allclose(predicted[run][s - run], out_1xLxD[0, -1], rtol=2e-4,
                                 atol=2e-4, err_msg=f'run {run}, position {s}')


def test_a_head_trains_on_the_teachers_samples(finished):
  """distill_data=teacher for a head (IBM's speculator's second phase): a step's loss is
  head_losses' on the batch's first distill_rows rows continued by the teacher at temperature 1
  with the step's key (a resumed run draws the same), the other rows as the corpus gave them;
  the student's own samples are refused."""
  finished_dir, _, _ = finished
  teacher, tok, _ = load.load_model(finished_dir)
  config = dataclasses.replace(
      train_helpers.CONFIG, head='mlp', seed=3, distill_data='teacher', distill_prompt_len=8,
      distill_rows=2, model=models.feature_head.head_config(teacher.config, 3, (), 0))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ('data', 'model'))
  state = trainer.init_state(config, mesh)
  batch = jnp.asarray(next(train_helpers.held_out(tok)()))
  key = jax.random.fold_in(jax.random.key(config.seed), 0)
  sampled = trainer._on_policy(config, state.params, teacher, batch[:2], key, mesh)  # pylint: disable=protected-access
  np.testing.assert_array_equal(sampled[:, :8], batch[:2, :8])
  assert not np.array_equal(sampled[:, 8:], batch[:2, 8:])
  kl = lambda rows: float(head_losses.head_loss(
      'mlp', models.Model(config.model, state.params), teacher, rows,
      feature_weight=config.head_feature_weight)[1]['distill'])
  want, corpus = kl(jnp.concatenate([sampled, batch[2:]])), kl(batch)
  _, metrics = trainer.make_train_step(config, mesh)(state, teacher, batch)
  assert float(metrics['distill']) == pytest.approx(want, rel=1e-5)
  assert abs(want - corpus) > 1e-3 * corpus  # The samples, not the corpus rows, were trained on.
  with pytest.raises(ValueError, match='its own samples'):
    dataclasses.replace(config, distill_data='student')


@pytest.mark.parametrize('head,own_steps,taps,vocab', [
    ('feature', 1, False, 0), ('heads', 0, False, 256), ('feature', 1, True, 256),
    ('mlp', 0, False, 0), ('falcon', 0, False, 0)])
def test_a_head_learns_the_targets_law_and_loads_for_drafting(finished, tmp_path, head,
                                                              own_steps, taps, vocab):
  """A head over the finished run's features (`head_losses`; the EAGLE head with one HASS-style
  run on its own predictions; `taps`: reading the target's embedding and last output side by
  side, EAGLE-3's features; `vocab`: drafting the 256 most frequent tokens of its training
  batches from its own output layer; a Falcon head of 2 drafts a pass): 10 steps lower its KL
  to the target's law on held-out text; its checkpoint says it is a head (of those taps, that
  vocabulary) and loads as one, and drafts for the target in SpS."""
  finished_dir, _, _ = finished
  teacher, tok, _ = load.load_model(finished_dir)
  # One block (EAGLE's, Falcon's), or 3 parallel heads or MLP speculator stages.
  layers = 1 if head in ('feature', 'falcon') else 3
  taps = (0, teacher.config.num_layers) if taps else ()
  config = dataclasses.replace(
      train_helpers.CONFIG, head=head, head_own_steps=own_steps, seed=2,
      model=models.feature_head.head_config(teacher.config, layers, taps, vocab,
                                            2 if head == 'falcon' else 1),
      optimizer=dataclasses.replace(train_helpers.CONFIG.optimizer, total_steps=10))
  batches = experiment.pipeline.PackedBatches(data_helpers.texts('train'), tok,
                                              train_helpers.BATCH, train_helpers.SEQ_LEN)
  most_frequent = lambda: batches.most_frequent(vocab, config.model.vocab_size, 20_000)
  batch = jnp.asarray(next(train_helpers.held_out(tok)()))
  kl = lambda params: float(head_losses.head_loss(
      head, models.Model(config.model, params), teacher, batch, feature_weight=0.1)[1]['distill'])
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ('data', 'model'))
  start = models.Model(config.model, trainer.init_state(config, mesh).params)
  if vocab:  # The KL in the vocabulary the run drafts.
    start = models.feature_head.with_draft_vocab(start, most_frequent())
  before = kl(start.params)
  workdir = str(tmp_path / (head + str(taps)))
  state, metrics = trainer.train(
      config, workdir=workdir, train_batches=batches, eval_batches=train_helpers.held_out(tok),
      tokenizer_bytes=tok.to_bytes(), mesh=mesh, teacher=teacher,
      draft_vocab=most_frequent if vocab else None)
  assert {'distill', 'feature', 'lm_loss', 'eval_loss'} <= set(metrics)
  assert ('coverage' in metrics) == bool(vocab)
  assert kl(state.params) < before - 0.1, (before, kl(state.params))
  loaded, _, meta = load.load_model(workdir)
  assert meta['head'] == head and models.feature_head.kind(loaded) == head
  assert loaded.config.feature_taps == taps and ('taps' in loaded.params) == bool(taps)
  assert _leaves_equal(loaded.params, state.params)
  if vocab:
    drafted = np.asarray(models.feature_head.draft_vocab(loaded))
    np.testing.assert_array_equal(drafted, most_frequent())
    assert drafted[-1] > 2 * vocab  # The most frequent of ~1,000 tokens, not the first ids.
    assert 0.5 < metrics['coverage'] < 1.0
    with pytest.raises(ValueError, match='needs its tokens'):
      trainer.train(config, workdir=str(tmp_path / 'none'), train_batches=batches,
                    eval_batches=train_helpers.held_out(tok), tokenizer_bytes=tok.to_bytes(),
                    mesh=mesh, teacher=teacher)
  prompts = np.asarray(batch[:2, :6])
  out = sampling.speculative_sample(teacher, loaded, prompts, np.full((2,), 6, np.int32),
                                    jax.random.key(0), k=2, max_new_tokens=6,
                                    drafter=drafter_config.build(head))
  assert (np.asarray(out.num_generated) == 6).all()
  with pytest.raises(ValueError, match='A head trains on the teacher'):
    dataclasses.replace(config, distill_weight=0.5)
