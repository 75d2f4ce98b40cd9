"""Two local processes with 2 CPU devices each form one 4-device mesh (`model` axis across both):
greedy ArS and SpS give the single-process tokens, also with the `data` axis across the processes
and prompts no process holds whole; a short Table 1 on that mesh gives the single-process
completions; a checkpoint saves and restores from both. Training with `model` across the
processes gives the losses and parameters of one process on the same mesh layout, resumes
bit-exactly after both processes are killed, and its model evaluates (held-out loss, alpha) and
runs a Table 1 row as one process does.

The processes talk through gloo on 127.0.0.1; the test kills them (whole process groups) and frees
the port even when it fails.
"""

import json
import os
import signal
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from spsjax import sharding
from tests import data_helpers, multihost_train_worker, multihost_worker, train_helpers, xla_env

_HERE = os.path.dirname(os.path.abspath(__file__))
_WORKER = os.path.join(_HERE, 'multihost_worker.py')
_TRAIN_WORKER = os.path.join(_HERE, 'multihost_train_worker.py')


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _run_workers(worker: str, out_dir, *args: str, name: str = 'process',
                 **env: str) -> tuple[list[int], str]:
  """Runs `worker ADDRESS PROCESS_ID OUT_DIR *args` as processes 0 and 1 (2 CPU devices each);
  returns their exit codes and the tails of their logs (`out_dir/<name>_<i>.log`)."""
  env = xla_env.subprocess_env(devices=2, JAX_PLATFORMS='cpu', **env)
  address = f'127.0.0.1:{_free_port()}'
  logs = [open(out_dir / f'{name}_{i}.log', 'w', encoding='utf-8') for i in range(2)]
  procs = []
  try:
    for i in range(2):
      procs.append(subprocess.Popen(
          [sys.executable, worker, address, str(i), str(out_dir), *args], env=env, stdout=logs[i],
          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True))
    codes = [p.wait(timeout=240) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    for f in logs:
      f.close()
  return codes, '\n'.join((out_dir / f'{name}_{i}.log').read_text()[-3000:] for i in range(2))


@pytest.fixture(scope='module', name='expected_table')
def fixture_expected_table():
  """The short Table 1's completions in one process, on one device (both tests compare to it)."""
  return [list(c) for c in multihost_worker.table_completions(data_helpers.small_tokenizer(),
                                                              mesh=None)]


def test_two_processes_match_one(tmp_path, expected_table):
  expected_ars, expected_sps, _, _ = multihost_worker.generate(mesh=None)
  tok = data_helpers.small_tokenizer()
  (tmp_path / 'tokenizer.model').write_bytes(tok.to_bytes())
  codes, output = _run_workers(_WORKER, tmp_path)
  assert codes == [0, 0], output
  result = json.loads((tmp_path / 'result.json').read_text())
  assert result['mesh_processes'] == [0, 1]
  np.testing.assert_array_equal(np.array(result['ars']), np.asarray(expected_ars))
  np.testing.assert_array_equal(np.array(result['sps']), np.asarray(expected_sps))
  np.testing.assert_array_equal(np.asarray(expected_sps), np.asarray(expected_ars))
  np.testing.assert_array_equal(np.array(result['spread_prompts_sps']), np.asarray(expected_sps))
  assert result['table'] == expected_table
  assert result['checkpoint_equal'] and result['restored_layout_kept']
  assert result['data_state'] == {'position': 7} and result['meta'] == {'note': 'multihost'}
  assert 'worker done' in output


def _npz_leaves(path) -> list[np.ndarray]:
  with np.load(path) as f:
    return [f[f'arr_{i}'] for i in range(len(f.files))]


def test_training_with_the_model_axis_across_processes(tmp_path, expected_table):
  """Every process builds its devices' rows from the same global batch: with `model` across the
  processes (each holds every row) training sees the one process's batches, not a batch per
  process; killed in both processes after a save, it resumes to the uninterrupted run's bits."""
  tok = data_helpers.small_tokenizer()
  (tmp_path / 'tokenizer.model').write_bytes(tok.to_bytes())
  data = {'SPSJAX_TEST_DATA_DIR': data_helpers.data_dir()}
  codes, output = _run_workers(_TRAIN_WORKER, tmp_path, 'first', name='first', **data)
  assert codes == [-signal.SIGKILL] * 2, output
  assert max(int(d) for d in os.listdir(tmp_path / 'run') if d.isdigit()) == 4
  codes, output = _run_workers(_TRAIN_WORKER, tmp_path, 'resume', name='resume', **data)
  assert codes == [0, 0] and 'worker done' in output, output
  first = json.loads((tmp_path / 'first.json').read_text())
  resumed = json.loads((tmp_path / 'resume.json').read_text())
  assert first['model_rows'] == [[0, 1], [0, 1]]  # Each data row spans both processes.

  # One process, the same layout of 4 of its devices.
  worker = multihost_train_worker
  mesh = sharding.mesh_of(worker.layout([jax.devices()[:2], jax.devices()[2:4]]))
  state, metrics = train_helpers.run(str(tmp_path / 'single'), config=worker.CONFIG, mesh=mesh,
                                     tok=tok)
  keys = ('loss', 'lm_loss', 'grad_norm', 'eval_loss')
  assert {k: first['metrics'][k] for k in keys} == {k: metrics[k] for k in keys}
  params = [np.asarray(x) for x in jax.tree.leaves(state.params)]
  for got in (_npz_leaves(tmp_path / 'first.npz'), _npz_leaves(tmp_path / 'resume.npz')):
    assert len(got) == len(params) and all(np.array_equal(a, b) for a, b in zip(got, params))
  assert resumed['step'] == worker.CONFIG.steps  # Each batch seen once, from step 4 on again:
  assert (train_helpers.seen(str(tmp_path / 'run'))[worker.KILL_AT:]
          == train_helpers.seen(str(tmp_path / 'finished'))[4:])
  assert resumed['metrics']['eval_loss'] == metrics['eval_loss']
  assert first['evaluate'] == worker.evaluate(tok, mesh)
  assert first['table'] == expected_table
