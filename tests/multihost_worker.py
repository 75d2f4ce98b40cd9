"""What 2 processes check of a 4-device mesh over both (`test_multihost.py`).

  python tests/multihost_worker.py COORDINATOR_ADDRESS PROCESS_ID OUT_DIR

`check` runs greedy ArS and SpS on a target and draft whose `model` axis spans both processes,
again with the `data` axis across them and prompts given as arrays no process holds whole, a short
Table 1 (`bench.speedup.run_rows`, tokenizer OUT_DIR/tokenizer.model) on that mesh, saves and
restores a checkpoint of the sharded parameters from both processes, and (process 0) writes what
it saw to OUT_DIR/result.json. The test runs it in the processes of `multihost_train_worker.py
first`, before their training (one start of the pair for both); this file runs it alone.
"""

import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position

from spsjax import distributed, models, sampling, sharding  # pylint: disable=wrong-import-position
from spsjax.bench import speedup  # pylint: disable=wrong-import-position
from spsjax.eval import tasks  # pylint: disable=wrong-import-position
from spsjax.data.tokenizer import Tokenizer  # pylint: disable=wrong-import-position
from spsjax.train import checkpoint  # pylint: disable=wrong-import-position
from tests import data_helpers  # pylint: disable=wrong-import-position

# The test tokenizer's vocabulary: the table's models then have these configs too, and each
# process compiles one initialisation per config and mesh for both.
TARGET = models.TransformerConfig(vocab_size=data_helpers.SMALL_VOCAB, d_model=32, num_layers=2,
                                  num_heads=4, num_kv_heads=4, d_ff=64, max_seq_len=48)
DRAFT = dataclasses.replace(TARGET, num_layers=1, d_ff=48)
PROMPTS = np.array([[5, 9, 3, 7, 1, 0], [2, 4, 6, 8, 10, 12]], np.int32)
LENGTHS = np.array([5, 6], np.int32)
MAX_NEW, K = 10, 3
GREEDY = sampling.SamplingConfig(temperature=0.0)
TABLE_TASK = tasks.Task('docstrings', ('def add(a, b):\n    """', 'x = 1\n'),
                          ('Add two numbers.', 'Set x.'), max_new_tokens=5)


def generate(mesh):
  """(ArS tokens, SpS tokens, target params, draft params) on `mesh` (None: one device)."""
  target = models.Model(TARGET, models.init_params(TARGET, jax.random.key(0), mesh=mesh))
  draft = models.Model(DRAFT, models.init_params(DRAFT, jax.random.key(1), mesh=mesh))
  ars = sampling.autoregressive_sample(target, PROMPTS, LENGTHS, jax.random.key(2),
                                       max_new_tokens=MAX_NEW, sampling=GREEDY, mesh=mesh)
  sps = sampling.speculative_sample(target, draft, PROMPTS, LENGTHS, jax.random.key(2), k=K,
                                    max_new_tokens=MAX_NEW, sampling=GREEDY, mesh=mesh)
  return ars.tokens, sps.tokens, target.params, draft.params


def table_completions(tok: Tokenizer, mesh):
  """(ArS, SpS) completions of a greedy Table 1 row pair on `TABLE_TASK`, batch 2."""
  config = dataclasses.replace(TARGET, vocab_size=tok.vocab_size)
  target = models.Model(config, models.init_params(config, jax.random.key(3), mesh=mesh))
  draft_config = dataclasses.replace(DRAFT, vocab_size=tok.vocab_size)
  draft = models.Model(draft_config, models.init_params(draft_config, jax.random.key(4),
                                                        mesh=mesh))
  ars, sps = speedup.run_rows(target, draft, tok, TABLE_TASK, 'greedy', GREEDY, batch=2, k=2,
                              seed=0, mesh=mesh)
  return ars.completions, sps.completions


def spread_prompts_tokens(mesh):
  """Greedy SpS tokens with prompts given as global arrays whose rows live on both processes."""
  target = models.Model(TARGET, models.init_params(TARGET, jax.random.key(0), mesh=mesh))
  draft = models.Model(DRAFT, models.init_params(DRAFT, jax.random.key(1), mesh=mesh))
  rows = lambda x: sharding.named(('batch',) + (None,) * (x.ndim - 1), x.shape, mesh)
  prompts, lengths = (jax.make_array_from_callback(x.shape, rows(x), lambda index, x=x: x[index])
                      for x in (PROMPTS, LENGTHS))
  assert not prompts.is_fully_addressable and not lengths.is_fully_addressable
  sps = sampling.speculative_sample(target, draft, prompts, lengths, jax.random.key(2), k=K,
                                    max_new_tokens=MAX_NEW, sampling=GREEDY, mesh=mesh)
  return sps.tokens


def check(out_dir: str) -> None:
  """Everything above, in each of 2 processes of 2 devices each; process 0 writes
  OUT_DIR/result.json."""
  assert jax.process_count() == 2 and jax.device_count() == 4 and jax.local_device_count() == 2
  mesh = sharding.make_mesh(1, 4)  # The model axis spans both processes.
  spans = {d.process_index for d in mesh.devices.ravel()}
  ars, sps, target_params, _ = generate(mesh)
  wq = target_params['layer_0']['attn']['wq']
  assert not wq.is_fully_addressable  # Really split across the processes.

  mngr = checkpoint.manager(os.path.join(out_dir, 'checkpoint'))
  checkpoint.save(mngr, 1, target_params, {'position': 7}, {'note': 'multihost'}, force=True)
  mngr.wait_until_finished()
  restored, data_state, meta = checkpoint.restore(mngr, checkpoint.abstract_like(target_params))
  mngr.close()
  same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), distributed.gather(restored),
                      distributed.gather(target_params))
  restored_sharding = restored['layer_0']['attn']['wq'].sharding
  data_mesh = sharding.make_mesh(2, 2)  # The data axis spans the processes.
  assert {d.process_index for d in data_mesh.devices[0]} != {d.process_index
                                                             for d in data_mesh.devices[1]}
  spread = spread_prompts_tokens(data_mesh)
  with open(os.path.join(out_dir, 'tokenizer.model'), 'rb') as f:
    tok = Tokenizer.from_bytes(f.read())
  table = table_completions(tok, data_mesh)
  result = dict(
      spread_prompts_sps=distributed.gather(spread).tolist(), table=table,
      mesh_processes=sorted(spans), ars=distributed.gather(ars).tolist(),
      sps=distributed.gather(sps).tolist(), checkpoint_equal=all(jax.tree.leaves(same)),
      restored_layout_kept=restored_sharding == wq.sharding, data_state=data_state, meta=meta)
  if distributed.is_main():
    with open(os.path.join(out_dir, 'result.json'), 'w', encoding='utf-8') as f:
      json.dump(result, f)
  distributed.print0('generation and checkpoint checks done')


def main(address: str, process_id: int, out_dir: str) -> None:
  distributed.initialize(distributed.Options(address, num_processes=2, process_id=process_id))
  check(out_dir)
  distributed.print0('worker done')


if __name__ == '__main__':
  main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
