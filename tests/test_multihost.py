"""Two local processes with 2 CPU devices each form one 4-device mesh (`model` axis across both):
greedy ArS and SpS give the single-process tokens, also with the `data` axis across the processes
and prompts no process holds whole; a short Table 1 on that mesh gives the single-process
completions; a checkpoint saves and restores from both. Training with `model` across the
processes sees the batches of one process on the same mesh layout and, killed in both processes
after a save and resumed, ends with that process's losses and parameters bit for bit; a model on
that layout evaluates (held-out loss, alpha) as one process does.

One pair of processes does all but the resumption (`multihost_worker.check`, then
`multihost_train_worker.py first`, which dies in training); a second pair resumes. The processes
talk through gloo on 127.0.0.1; the test kills them (whole process groups) and frees the port even
when it fails.
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
  # Not the run's compilation cache: with JAX 0.12 (Python 3.12+) the resumed pair, loading the
  # programs the first pair cached, hung in its first training step (gloo, CPU).
  env.pop('JAX_COMPILATION_CACHE_DIR', None)
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
  """The short Table 1's completions in one process, on one device."""
  return [list(c) for c in multihost_worker.table_completions(data_helpers.small_tokenizer(),
                                                              mesh=None)]


@pytest.fixture(scope='module', name='first_pair')
def fixture_first_pair(tmp_path_factory):
  """(directory, exit codes, log tails) of the pair of processes that runs
  `multihost_worker.check` and then `multihost_train_worker.py first` (which kills them)."""
  out_dir = tmp_path_factory.mktemp('multihost')
  (out_dir / 'tokenizer.model').write_bytes(data_helpers.small_tokenizer().to_bytes())
  codes, output = _run_workers(_TRAIN_WORKER, out_dir, 'first', name='first',
                               SPSJAX_TEST_DATA_DIR=data_helpers.data_dir())
  return out_dir, codes, output


def test_two_processes_match_one(first_pair, expected_table):
  expected_ars, expected_sps, _, _ = multihost_worker.generate(mesh=None)
  out_dir, _, output = first_pair
  assert 'generation and checkpoint checks done' in output, output
  result = json.loads((out_dir / 'result.json').read_text())
  assert result['mesh_processes'] == [0, 1]
  np.testing.assert_array_equal(np.array(result['ars']), np.asarray(expected_ars))
  np.testing.assert_array_equal(np.array(result['sps']), np.asarray(expected_sps))
  np.testing.assert_array_equal(np.asarray(expected_sps), np.asarray(expected_ars))
  np.testing.assert_array_equal(np.array(result['spread_prompts_sps']), np.asarray(expected_sps))
  assert result['table'] == expected_table
  assert result['checkpoint_equal'] and result['restored_layout_kept']
  assert result['data_state'] == {'position': 7} and result['meta'] == {'note': 'multihost'}


def _npz_leaves(path) -> list[np.ndarray]:
  with np.load(path) as f:
    return [f[f'arr_{i}'] for i in range(len(f.files))]


def test_training_with_the_model_axis_across_processes(first_pair, tmp_path):
  """Every process builds its devices' rows from the same global batch: with `model` across the
  processes (each holds every row) training sees the one process's batches, not a batch per
  process; killed in both processes after a save, it resumes to the bits of the uninterrupted run
  of one process (the losses, the held-out loss and every parameter)."""
  out_dir, codes, output = first_pair
  tok = data_helpers.small_tokenizer()
  assert codes == [-signal.SIGKILL] * 2, output
  assert max(int(d) for d in os.listdir(out_dir / 'run') if d.isdigit()) == 4
  codes, output = _run_workers(_TRAIN_WORKER, out_dir, 'resume', name='resume',
                               SPSJAX_TEST_DATA_DIR=data_helpers.data_dir())
  assert codes == [0, 0] and 'worker done' in output, output
  first = json.loads((out_dir / 'first.json').read_text())
  resumed = json.loads((out_dir / 'resume.json').read_text())
  assert first['model_rows'] == [[0, 1], [0, 1]]  # Each data row spans both processes.

  # One process, the same layout of 4 of its devices, uninterrupted.
  worker = multihost_train_worker
  mesh = sharding.mesh_of(worker.layout([jax.devices()[:2], jax.devices()[2:4]]))
  state, metrics = train_helpers.run(str(tmp_path / 'single'), config=worker.CONFIG, mesh=mesh,
                                     tok=tok)
  keys = ('loss', 'lm_loss', 'grad_norm', 'eval_loss')
  assert {k: resumed['metrics'][k] for k in keys} == {k: metrics[k] for k in keys}
  params = [np.asarray(x) for x in jax.tree.leaves(state.params)]
  got = _npz_leaves(out_dir / 'resume.npz')
  assert len(got) == len(params) and all(np.array_equal(a, b) for a, b in zip(got, params))
  assert resumed['step'] == worker.CONFIG.steps
  # The one process's batches, each seen once: up to the kill, then from step 4 on again.
  seen, single = (train_helpers.seen(str(d)) for d in (out_dir / 'run', tmp_path / 'single'))
  assert seen[:worker.KILL_AT] == single[:worker.KILL_AT]
  assert seen[worker.KILL_AT:] == single[4:]
  assert first['evaluate'] == worker.evaluate(tok, mesh)
