"""One process of the 2-process training test (`test_multihost.py`): `model` across the processes.

  python tests/multihost_train_worker.py COORDINATOR_ADDRESS PROCESS_ID OUT_DIR first|resume

The mesh is 2 x 2 with each `data` row holding one device of each process (`layout`), so every
process holds every row of a batch and half of the model. `first` runs `multihost_worker.check`
(generation on other meshes of the same processes, and a checkpoint; OUT_DIR/result.json), then
evaluates as `experiments/evaluate.py` does (held-out loss, and alpha of a target/draft pair),
(process 0) writes OUT_DIR/first.json, and trains `CONFIG` in OUT_DIR/run, where both processes
SIGKILL themselves after its step-4 save.
`resume` runs the same command again in OUT_DIR/run and (process 0) writes OUT_DIR/resume.json
and OUT_DIR/resume.npz. The tokenizer is OUT_DIR/tokenizer.model.
"""

import dataclasses
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position

from spsjax import distributed, models, sharding  # pylint: disable=wrong-import-position
from spsjax.data.tokenizer import Tokenizer  # pylint: disable=wrong-import-position
from spsjax.sampling import SamplingConfig  # pylint: disable=wrong-import-position
from spsjax.train import evaluation, experiment  # pylint: disable=wrong-import-position
from tests import (  # pylint: disable=wrong-import-position
    data_helpers, multihost_worker, train_helpers)

# Heads, MLP and vocabulary split over `model`; 6 steps, saves at 2, 4 and 6.
CONFIG = dataclasses.replace(
    train_helpers.CONFIG, save_every=2, eval_every=6, eval_batches=2,
    model=dataclasses.replace(train_helpers.CONFIG.model, num_heads=4),
    optimizer=dataclasses.replace(train_helpers.CONFIG.optimizer, total_steps=6))
KILL_AT = 5  # The batch at which a run dies, after its step-4 save.
DRAFT = dataclasses.replace(CONFIG.model, d_ff=32)
SETTINGS = {'sampled': SamplingConfig(temperature=1.0), 'top_k': SamplingConfig(top_k=5)}
EVAL_BATCHES = 2


def layout(devices_by_process) -> np.ndarray:
  """[data, model] devices where `model` runs across processes: row i holds device i of each."""
  return np.array(devices_by_process, dtype=object).T


def evaluate(tok: Tokenizer, mesh) -> dict:
  """What `experiments/evaluate.py` computes on held-out text: a model's loss, and its alpha
  against a draft under `SETTINGS` (both random: this does not depend on the training)."""
  target = models.Model(CONFIG.model, models.init_params(CONFIG.model, jax.random.key(4),
                                                         mesh=mesh))
  draft = models.Model(DRAFT, models.init_params(DRAFT, jax.random.key(5), mesh=mesh))
  batches = list(itertools.islice(experiment.held_out(
      data_helpers.texts('validation'), tok, CONFIG.batch_size, CONFIG.seq_len), EVAL_BATCHES))
  return dict(model=evaluation.evaluate_model(target, batches, mesh=mesh),
              pair=evaluation.evaluate_pair(target, draft, batches, SETTINGS, mesh=mesh))


def _write(out_dir: str, name: str, result: dict, params=None) -> None:
  if params is not None:
    params = distributed.gather(params)  # Every process takes part; process 0 writes.
  if distributed.is_main():
    with open(os.path.join(out_dir, f'{name}.json'), 'w', encoding='utf-8') as f:
      json.dump(result, f)
    if params is not None:
      np.savez(os.path.join(out_dir, f'{name}.npz'), *jax.tree.leaves(params))


def main(address: str, process_id: int, out_dir: str, mode: str) -> None:
  distributed.initialize(distributed.Options(address, num_processes=2, process_id=process_id))
  assert jax.process_count() == 2 and jax.device_count() == 4 and jax.local_device_count() == 2
  mesh = sharding.mesh_of(layout([jax.local_devices(process_index=p) for p in range(2)]))
  with open(os.path.join(out_dir, 'tokenizer.model'), 'rb') as f:
    tok = Tokenizer.from_bytes(f.read())
  run = lambda name, kill_at=None: train_helpers.run(os.path.join(out_dir, name), kill_at, CONFIG,
                                                     mesh, tok)
  if mode == 'first':
    multihost_worker.check(out_dir)
    result = dict(evaluate=evaluate(tok, mesh),
                  model_rows=[sorted(d.process_index for d in row) for row in mesh.devices])
    _write(out_dir, 'first', result)
    run('run', kill_at=KILL_AT)  # Dies.
  else:
    state, metrics = run('run')
    _write(out_dir, 'resume', dict(metrics=metrics, step=int(state.step)), state.params)
  distributed.print0('worker done')


if __name__ == '__main__':
  main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
