"""`spsjax.bench.deviceless`: programs compiled from shapes alone, and the compile-only GPU device
and TPU slices (whose CUDA plugin and libtpu CI does not install: there, the error says what to
install)."""

import importlib.util
import os
import re
import subprocess
import sys

import jax
import pytest

from spsjax import models, sharding
from spsjax.bench import decode, deviceless, hlo
from tests.test_bench_profile import CONFIG, random_model

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _num_params(config):
  return sum(x.size for x in jax.tree.leaves(models.param_shapes(config)))


def _mesh(data=1, model=1):
  return sharding.make_mesh(data, model, jax.devices('cpu')[:data * model])


def test_a_step_compiled_from_shapes_is_the_step_compiled_from_values():
  mesh = _mesh()
  compiled = deviceless.compile_step(deviceless.abstract_model(CONFIG, mesh), mesh, capacity=16,
                                     steps=4)
  by_phase = hlo.loop_launches_by_phase(compiled.as_text(), trips=True)
  assert set(by_phase) == {'other'} and by_phase['other'] > 10 * CONFIG.num_layers
  assert sum(by_phase.values()) == decode.extend_launches(random_model(CONFIG, 0), 1, 16, steps=4)
  assert hlo.loop_collectives(compiled.as_text()) == 0
  # One device holds the weights (float32) and the cache, at least.
  weights = 4 * _num_params(CONFIG)
  assert weights < deviceless.device_bytes(compiled) < 4 * weights


def test_on_a_mesh_a_device_holds_its_shard_and_the_model_axis_adds_collectives():
  """SpS on 2 devices (model = 2): half the weights a device (and a bit), and the
  Megatron all-reduces of both models' layers in the loop."""
  rows = {}
  for model_axis in (1, 2):
    mesh = _mesh(1, model_axis)
    compiled = deviceless.compile_sps(deviceless.abstract_model(CONFIG, mesh),
                                      deviceless.abstract_model(CONFIG, mesh), mesh, k=2,
                                      prompt_len=8, max_new_tokens=8)
    rows[model_axis] = (hlo.loop_collectives(compiled.as_text()),
                        deviceless.device_bytes(compiled))
  assert rows[1][0] == 0 and rows[2][0] >= 2 * 2 * CONFIG.num_layers, rows
  assert 0.45 < rows[2][1] / rows[1][1] < 0.8, rows


def test_targets():
  assert deviceless.GPU_TARGETS == ('h100', 'h200')
  assert deviceless.TPU_TARGETS == ('v5e', 'v6e', 'v5p')
  assert deviceless.TARGETS == deviceless.GPU_TARGETS + deviceless.TPU_TARGETS
  config = deviceless.target_config('h200')
  assert 'memory_bandwidth: 4800000000000' in config and 'NVIDIA H200' in config
  assert 'major: 9' in deviceless.target_config('h100')
  with pytest.raises(ValueError, match='Unknown GPU target'):
    deviceless.target_config('a100')
  # What no plugin is asked about: an unknown target, a GPU mesh, a slice of no TPU's shape.
  with pytest.raises(ValueError, match='Unknown target'):
    deviceless.devices('a100')
  with pytest.raises(ValueError, match='comes alone'):
    deviceless.devices('h200', 4)
  with pytest.raises(ValueError, match='1, 2, 4, 8 chips, not 3'):
    deviceless.devices('v5e', 3)
  assert deviceless.libtpu_requirement().startswith(('libtpu', 'jax[tpu]'))


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
  mesh = sharding.make_mesh(1, 1, [gpu])
  assert 'gemm_fusion' in deviceless.compile_step(deviceless.abstract_model(config, mesh),
                                                  mesh).as_text()


def test_a_compile_only_tpu_slice_or_what_to_install():
  os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')  # Before libtpu loads.
  if importlib.util.find_spec('libtpu') is None:
    with pytest.raises(RuntimeError, match=re.escape(deviceless.libtpu_requirement())):
      deviceless.devices('v5e', 4)
    return
  try:  # With libtpu: a 4-chip slice, and the model axis's all-reduces over it.
    chips = deviceless.devices('v5e', 4)
  except RuntimeError as e:  # It looked for a TPU (JAX_PLATFORMS not cpu) and found none.
    assert 'JAX_PLATFORMS=cpu' in str(e)
    return
  assert len(chips) == 4 and {c.platform for c in chips} == {'tpu'}
  mesh = sharding.make_mesh(1, 4, chips)
  config = models.TransformerConfig(**dict(CONFIG.__dict__, dtype='bfloat16'))
  compiled = deviceless.compile_step(deviceless.abstract_model(config, mesh), mesh)
  assert hlo.loop_collectives(compiled.as_text()) >= 2 * CONFIG.num_layers
  assert deviceless.device_bytes(compiled) > 2 * _num_params(config) / 4  # Its bf16 shard, or more.


def _run_binary(*flags: str, check: bool = True) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, os.path.join(_ROOT, 'experiments', 'compile_only.py'),
                         *flags], check=check, cwd=_ROOT, env=dict(os.environ, PYTHONPATH=_ROOT),
                        capture_output=True, text=True)


def test_the_binary_counts_on_this_machines_cpu(tmp_path):
  """On 2 of the test process's 8 CPU devices, the model axis across them."""
  out = tmp_path / 'launches.md'
  _run_binary('--target=cpu', '--model_axis=2', '--batch=2', '--target_preset=tiny_target',
              '--program=step', '--program=sps', '--drafter=heads', '--k=3', '--single_row=plain',
              '--temperature=0.8', '--top_p=0.9', f'--dump_dir={tmp_path}', f'--out={out}')
  cells = {tuple(c.strip() for c in line.split('|')[1:3]): line.split('|')[4:12]
           for line in out.read_text().splitlines() if line.startswith('| s')}
  assert all(f in out.read_text() for f in ('mesh 1 x 2', 'batch 2', 'temperature 0.8, top-p 0.9'))
  rows = {name: [int(c) for c in row[:5]] for name, row in cells.items()}
  assert list(rows) == [('step', '-'), ('sps', 'heads')], rows
  for name, row in cells.items():  # Collectives, then MiB a device (the tiny models: < 100).
    assert int(row[5]) == hlo.loop_collectives(
        (tmp_path / f'{name[0]}{"_heads" if name[0] == "sps" else ""}_plain.hlo.txt').read_text())
    assert int(row[5]) > 0 and 0 < float(row[6]) < 100, row
  # The step: XLA's CPU code has no phases; all = the loop's operations in its HLO.
  assert rows['step', '-'][-1] == rows['step', '-'][3] == sum(hlo.loop_launches_by_phase(
      (tmp_path / 'step_plain.hlo.txt').read_text(), trips=True).values()) > 0
  # SpS with k = 3 parallel heads (a head model with 3): every phase launches something.
  draft, score, accept, _, total = rows['sps', 'heads']
  assert min(draft, score, accept) > 0 and total == sum(rows['sps', 'heads'][:4])
  assert total == sum(hlo.loop_launches_by_phase(
      (tmp_path / 'sps_heads_plain.hlo.txt').read_text(), trips=True).values())


@pytest.mark.parametrize('flags,message', [
    (('--program=sps', '--drafter=lookup', '--stop_below=0.3'), 'pass --drafter=model or hybrid'),
    (('--program=step', '--drafter=feature'), 'pass --program=sps too'),
    (('--model_axis=0',), 'must be >= 1'),
    (('--data=2',), 'must be a positive multiple of the mesh\'s data axis (2)'),
    (('--data=4', '--model_axis=4', '--batch=4'), 'needs 16 CPU devices'),
    (('--top_p=1.5',), 'top_p'), (('--launches',), '--launches reads XLA:GPU')])
def test_flags_that_cannot_work_are_usage_errors(flags, message):
  result = _run_binary('--target=cpu', *flags, check=False)
  assert result.returncode == 1 and message in result.stderr, result.stderr[-2000:]
