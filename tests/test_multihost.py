"""Two local processes with 2 CPU devices each form one 4-device mesh (`model` axis across both):
greedy ArS and SpS give the single-process tokens, also with the `data` axis across the processes
and prompts no process holds whole; a short Table 1 on that mesh gives the single-process
completions; a checkpoint saves and restores from both.

The processes talk through gloo on 127.0.0.1; the test kills them (whole process groups) and frees
the port even when it fails.
"""

import json
import os
import signal
import socket
import subprocess
import sys

import numpy as np

from tests import data_helpers, multihost_worker, xla_env

_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'multihost_worker.py')


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def test_two_processes_match_one(tmp_path):
  expected_ars, expected_sps, _, _ = multihost_worker.generate(mesh=None)
  tok = data_helpers.small_tokenizer()
  (tmp_path / 'tokenizer.model').write_bytes(tok.to_bytes())
  expected_table = multihost_worker.table_completions(tok, mesh=None)
  env = xla_env.subprocess_env(devices=2, JAX_PLATFORMS='cpu')
  address = f'127.0.0.1:{_free_port()}'
  logs = [open(tmp_path / f'process_{i}.log', 'w', encoding='utf-8') for i in range(2)]
  procs = []
  try:
    for i in range(2):
      procs.append(subprocess.Popen(
          [sys.executable, _WORKER, address, str(i), str(tmp_path)], env=env, stdout=logs[i],
          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True))
    codes = [p.wait(timeout=240) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    for f in logs:
      f.close()
  output = '\n'.join((tmp_path / f'process_{i}.log').read_text()[-3000:] for i in range(2))
  assert codes == [0, 0], output
  result = json.loads((tmp_path / 'result.json').read_text())
  assert result['mesh_processes'] == [0, 1]
  np.testing.assert_array_equal(np.array(result['ars']), np.asarray(expected_ars))
  np.testing.assert_array_equal(np.array(result['sps']), np.asarray(expected_sps))
  np.testing.assert_array_equal(np.asarray(expected_sps), np.asarray(expected_ars))
  np.testing.assert_array_equal(np.array(result['spread_prompts_sps']), np.asarray(expected_sps))
  assert result['table'] == [list(c) for c in expected_table]
  assert result['checkpoint_equal'] and result['restored_layout_kept']
  assert result['data_state'] == {'position': 7} and result['meta'] == {'note': 'multihost'}
  assert 'worker done' in output
