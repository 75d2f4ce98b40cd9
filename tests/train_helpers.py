"""Shared by the training tests and the subprocess they kill: one tiny, fully determined run.

`run(workdir, kill_at=None)` trains the tiny config on the small stdlib subset (on a 1 x 1 mesh
unless given one). With `kill_at=i` the process SIGKILLs itself when the trainer asks for batch i,
once the last checkpoint before it is on disk: a crash in mid-run after a save landed. Every batch
handed to the trainer is appended (as a hash) to `<workdir>.batches` (by process 0 of several),
so a test can list what each run saw.
"""

import dataclasses
import hashlib
import os
import signal
import time

import jax

from spsjax import models, sharding
from spsjax.data import pipeline, tokenizer
from spsjax.train import checkpoint, optimizer, trainer
from tests import data_helpers

BATCH, SEQ_LEN, STEPS, SAVE_EVERY = 4, 32, 20, 5

CONFIG = trainer.TrainConfig(
    model=models.TransformerConfig(vocab_size=data_helpers.SMALL_VOCAB, d_model=32, num_layers=1,
                                   num_heads=2, d_ff=64, max_seq_len=64),
    optimizer=optimizer.OptimizerConfig(learning_rate=1e-2, warmup_steps=2, total_steps=STEPS),
    batch_size=BATCH, seq_len=SEQ_LEN, log_every=5, eval_every=STEPS, eval_batches=2,
    save_every=SAVE_EVERY, keep=10)


class RecordedBatches:
  """A `PackedBatches` that logs each batch it hands out and can kill its own process (at batch
  `kill_at`, once checkpoint `kill_after_save` is on disk)."""

  def __init__(self, batches: pipeline.PackedBatches, log_path: str, workdir: str,
               kill_at: int | None, kill_after_save: int | None = None):
    self._batches, self._log_path, self._workdir, self._kill_at = batches, log_path, workdir, kill_at
    self._kill_after_save = kill_after_save
    self._count = 0

  def __iter__(self):
    return self

  def __next__(self):
    if self._kill_at is not None and self._count == self._kill_at:
      deadline = time.time() + 60
      while not os.path.isdir(os.path.join(self._workdir, str(self._kill_after_save))):
        if time.time() > deadline:
          raise TimeoutError(f'Checkpoint {self._kill_after_save} never landed.')
        time.sleep(0.05)
      os.kill(os.getpid(), signal.SIGKILL)
    batch = next(self._batches)
    self._count += 1
    if jax.process_index() == 0:
      with open(self._log_path, 'a', encoding='utf-8') as f:
        f.write(hashlib.sha256(batch.tobytes()).hexdigest()[:16] + '\n')
    return batch

  def get_state(self):
    return self._batches.get_state()

  def set_state(self, state):
    self._batches.set_state(state)


def held_out(tok):
  eval_pipeline = pipeline.PackedBatches(data_helpers.texts('validation'), tok, BATCH, SEQ_LEN)
  start = eval_pipeline.get_state()

  def batches():
    eval_pipeline.set_state(start)
    return eval_pipeline

  return batches


def run(workdir: str, kill_at: int | None = None, config: trainer.TrainConfig = CONFIG,
        mesh: jax.sharding.Mesh | None = None, tok: tokenizer.Tokenizer | None = None):
  """Trains (or resumes) the tiny run in `workdir` on `mesh` (None: 1 x 1); returns (final state,
  metrics)."""
  tok = tok or data_helpers.small_tokenizer()
  kill_after_save = None if kill_at is None else kill_at - kill_at % config.save_every
  train = RecordedBatches(
      pipeline.PackedBatches(data_helpers.texts('train'), tok, config.batch_size, config.seq_len,
                             seed=0),
      workdir + '.batches', workdir, kill_at, kill_after_save)
  mesh = mesh or sharding.make_mesh(1, 1, jax.devices()[:1])
  return trainer.train(config, workdir=workdir, train_batches=train, eval_batches=held_out(tok),
                       tokenizer_bytes=tok.to_bytes(), mesh=mesh)


def seen(workdir: str) -> list[str]:
  with open(workdir + '.batches', encoding='utf-8') as f:
    return f.read().split()


def save_untrained(workdir: str, model_config: models.TransformerConfig, seed: int,
                   tokenizer_bytes: bytes, step: int) -> trainer.TrainState:
  """What `trainer.train` leaves in `workdir` after `step` (state, data position, meta), without
  the training: a fresh state from the trainer's own `init_state`."""
  config = dataclasses.replace(CONFIG, model=model_config, seed=seed)
  state = trainer.init_state(config, sharding.make_mesh(1, 1, jax.devices()[:1]))
  meta = checkpoint.encode_meta(model_config, tokenizer_bytes,
                                dict(optimizer=dataclasses.asdict(config.optimizer)))
  mngr = checkpoint.manager(workdir)
  checkpoint.save(mngr, step, state, {'position': step}, meta, force=True)
  mngr.wait_until_finished()
  mngr.close()
  return state
