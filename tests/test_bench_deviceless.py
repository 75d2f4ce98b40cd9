"""`spsjax.bench.deviceless`: programs compiled from shapes alone, and the compile-only GPU device
(whose CUDA plugin CI does not install: there, the error says what to install)."""

import importlib.util
import os
import subprocess
import sys

import jax
import pytest

from spsjax import models
from spsjax.bench import decode, deviceless, hlo
from tests.test_bench_profile import CONFIG, random_model

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_step_compiled_from_shapes_is_the_step_compiled_from_values():
  cpu = jax.devices('cpu')[0]
  text = deviceless.step_hlo(deviceless.abstract_model(CONFIG, cpu), cpu, capacity=16, steps=4)
  by_phase = hlo.loop_launches_by_phase(text, trips=True)
  assert set(by_phase) == {'other'} and by_phase['other'] > 10 * CONFIG.num_layers
  assert sum(by_phase.values()) == decode.extend_launches(random_model(CONFIG, 0), 1, 16, steps=4)


def test_gpu_targets():
  assert deviceless.TARGETS == ('h100', 'h200')
  config = deviceless.target_config('h200')
  assert 'memory_bandwidth: 4800000000000' in config and 'NVIDIA H200' in config
  assert 'major: 9' in deviceless.target_config('h100')
  with pytest.raises(ValueError, match='Unknown GPU target'):
    deviceless.target_config('a100')


def test_a_compile_only_gpu_device_or_what_to_install():
  if importlib.util.find_spec('jax_cuda12_plugin') is None:
    with pytest.raises(RuntimeError, match=f'jax-cuda12-plugin=={jax.__version__}'):
      deviceless.device('h200')
    return
  try:  # With the plugin: a GEMM fusion in a GPU's HLO, if the plugin could start.
    gpu = deviceless.device('h200')
  except RuntimeError as e:  # It looked for a GPU (JAX_PLATFORMS not cpu) and found none.
    assert 'JAX_PLATFORMS=cpu' in str(e)
    return
  config = models.TransformerConfig(**dict(CONFIG.__dict__, dtype='bfloat16', single_row='padded'))
  assert 'gemm_fusion' in deviceless.step_hlo(deviceless.abstract_model(config, gpu), gpu)


def _run_binary(*flags: str, check: bool = True) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, os.path.join(_ROOT, 'experiments', 'gpu_launches.py'),
                         *flags], check=check, cwd=_ROOT, env=dict(os.environ, PYTHONPATH=_ROOT),
                        capture_output=True, text=True)


def test_the_binary_counts_on_this_machines_cpu(tmp_path):
  out = tmp_path / 'launches.md'
  _run_binary('--target=cpu', '--target_preset=tiny_target', '--program=step', '--program=sps',
              '--drafter=heads', '--k=3', '--single_row=plain', f'--dump_dir={tmp_path}',
              f'--out={out}')
  rows = {tuple(c.strip() for c in line.split('|')[1:3]): [int(c) for c in line.split('|')[4:9]]
          for line in out.read_text().splitlines() if line.startswith('| s')}
  assert list(rows) == [('step', '-'), ('sps', 'heads')], rows
  # The step: XLA's CPU code has no phases; all = the loop's launches in its HLO.
  assert rows['step', '-'][-1] == rows['step', '-'][3] == hlo.loop_launches(
      (tmp_path / 'step_plain.hlo.txt').read_text()) > 0
  # SpS with k = 3 parallel heads (a head model with 3): every phase launches something.
  draft, score, accept, _, total = rows['sps', 'heads']
  assert min(draft, score, accept) > 0 and total == sum(rows['sps', 'heads'][:4])
  assert total == sum(hlo.loop_launches_by_phase(
      (tmp_path / 'sps_heads_plain.hlo.txt').read_text(), trips=True).values())


@pytest.mark.parametrize('flags,message', [
    (('--program=sps', '--drafter=lookup', '--stop_below=0.3'), 'pass --drafter=model or hybrid'),
    (('--program=step', '--drafter=feature'), 'pass --program=sps too')])
def test_drafter_flags_that_would_do_nothing_are_usage_errors(flags, message):
  result = _run_binary('--target=cpu', *flags, check=False)
  assert result.returncode == 1 and message in result.stderr, result.stderr[-2000:]
