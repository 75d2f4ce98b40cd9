"""One writer and one build across processes (`tests/multihost_storage_worker.py`, 2 processes).

Both processes call every writer of results and the family tokenizer on a fake gs:// bucket that
records each process's writes: process 1 writes nothing (and nothing lands under either working
directory), process 0 writes everything, and only process 0 trains the tokenizer, which both then
read. A dataset in a shared data directory is built by process 0 alone; in a directory per host
each host builds its own, and when those copies differ (process 1's HumanEval has another first
prompt) both processes fail at load, naming the split.

The processes talk through gloo on 127.0.0.1; the test kills them (whole process groups) and frees
the port even when it fails.
"""

import json
import os
import signal
import subprocess
import sys

from tests import fake_gcs, xla_env
from tests.test_multihost import _free_port

_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'multihost_storage_worker.py')
_BUCKET = 'gs://spsjax-multihost'


def test_one_writer_and_one_build(tmp_path):
  env = xla_env.subprocess_env(devices=1, JAX_PLATFORMS='cpu')
  address = f'127.0.0.1:{_free_port()}'
  logs = [open(tmp_path / f'process_{i}.log', 'w', encoding='utf-8') for i in range(2)]
  procs = []
  try:
    for i in range(2):
      cwd = tmp_path / f'cwd_{i}'
      cwd.mkdir()
      procs.append(subprocess.Popen(
          [sys.executable, _WORKER, address, str(i), str(tmp_path)], env=env, cwd=cwd,
          stdout=logs[i], stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
          start_new_session=True))
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
  assert 'worker done' in output
  main, other = (json.loads((tmp_path / f'observed_{i}.json').read_text()) for i in range(2))
  for i in range(2):
    assert fake_gcs.stray_writes(str(tmp_path / f'cwd_{i}')) == []

  # One writer.
  assert other['bucket_writes'] == []
  written = {path for call, path in main['bucket_writes'] if call == 'open'}
  results = f'{_BUCKET}/results'
  assert {f'{results}/table.md', f'{results}/table.json', f'{results}/points.csv',
          f'{results}/figure1.png', main['xplane'], f'{_BUCKET}/export/spsjax_tokenizer.model'
          } <= written, written
  assert any(path.startswith(f'{_BUCKET}/family/.tokenizer.model.') for path in written)
  assert (tmp_path / 'gcs' / 'spsjax-multihost' / 'results' / 'table.md').read_text() == (
      'written by process 0\n')
  assert main['trained_tokenizer'] and not other['trained_tokenizer']
  assert main['xplane'].endswith('.xplane.pb')  # Process 0's own trace, copied to the bucket.

  # One build per data directory; different copies are caught.
  assert [main['shared_dir']['builds'], other['shared_dir']['builds']] == [1, 0]
  assert main['shared_dir']['records'] == other['shared_dir']['records'] == 164
  assert main['shared_dir']['error'] is None and other['shared_dir']['error'] is None
  assert [main['own_dirs']['builds'], other['own_dirs']['builds']] == [1, 1]
  for seen in (main, other):
    assert 'dataset humaneval/test differs between processes (processes [0] hold ' in (
        seen['own_dirs']['error'] or ''), seen['own_dirs']
