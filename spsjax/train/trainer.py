"""The training loop: a sharded, jitted step with donated state, evaluation, checkpoints, resume.

Restarting the same run resumes from the latest checkpoint: parameters, optimizer state, step and the
input iterator's position come back together, so a run killed at any moment loses at most one save
interval and sees no batch twice. Metrics are read one step late, so the host never waits on the
step it just dispatched.

Invariants: every leaf of the state lives on the run's mesh (`state_shardings`: scalars replicated),
from creation through every step, save and restore; every process feeds the same global batch, and
builds from it the rows its own devices hold (`global_batch`), however the mesh spans processes.
"""

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Iterator

from absl import logging
import flax.struct
from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spsjax import models, sharding
from spsjax.models import feature_head
from spsjax.sampling import autoregressive
from spsjax.sampling.processors import SamplingConfig
from spsjax.train import (checkpoint, head_losses, losses, optimizer as optimizer_lib,
                          throughput)


DISTILL_DATA = ('corpus', 'student', 'teacher')


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  model: models.TransformerConfig
  optimizer: optimizer_lib.OptimizerConfig
  batch_size: int = 16  # Global batch, in sequences.
  seq_len: int = 128
  seed: int = 0
  log_every: int = 20
  eval_every: int = 200
  eval_batches: int = 8
  save_every: int = 100
  keep: int = 3
  distill_weight: float = 0.0  # 0: language-model loss only; 1: distillation only.
  distill_temperature: float = 1.0
  distill_divergence: str = 'forward_kl'  # One of losses.DIVERGENCES.
  # What the divergence is measured on: 'corpus' (the training batch), or on-policy sequences
  # that continue each row's first `distill_prompt_len` tokens, sampled at temperature 1 by the
  # 'student' (the current parameters) or the 'teacher'. A head trains on 'corpus' rows or on
  # the 'teacher's own samples (IBM's speculator's second phase: the text the head will draft
  # for), the first `distill_rows` rows (0: all) continued so.
  distill_data: str = 'corpus'
  distill_prompt_len: int = 32
  # The teacher's cost per step: the divergence covers the batch's first `distill_rows` rows only
  # (0: all), so the teacher's forward pass (and an on-policy generation) is that fraction of a
  # full batch's; the LM loss keeps every row.
  distill_rows: int = 0
  # Start from the teacher's embedding, first `model.num_layers` layers and final norm
  # (`models.truncated_params`) rather than at random: the model must be the teacher's, shorter.
  init_from_teacher: bool = False
  # A draft head over the frozen teacher's features (`models.feature_head`: 'feature', an EAGLE
  # head; 'falcon', a Falcon head; 'heads', parallel heads; 'mlp', an MLP speculator), trained
  # on `head_losses` instead of the LM loss: `model` is then the head's config
  # (`feature_head.head_config`). '' trains a transformer.
  head: str = ''
  head_feature_weight: float = 0.1  # The feature regression's weight beside the KL.
  head_own_steps: int = 0  # Runs on the head's own predictions (HASS; `head_losses`).
  head_own_step_decay: float = 1.0  # Run j's weight in the loss: decay^j (EAGLE-3: 0.8).

  def __post_init__(self):
    if self.head and self.head not in feature_head.KINDS:
      raise ValueError(f'head must be one of {feature_head.KINDS} (or empty), got {self.head!r}.')
    if self.head and (self.distill_weight or self.init_from_teacher):
      raise ValueError('A head trains on the teacher\'s features and laws (head_losses); '
                       'distill_weight and init_from_teacher apply to transformers only.')
    if self.head and self.distill_data == 'student':
      raise ValueError('A head trains on the corpus or on the teacher\'s samples '
                       '(distill_data=teacher); its own samples (student) are not the text it '
                       'drafts for.')
    if self.head_own_steps < 0 or self.head_own_steps and self.head != 'feature':
      raise ValueError(f'head_own_steps (HASS runs) must be >= 0 and needs head=feature; '
                       f'got {self.head_own_steps} with head={self.head!r}.')
    if not 0.0 < self.head_own_step_decay <= 1.0:
      raise ValueError(f'head_own_step_decay must be in (0, 1], got {self.head_own_step_decay}.')
    if self.model.draft_vocab_size and not self.head:
      raise ValueError('draft_vocab_size is a head\'s own output layer (`feature_head`); a '
                       'transformer has its whole vocabulary.')
    if not 0.0 <= self.distill_weight <= 1.0:
      raise ValueError(f'distill_weight must be in [0, 1], got {self.distill_weight}.')
    if self.distill_divergence not in losses.DIVERGENCES:
      raise ValueError(f'distill_divergence must be one of {losses.DIVERGENCES}, got '
                       f'{self.distill_divergence!r}.')
    if self.distill_data not in DISTILL_DATA:
      raise ValueError(f'distill_data must be one of {DISTILL_DATA}, got {self.distill_data!r}.')
    if not 0 <= self.distill_rows <= self.batch_size:
      raise ValueError(f'distill_rows must be in [0, batch_size={self.batch_size}] (0: all), got '
                       f'{self.distill_rows}.')
    if self.distill_data != 'corpus' and not 1 <= self.distill_prompt_len < self.seq_len:
      raise ValueError(f'distill_prompt_len must be in [1, seq_len={self.seq_len}) for '
                       f'on-policy data, got {self.distill_prompt_len}.')
    if self.seq_len + 1 > self.model.max_seq_len + 1 or self.seq_len < 1:
      raise ValueError(f'seq_len ({self.seq_len}) must be in [1, max_seq_len='
                       f'{self.model.max_seq_len}].')
    if self.batch_size < 1:
      raise ValueError(f'batch_size must be >= 1, got {self.batch_size}.')

  @property
  def steps(self) -> int:
    return self.optimizer.total_steps


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: dict
  opt_state: tuple


def _fixed_paths(params) -> frozenset:
  """The paths of the leaves no step trains: the integer ones (a head's draft vocabulary,
  `feature_head.DraftVocab`'s token ids, chosen before its first step). Arrays or abstract ones."""
  return frozenset(k for k, v in traverse_util.flatten_dict(params).items()
                   if not jnp.issubdtype(v.dtype, jnp.inexact))


def _without(tree, paths: frozenset):
  """`tree` (a tree shaped like the parameters) without the leaves at `paths`."""
  if not paths:
    return tree
  return traverse_util.unflatten_dict({k: v for k, v in traverse_util.flatten_dict(tree).items()
                                       if k not in paths})


def _trained(params):
  """The parameters a step trains (`_fixed_paths`' complement)."""
  return _without(params, _fixed_paths(params))


def _merged(trained, params):
  """`params` with the trained leaves replaced by `trained`'s."""
  if not _fixed_paths(params):
    return trained
  flat = traverse_util.flatten_dict(params)
  flat.update(traverse_util.flatten_dict(trained))
  return traverse_util.unflatten_dict(flat)


def state_shardings(config: TrainConfig, mesh: Mesh) -> TrainState:
  """Where every leaf of the state lives on `mesh`: parameters by their logical names, optimizer
  moments like their parameters, and every scalar (`step`, optax's counts) replicated.

  The state is created, stepped and restored with these, so no leaf is ever committed to a single
  device: a jitted step refuses arguments on different sets of devices.
  """
  params = _param_shardings(config, mesh)
  tx = optimizer_lib.make(config.optimizer)
  abstract = jax.eval_shape(functools.partial(init_params, config), jax.random.key(0))
  abstract_opt = jax.eval_shape(tx.init, _trained(abstract))
  replicated = NamedSharding(mesh, PartitionSpec())
  opt_state = optax.tree_map_params(tx, lambda _, s: s, abstract_opt,
                                    _without(params, _fixed_paths(abstract)),
                                    transform_non_params=lambda _: replicated,
                                    is_leaf=lambda x: isinstance(x, NamedSharding))
  return TrainState(step=replicated, params=params, opt_state=opt_state)


def init_params(config: TrainConfig, key: jax.Array, mesh: Mesh | None = None) -> dict:
  """Random parameters of what `config` trains (a transformer or a head)."""
  if config.head:
    return feature_head.init_head(config.head, config.model, key)
  return models.init_params(config.model, key, mesh=mesh)


def _param_shardings(config: TrainConfig, mesh: Mesh):
  if config.head:
    return feature_head.param_shardings(config.head, config.model, mesh)
  return models.param_shardings(config.model, mesh)


def _start(config: TrainConfig, params, mesh: Mesh) -> TrainState:
  """Step 0 from `params`, with a fresh optimizer state, laid out by `state_shardings`."""
  tx = optimizer_lib.make(config.optimizer)
  fresh = lambda p: TrainState(step=jnp.zeros((), jnp.int32), params=p,
                               opt_state=tx.init(_trained(p)))
  return jax.jit(fresh, out_shardings=state_shardings(config, mesh))(params)


def init_state(config: TrainConfig, mesh: Mesh) -> TrainState:
  """Fresh state, created sharded (`state_shardings`)."""
  return _start(config, init_params(config, jax.random.key(config.seed), mesh), mesh)


def _from_teacher(config: TrainConfig, teacher: models.Model, mesh: Mesh) -> TrainState:
  """Step 0 from the teacher's truncated parameters (copies: the step donates them)."""
  params = models.truncated_params(teacher.config, teacher.params, config.model)
  return _start(config, jax.tree.map(lambda x: jnp.array(x, copy=True), params), mesh)


def _on_policy(config: TrainConfig, params, teacher: models.Model, batch_BxL1, key, mesh):
  """Each row's first `distill_prompt_len` tokens, continued to the batch's length by the student
  (`params`) or the teacher, sampling at temperature 1 (int32[B, L + 1], no gradient)."""
  B, L1 = batch_BxL1.shape
  P = config.distill_prompt_len
  generator = teacher if config.distill_data == 'teacher' else models.Model(config.model, params)
  loop = autoregressive.Loop(max_new_tokens=L1 - P, sampling=SamplingConfig(temperature=1.0),
                             mesh=mesh)
  out = loop.run(generator, batch_BxL1[:, :P],
                 jnp.full((B,), P, jnp.int32), key)
  return jnp.concatenate([batch_BxL1[:, :P], out.tokens], axis=1)


def _loss(config: TrainConfig, params, teacher: models.Model | None, batch_BxL1,
          distill_BxL1=None):
  """(loss, metrics): the LM loss on `batch`, mixed with the divergence from the teacher on
  `distill` (the batch itself for corpus distillation; on-policy sequences otherwise, where only
  the sampled positions count)."""
  if config.head:
    return head_losses.head_loss(config.head, models.Model(config.model, params), teacher,
                                 batch_BxL1, feature_weight=config.head_feature_weight,
                                 own_steps=config.head_own_steps,
                                 own_step_decay=config.head_own_step_decay)
  distilling = teacher is not None and config.distill_weight > 0
  on_policy = distilling and config.distill_data != 'corpus'
  logits_BxLxV, lm = losses.next_token(functools.partial(models.logits, config.model, params),
                                       batch_BxL1)
  if config.distill_weight == 1.0 and on_policy:  # The LM loss is a metric only: no backward.
    lm = jax.lax.stop_gradient(lm)
  metrics = dict(lm_loss=lm)
  loss = lm
  if distilling:
    R = config.distill_rows or batch_BxL1.shape[0]
    inputs_BxL = (distill_BxL1 if on_policy else batch_BxL1[:R])[:, :-1]
    if on_policy:
      logits_BxLxV = models.logits(config.model, params, inputs_BxL)
    else:
      logits_BxLxV = logits_BxLxV[:R]
    teacher_BxLxV = models.logits(teacher.config, teacher.params, inputs_BxL)
    # On-policy: the positions that predict a sampled token (the prompt's own are corpus text).
    first = config.distill_prompt_len - 1 if on_policy else 0
    mask_BxL = jnp.broadcast_to(jnp.arange(inputs_BxL.shape[1]) >= first, inputs_BxL.shape)
    divergence = losses.distillation(logits_BxLxV, teacher_BxLxV, mask_BxL,
                                     config.distill_temperature, config.distill_divergence)
    loss = (1.0 - config.distill_weight) * lm + config.distill_weight * divergence
    metrics['distill'] = divergence
  metrics['loss'] = loss
  return loss, metrics


def make_train_step(config: TrainConfig, mesh: Mesh | None = None):
  """The jitted step (state, teacher, batch) -> (state, metrics), donating the state. On `mesh` its
  outputs keep `state_shardings` (and the metrics replicated), step after step."""
  tx = optimizer_lib.make(config.optimizer)
  on_policy = (config.distill_weight > 0 or config.head) and config.distill_data != 'corpus'

  def train_step(state: TrainState, teacher, batch_BxL1):
    distill_BxL1 = None
    if on_policy and teacher is not None:  # A key per step: a resumed run samples the same.
      key = jax.random.fold_in(jax.random.key(config.seed), state.step)
      rows = config.distill_rows or batch_BxL1.shape[0]
      distill_BxL1 = _on_policy(config, state.params, teacher, batch_BxL1[:rows], key, mesh)
      if config.head:  # The head's batch: the teacher's samples, then corpus rows.
        batch_BxL1 = jnp.concatenate([distill_BxL1, batch_BxL1[rows:]], axis=0)
        distill_BxL1 = None
    trained = _trained(state.params)
    grad_fn = jax.value_and_grad(
        lambda t: _loss(config, _merged(t, state.params), teacher, batch_BxL1, distill_BxL1),
        has_aux=True)
    (_, metrics), grads = grad_fn(trained)
    updates, opt_state = tx.update(grads, state.opt_state, trained)
    params = _merged(optax.apply_updates(trained, updates), state.params)
    metrics['grad_norm'] = optax.tree.norm(grads)
    metrics['learning_rate'] = optimizer_lib.schedule(config.optimizer)(state.step)
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

  placed = {} if mesh is None else dict(out_shardings=(
      state_shardings(config, mesh), NamedSharding(mesh, PartitionSpec())))
  return jax.jit(train_step, donate_argnums=(0,), **placed)


def make_eval_step(config: TrainConfig, teacher: models.Model | None = None):
  """(params, batch) -> the held-out `lm_loss` (a head's: its first draft's cross-entropy, read
  on `teacher`'s features)."""
  step = jax.jit(lambda params, teacher, batch: _loss(config, params, teacher, batch)[1]['lm_loss'])
  return lambda params, batch: step(params, teacher if config.head else None, batch)


def global_batch(batch_BxL1: np.ndarray, mesh: Mesh) -> jax.Array:
  """A global batch (the same host array on every process) on `mesh`, rows over the `data` axis.

  Each process builds the shards of its own devices from it, wherever the mesh puts them: rows are
  not tied to processes, so a `model` axis across processes gets the same batch as one process.
  """
  return sharding.put(batch_BxL1, sharding.named(('batch', None), batch_BxL1.shape, mesh))


def evaluate(config: TrainConfig, params, batches: Iterator[np.ndarray], mesh: Mesh,
             eval_step=None) -> dict:
  """Mean held-out loss and perplexity over `config.eval_batches` batches."""
  eval_step = eval_step or make_eval_step(config)
  values = [eval_step(params, global_batch(next(batches), mesh))
            for _ in range(config.eval_batches)]
  loss = float(np.mean(jax.device_get(values)))
  return dict(eval_loss=loss, eval_perplexity=losses.perplexity(loss))


def _progress(step: int, total: int, start_step: int, started: float) -> str:
  width = 24
  done = int(width * step / max(total, 1))
  rate = (step - start_step) / max(time.time() - started, 1e-9)
  eta = (total - step) / rate if rate > 0 else float('inf')
  eta_text = f'{eta / 60:.1f} min' if math.isfinite(eta) else '?'
  return f'[{"#" * done}{"." * (width - done)}] {step}/{total} {rate:.2f} steps/s ETA {eta_text}'


def _meters(config: TrainConfig, mesh: Mesh,
            teacher: models.Model | None) -> tuple[throughput.Meter, throughput.Meter]:
  flops = (throughput.head_flops_per_token(config.head, config.model, config.seq_len,
                                           config.head_own_steps) if config.head
           else throughput.flops_per_token(config.model, config.seq_len))
  peak = throughput.run_peak(mesh.size)
  logging.info('Throughput: %s.', throughput.describe(peak, flops))
  if teacher is not None and (config.distill_weight > 0 or config.head):  # Not in MFU: said
    # here once (a head's target reads every row).
    share = 1.0 if config.head else (config.distill_rows or config.batch_size) / config.batch_size
    logging.info('Teacher: %.1f MFLOP per token trained (its forward pass on %.0f%% of the rows, '
                 'not counted in MFU).', share * throughput.teacher_flops_per_token(
                     teacher.config, config.seq_len) / 1e6, 100 * share)
  return tuple(throughput.Meter(config.batch_size * config.seq_len, flops, peak)
               for _ in range(2))


def _speed_text(speed: dict[str, float]) -> str:
  if not speed:
    return ''
  return f' | {speed["tokens_per_second"]:.0f} tokens/s, MFU {100 * speed["mfu"]:.1f}%'


def train(config: TrainConfig, *, workdir: str, train_batches, eval_batches: Callable[[], Iterator],
          tokenizer_bytes: bytes, mesh: Mesh, teacher: models.Model | None = None,
          meta: dict | None = None, draft_vocab: Callable[[], np.ndarray] | None = None
          ) -> tuple[TrainState, dict]:
  """Trains (or resumes) to `config.steps`; returns the final state and the last metrics.

  `train_batches` yields global batches, `int32[batch_size, seq_len + 1]`, the same on every
  process, and has `get_state()` / `set_state(dict)`; `eval_batches()` returns a fresh iterator
  over held-out global batches. A head with a draft vocabulary (`draft_vocab_size`) starts with
  the tokens `draft_vocab()` gives (`feature_head.with_draft_vocab`), and keeps them on resume.
  """
  if (config.distill_weight > 0 or config.init_from_teacher or config.head) and teacher is None:
    raise ValueError('distill_weight > 0, init_from_teacher and a head need a teacher (the '
                     'trained target).')
  if config.head:
    feature_head.check_pair(teacher, models.Model(config.model, {}))
  if config.model.draft_vocab_size and draft_vocab is None:
    raise ValueError(f'A head of draft_vocab_size {config.model.draft_vocab_size} needs its '
                     f'tokens (draft_vocab: the most frequent of its training data).')
  if teacher is not None and teacher.config.vocab_size != config.model.vocab_size:
    raise ValueError(f'Teacher vocab_size ({teacher.config.vocab_size}) differs from the '
                     f'student\'s ({config.model.vocab_size}); they must share a tokenizer.')
  sharding.check_batch(config.batch_size, mesh)
  mngr = checkpoint.manager(workdir, keep=config.keep, save_every=config.save_every)
  meta = checkpoint.encode_meta(config.model, tokenizer_bytes, dict(
      meta or {}, optimizer=dataclasses.asdict(config.optimizer),
      **({'head': config.head} if config.head else {})))
  state = init_state(config, mesh)
  if mngr.latest_step() is not None:
    state, data_state, saved_meta = checkpoint.restore(mngr, checkpoint.abstract_like(state))
    if not checkpoint.same_model(saved_meta, config.model):
      raise ValueError(f'Checkpoint in {workdir} has model {saved_meta["model"]}, the config asks '
                       f'for {meta["model"]}: use another workdir.')
    if saved_meta.get('optimizer', meta['optimizer']) != meta['optimizer']:
      raise ValueError(
          f'Checkpoint in {workdir} was trained with optimizer settings '
          f'{saved_meta["optimizer"]}, the config asks for {meta["optimizer"]} (another number '
          f'of steps changes the schedule): use another workdir, or the same settings to resume.')
    train_batches.set_state(data_state)
    logging.info('Resumed from step %d in %s.', int(state.step), workdir)
  elif config.model.draft_vocab_size:
    head = feature_head.with_draft_vocab(models.Model(config.model, state.params), draft_vocab())
    state = state.replace(params=head.params)
  if teacher is not None:
    teacher = teacher.replace(params=jax.device_put(
        teacher.params, models.param_shardings(teacher.config, mesh)))
    if config.init_from_teacher and int(state.step) == 0:
      state = _from_teacher(config, teacher, mesh)
      logging.info('Starting from the teacher\'s first %d layers, embedding and final norm.',
                   config.model.num_layers)

  train_step, eval_step = make_train_step(config, mesh), make_eval_step(config, teacher)
  start_step = int(state.step)
  if start_step >= config.steps:
    logging.info('%s holds step %d of %d: training is complete.', workdir, start_step,
                 config.steps)
  # Tokens/s and MFU per log line, and over the run.
  meters = _meters(config, mesh, teacher) if start_step < config.steps else None
  started, pending, metrics = time.time(), None, {}
  for step in range(start_step, config.steps):
    batch = global_batch(next(train_batches), mesh)
    state, step_metrics = train_step(state, teacher, batch)
    if step == start_step + 1:  # The first step (and its compilation) is done: clocks start.
      jax.block_until_ready(pending)
      for meter in meters:
        meter.tick(step)
    if pending is not None and (step % config.log_every == 0 or step == config.steps - 1):
      metrics = {k: float(v) for k, v in jax.device_get(pending).items()}
      speed = meters[0].tick(step)
      coverage = f' (coverage {metrics["coverage"]:.3f})' if 'coverage' in metrics else ''
      logging.info('%s loss %.4f lm %.4f%s lr %.2e |g| %.2f%s', _progress(step, config.steps,
                                                                          start_step, started),
                   metrics['loss'], metrics['lm_loss'], coverage, metrics['learning_rate'],
                   metrics['grad_norm'], _speed_text(speed))
    pending = step_metrics
    done = step + 1
    if done % config.eval_every == 0 or done == config.steps:
      metrics.update(evaluate(config, state.params, eval_batches(), mesh, eval_step))
      logging.info('step %d: eval loss %.4f perplexity %.2f', done, metrics['eval_loss'],
                   metrics['eval_perplexity'])
    if done % config.save_every == 0 or done == config.steps:
      checkpoint.save(mngr, done, state, train_batches.get_state(), meta,
                      force=done == config.steps)
  if pending is not None:
    metrics.update({k: float(v) for k, v in jax.device_get(pending).items()})
  if meters:
    jax.block_until_ready(state)
    metrics.update(meters[1].tick(config.steps))  # Evaluations and saves included.
  mngr.wait_until_finished()
  mngr.close()
  return state, metrics
