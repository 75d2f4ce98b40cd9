"""The binaries start, parse their configs and run end to end (smallest settings)."""

import os
import subprocess
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args):
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  return subprocess.run([sys.executable, *args], cwd=_REPO, env=env, capture_output=True,
                        text=True, timeout=300, check=False)


def test_sample_sps_on_random_models():
  run = _run('experiments/sample.py',
             '--config=configs/sample.py:method=sps,k=3,batch=2,runlocal',
             '--config.repeats=1')
  assert run.returncode == 0, run.stderr[-3000:]
  assert 'NOTE: randomly initialised' in run.stdout and 'acceptance rate' in run.stdout
  assert run.stdout.count('--- row ') == 2


def test_bad_config_argument_is_a_clear_error():
  run = _run('experiments/train.py', '--config=configs/train.py:size=huge')
  assert run.returncode != 0 and "size must be one of ['demo', 'reference', 'tiny']" in run.stderr
